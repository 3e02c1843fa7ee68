"""Attention forward, and forward + backward: pk_jax.attention(implementation="pk") vs cuDNN
(jax.nn.dot_product_attention(implementation="cudnn")) in the same run, bf16.

Rows: suite "attention", shape [B, S, N, D] (S = Tq = Tk), case fwd / fwd_causal / fwd_gqa (K = N / 8) /
fwd_causal_gqa, and fwd_bwd* the same four with the gradients (jax.vjp: the forward, then dq, dk, dv
from a random cotangent; ours runs our forward kernel and the backward pk_jax.attention picks: our backward
kernel unless PK_JAX_ATTENTION_BWD=xla); TFLOP/s count 4 B S² N D for the forward (causal: half) and 2.5 times
that for the backward (as FlashAttention counts: fwd+bwd = 3.5x). `cases`, `seqs`, `head_dims` (--cases,
--seqs, --head-dims on the command line) pick a subset. Default: B*S = 64k tokens, S = 1024..65536, N = 16
(D 128) / 32 (D 64), every case. --variants: the full sweep, B*S = 64k..512k tokens and N = 16..128, and on
GPUs the base kernel's second consumer schedule (pk_jax.attention.SCHEDULES: "pipelined"; 0.59-0.81x cuDNN
against base's 0.73-0.95x on 2026-11-23) and the forward variants other than the default
(pk_jax.attention.FWD_VARIANTS / DEFAULT_FWD_VARIANT: fa3n160) timed in the same turns as the default and cuDNN
(forward cases): extra.<name>_ms /
<name>_ratio / <name>_tflops / <name>_rel_err / <name>_check, <name>_bits_differ_in (the outputs whose bits
differ from the default's) and <name>_same_bits (none does: required of pk_jax.attention.FWD_VARIANTS_SAME_BITS
only; fa3n160's and fa3n176's other key blocks change the last bits, so for it the flag is informative and
<name>_check, the error against cuDNN, is the test). --fwd-variants: the default shapes with the forward
variants only (no pipelined): the short comparison, e.g. `--fwd-variants --cases fwd fwd_causal fwd_gqa
--seqs 4096 16384 --head-dims 128` (6 rows, ~1-2 min on one H200); `--fwd-variants fa3n160 fa3n176 --cases ...`
times only the named variants beside the default. --bwd-variants [NAME...]: the fwd_bwd* rows also time the
backward variants (pk_jax.attention.BWD_VARIANTS other than DEFAULT_BWD_VARIANT, or the named ones) as
extra.bwd_<name>_*, e.g. `--bwd-variants --cases fwd_bwd fwd_bwd_causal fwd_bwd_gqa --seqs 4096 16384
--head-dims 128`; their same-bits flag compares out, dK and dV (dQ's reduce order varies). Without a GPU: tiny sizes, both sides
run XLA (plumbing only).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

import pk_jax
from pk_jax.attention import (BWD_VARIANT_VAR, BWD_VARIANTS, DEFAULT_BWD_VARIANT, DEFAULT_FWD_VARIANT,
                              FWD_VARIANT_VAR, FWD_VARIANTS, FWD_VARIANTS_SAME_BITS, SCHEDULE_VAR)
from pk_jax.bench import results, timing
from pk_jax.bench.compile_ahead import CompileAhead
from pk_jax.bench.progress import Progress

CASES = {"fwd": (False, 1), "fwd_causal": (True, 1), "fwd_gqa": (False, 8), "fwd_causal_gqa": (True, 8)}
CASES.update({"fwd_bwd" + name[3:]: spec for name, spec in list(CASES.items())})
BWD_FLOPS = 2.5  # backward FLOPs per forward FLOP


def _with_grads(fn):
    """(q, k, v, d_out) -> (out, dq, dk, dv): the forward and its VJP, as training runs them."""
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(d_out))
    return run


def shapes(quick: bool, full: bool, on_gpu: bool) -> list[tuple[int, int, int, int]]:
    """[B, S, N, D] to time."""
    if quick or not on_gpu:
        return [(2, 256, 8, 64), (1, 512, 8, 128)]
    seqs = (1024, 4096, 16384, 65536)
    if not full:
        return [(65536 // s, s, 16 if d == 128 else 32, d) for d in (128, 64) for s in seqs]
    out = []
    for tokens in (65536, 262144, 524288):
        for s in seqs:
            for n, d in ((16, 128), (64, 128), (128, 128), (32, 64), (128, 64)):
                if tokens * n * d * 2 <= (1 << 30):  # q at most 1 GiB
                    out.append((tokens // s, s, n, d))
    return out


def _baseline(causal: bool, on_gpu: bool):
    """cuDNN on GPUs; XLA where cuDNN is absent (the row names which)."""
    impl = "cudnn" if on_gpu else None
    return impl or "xla", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def _inputs(b, s, n, kh, d, count, seed, grads=False):
    make = jax.jit(lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16), static_argnums=1)
    heads = (n, kh, kh, n) if grads else (n, kh, kh)  # grads: d_out too
    return [tuple(make(jax.random.key(seed + 4 * i + j), (b, s, h, d)) for j, h in enumerate(heads))
            for i in range(count)]


def _runner(fn):
    return jax.jit(lambda triples: [fn(*t) for t in triples])


def _compiled_with_schedule(fn, triples, kernel: str, ahead=None):
    """_runner(fn) compiled (or `ahead`'s compile of it, started earlier: compile_ahead), with the kernel version
    `kernel` chosen by the variables read at lowering."""
    return ahead.result() if ahead is not None else _lowered_with_schedule(fn, triples, kernel).compile()


def _lowered_with_schedule(fn, triples, kernel: str):
    """_runner(fn) lowered now (triples: arrays or ShapeDtypeStructs), with the kernel version `kernel` chosen by the
    variables read at lowering:
    "default" = what a user gets (both variables empty: pk_jax.attention.default_fwd_variant and default_bwd_variant
    of the shape); "pipelined" = the base variant's second consumer schedule; a forward variant's name (FWD_VARIANTS)
    that variant, at every length; "bwd_<name>" the default forward with backward variant <name> (BWD_VARIANTS). The
    backward variant is the shape's default unless named."""
    env = {SCHEDULE_VAR: "in_turn", FWD_VARIANT_VAR: "" if kernel == "default" else kernel, BWD_VARIANT_VAR: ""}
    if kernel == "pipelined":
        env.update({SCHEDULE_VAR: "pipelined", FWD_VARIANT_VAR: "base"})
    elif kernel.startswith("bwd_"):
        env.update({FWD_VARIANT_VAR: "", BWD_VARIANT_VAR: kernel[len("bwd_"):]})
    old = {var: os.environ.get(var) for var in env}
    os.environ.update(env)
    try:
        return _runner(fn).lower(triples)
    finally:
        for var, value in old.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _chosen_variants(requested: list[str], variants: tuple[str, ...], default: str, kind: str) -> list[str]:
    """The variants `requested` names (in `variants`' order; the default's name too: forced, it runs at shapes where
    the per-shape default takes another), or, for an empty list, every one but `default`. Unknown names: an error."""
    if not requested:
        return [v for v in variants if v != default]
    unknown = sorted(set(requested) - set(variants))
    if unknown:
        raise ValueError(f"pk_jax.bench attention: unknown {kind} variants {unknown}; pick from {variants}")
    return [v for v in variants if v in requested]


def extra_kernels(full: bool, fwd_variants: bool | list[str]) -> list[str]:
    """The kernel versions timed beside the default on GPUs (forward cases only). fwd_variants: True (or an
    empty list) for every forward variant but DEFAULT_FWD_VARIANT, a list of names for those only."""
    chosen = isinstance(fwd_variants, (list, tuple)) or bool(fwd_variants)
    named = list(fwd_variants) if isinstance(fwd_variants, (list, tuple)) else []
    new = _chosen_variants(named, FWD_VARIANTS, DEFAULT_FWD_VARIANT, "forward")
    return (["pipelined"] + new) if full else (new if chosen else [])


def bwd_extra_kernels(bwd_variants: bool | list[str] | None) -> list[str]:
    """The backward variants timed beside the default on the fwd_bwd* rows (as "bwd_<name>"): None / False for
    none, True or [] for every one but DEFAULT_BWD_VARIANT, a list of names for those."""
    if bwd_variants is None or bwd_variants is False:
        return []
    named = list(bwd_variants) if isinstance(bwd_variants, (list, tuple)) else []
    return ["bwd_" + v for v in _chosen_variants(named, BWD_VARIANTS, DEFAULT_BWD_VARIANT, "backward")]


def _bits_differ_in(a, b) -> list[str]:
    """The outputs whose bits differ. Forward rows: ["out"] or []. fwd_bwd rows ((out, dq, dk, dv)): among out, dk
    and dv (dQ is summed by reduce-adds in a run-dependent order)."""
    if isinstance(a, (tuple, list)):
        return [name for name, x, y in zip(("out", "dq", "dk", "dv"), a, b)
                if name != "dq" and not bool(jnp.array_equal(x, y))]
    return [] if bool(jnp.array_equal(a, b)) else ["out"]


def _bits_note(differ: list[str], expected: bool) -> str:
    """The row line's note on a variant's bits: nothing when they equal the default's."""
    if not differ:
        return ""
    return f" BITS DIFFER ({', '.join(differ)})" if expected else " (other bits, as expected)"


def bits_expected(name: str) -> bool:
    """Whether kernel version `name` must give the default's bits (the schedules and FWD_VARIANTS_SAME_BITS,
    when the default is one of those)."""
    if name.startswith("bwd_"):
        return True  # every backward variant gives the default's dK / dV (and the forward is the same)
    same = ("pipelined",) + FWD_VARIANTS_SAME_BITS
    return name in same and DEFAULT_FWD_VARIANT in same


def run(quick: bool, reps: int, full: bool = False, cases: list[str] | None = None,
        seqs: list[int] | None = None, head_dims: list[int] | None = None,
        fwd_variants: bool | list[str] = False, bwd_variants: bool | list[str] | None = None) -> list[dict]:
    on_gpu = jax.devices()[0].platform == "gpu"
    extras = extra_kernels(full, fwd_variants) if on_gpu else []
    bwd_extras = bwd_extra_kernels(bwd_variants) if on_gpu else []
    unknown = sorted(set(cases or ()) - set(CASES))
    if unknown:
        raise ValueError(f"pk_jax.bench attention: unknown cases {unknown}; pick from {list(CASES)}")
    todo = [(shape, case) for shape in shapes(quick, full, on_gpu) for case in CASES if not cases or case in cases
            if (not seqs or shape[1] in seqs) and (not head_dims or shape[3] in head_dims)]
    bar = Progress(len(todo), "attention")
    rows = []

    def row_setup(b, s, n, d, case):
        """(causal, grads, kv heads, calls per measure, base name, base fn, our fn) of a row."""
        causal, ratio_kv = CASES[case]
        grads = case.startswith("fwd_bwd")
        kh = n // ratio_kv
        per_call = (2 * b * s * n * d + 2 * b * s * kh * d) * (4 if grads else 2)  # grads: + d_out, dq, dk, dv
        count = timing.calls_per_measure(per_call, budget_bytes=8 << 30, lo=2 if on_gpu else 1, hi=20 if on_gpu else 2)
        base_name, base_fn = _baseline(causal, on_gpu)
        pk_fn = lambda q, k, v: pk_jax.attention(q, k, v, causal=causal, implementation="pk")
        if grads:
            base_fn, pk_fn = _with_grads(base_fn), _with_grads(pk_fn)
        return causal, grads, kh, count, base_name, base_fn, pk_fn

    ahead = CompileAhead()  # every row's programs compiled on a thread pool before the first timing
    for (b, s, n, d), case in todo:
        _, grads, kh, count, _, base_fn, pk_fn = row_setup(b, s, n, d, case)
        heads = (n, kh, kh, n) if grads else (n, kh, kh)
        specs = [tuple(jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16) for h in heads)] * count
        for name in ["default", *(bwd_extras if grads else extras)]:
            ahead.add(((b, s, n, d), case, name), None, None,
                      lower=lambda name=name, pk_fn=pk_fn, specs=specs: _lowered_with_schedule(pk_fn, specs, name))
        ahead.add(((b, s, n, d), case, "base"), _runner(base_fn), [specs])
    ahead.wait()
    for (b, s, n, d), case in todo:
        causal, grads, kh, count, base_name, base_fn, pk_fn = row_setup(b, s, n, d, case)
        triples = _inputs(b, s, n, kh, d, count, seed=len(rows) * 101, grads=grads)
        flops = 4.0 * b * s * s * n * d * (0.5 if causal else 1.0) * (1.0 + BWD_FLOPS if grads else 1.0)
        base_ahead = ahead.get(((b, s, n, d), case, "base"))
        base = (lambda xs, f=base_ahead.result(): f(xs)) if base_ahead is not None and base_ahead.exception() is None \
            else _runner(base_fn)

        def rel(got, want):  # worst relative error norm over the outputs (out; dq, dk, dv with grads)
            got, want = (got, want) if grads else ((got,), (want,))
            return max(float(jnp.linalg.norm((g - w).astype(jnp.float32)) / jnp.linalg.norm(w.astype(jnp.float32)))
                       for g, w in zip(got, want))

        try:
            ours = _compiled_with_schedule(pk_fn, triples, "default", ahead.get(((b, s, n, d), case, "default")))
            names = bwd_extras if grads else extras
            others = [_compiled_with_schedule(pk_fn, triples, name, ahead.get(((b, s, n, d), case, name)))
                      for name in names]
            want = base(triples)[0]  # the first call's outputs (all `count` calls run: one program for both uses)
            got = ours(triples)[0]
            err = rel(got, want)
            other_out = [fn(triples)[0] for fn in others]
            other_err = [rel(o, want) for o in other_out]
            differ_in = [_bits_differ_in(o, got) for o in other_out]
            del got, other_out
            times = timing.time_interleaved([ours, base] + others, triples, reps=reps)
            ours_ms, base_ms = times[:2]
            other_ms = times[2:]
        except Exception as e:  # noqa: BLE001 (a failing shape is a row, not the end of the sweep)
            rows.append({"op": "attention", "case": case, "shape": [b, s, n, d], "dtype": "bfloat16", "group": 1,
                         "ours_ms": None, "baseline": base_name, "baseline_ms": None, "ratio": None,
                         "extra": {"check": f"FAILED {type(e).__name__}"}})
            results.add_partial(rows[-1])
            print(f"  attention {[b, s, n, d]} {case}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            bar.step(f"{case} {b}x{s}x{n}x{d}")
            continue
        ratio = base_ms / ours_ms
        rows.append({
            "op": "attention", "case": case, "shape": [b, s, n, d], "dtype": "bfloat16", "group": 1,
            "ours_ms": round(ours_ms, 5), "baseline": base_name, "baseline_ms": round(base_ms, 5),
            "ratio": round(ratio, 4),
            "extra": {"kv_heads": kh, "tflops": round(flops / ours_ms / 1e9, 1),
                      "baseline_tflops": round(flops / base_ms / 1e9, 1), "rel_err_vs_baseline": float(f"{err:.2e}"),
                      "calls_per_measure": count, "reps": reps, "check": "ok" if err < 2e-2 else "MISMATCH"},
        })
        for name, ms, e_, differ in zip(names, other_ms, other_err, differ_in):
            rows[-1]["extra"].update({
                f"{name}_ms": round(ms, 5), f"{name}_ratio": round(base_ms / ms, 4),
                f"{name}_tflops": round(flops / ms / 1e9, 1), f"{name}_rel_err": float(f"{e_:.2e}"),
                f"{name}_same_bits": not differ, f"{name}_bits_differ_in": differ,
                f"{name}_bits_expected": bits_expected(name),
                f"{name}_check": "ok" if e_ < 2e-2 else "MISMATCH"})
        results.add_partial(rows[-1])  # before its line: a run killed once the line is out keeps the row
        print(f"  attention {str([b, s, n, d]):<22} {case:<15} ours {ours_ms:8.3f} ms {flops / ours_ms / 1e9:6.0f} TF/s  "
              f"{base_name} {base_ms:8.3f} ms {flops / base_ms / 1e9:6.0f} TF/s  x{ratio:5.3f}  rel_err {err:.1e}"
              + "".join(f"  {name} {flops / ms / 1e9:4.0f} TF/s x{base_ms / ms:5.3f}"
                        f"{_bits_note(differ, bits_expected(name))}"
                        f"{'' if e_ < 2e-2 else ' MISMATCH'}"
                        for name, ms, e_, differ in zip(names, other_ms, other_err, differ_in)),
              flush=True)
        bar.step(f"{case} {b}x{s}x{n}x{d}")
        del triples
    return rows


def _extra_names(rows: list[dict]) -> list[str]:
    names = ["pipelined"] + list(FWD_VARIANTS) + ["bwd_" + v for v in BWD_VARIANTS if v != DEFAULT_BWD_VARIANT]
    return [n for n in names if any(f"{n}_ratio" in r["extra"] for r in rows)]


def bad_row(r: dict) -> bool:
    """A row whose default or any timed variant disagrees with the baseline, or a variant whose bits differ
    where they must not (<name>_bits_expected; rows written before that key existed: every variant)."""
    e = r["extra"]
    return any(v != "ok" for k, v in e.items() if k.endswith("check")) or not all(
        v for k, v in e.items() if k.endswith("_same_bits") and e.get(k[:-len("_same_bits")] + "_bits_expected", True))


def _label(name: str) -> str:
    """A column title of at most 10 characters ("bwd_l2order_dqfirst" -> "b:l2dqfirs")."""
    return name.replace("bwd_", "b:").replace("l2order_dqfirst", "l2dqfirst")[:10]


def print_table(rows: list[dict]) -> None:
    names = _extra_names(rows)
    head = (f"{'case':<16}{'[B, S, N, D]':<24}{'ours TF/s':>10}{'base TF/s':>10}{'ratio':>8}"
            + "".join(f"{_label(n) + ' x':>13}" for n in names) + "  check")
    print(head)
    print("-" * len(head))
    for r in rows:
        e = r["extra"]
        if r["ratio"] is None:
            print(f"{r['case']:<16}{str(r['shape']):<24}{'-':>10}{'-':>10}{'-':>8}  {e['check']}")
            continue
        print(f"{r['case']:<16}{str(r['shape']):<24}{e['tflops']:>10.0f}{e['baseline_tflops']:>10.0f}"
              f"{r['ratio']:>8.2f}" + "".join(f"{e.get(n + '_ratio', float('nan')):>13.3f}" for n in names)
              + f"  {'MISMATCH' if bad_row(r) else 'ok'} ({r['baseline']})")
    ok = [r["ratio"] for r in rows if r["ratio"]]
    if ok:
        print(f"geomean ratio (baseline ms / ours ms): {float(np.exp(np.mean(np.log(ok)))):.3f}")
    for n in names:
        got = [r["extra"][f"{n}_ratio"] for r in rows if f"{n}_ratio" in r["extra"]]
        mine = [r["ratio"] for r in rows if f"{n}_ratio" in r["extra"]]
        print(f"geomean ratio {n}: {float(np.exp(np.mean(np.log(got)))):.3f} (default on the same rows: "
              f"{float(np.exp(np.mean(np.log(mine)))):.3f})")
