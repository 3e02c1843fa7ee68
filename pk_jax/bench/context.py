"""`python -m pk_jax.bench context`: ring and Ulysses attention vs gathering K/V and attending locally.

Contenders per row, timed in turns in one run (one jitted call per op, median of `reps` samples, each of calls
issued back to back for about timing.DEVICE_SAMPLE_MS and one sync):
- ours: pk_jax.ring_attention (layout zigzag / contiguous) or pk_jax.ulysses_attention;
- baseline: all_gather K/V (jax.lax) + jax.nn.dot_product_attention of the local queries against the
  whole sequence, masked by global positions when causal (cuDNN on GPUs where it accepts the call, XLA
  otherwise);
- attention alone (extra.attention_alone_ms): one device's share of the work without communication,
  jax.nn.dot_product_attention over the whole sequence for B/G sequences (same FLOPs per device).
`case` = fwd | fwd_bwd, + _causal, + _zigzag | _contiguous (ring); `shape` = [B, S, N, D], S the whole
sequence; extra.peak_bytes = temp + arguments + outputs of the compiled per-device program.
Ring rows with `transports` (CLI --ring-transports pk pk-copy pk-acc pk-copy-acc xla): ours_ms is the first
transport's (PK_JAX_RING_TRANSPORT, pk_jax/context/ring_shift.py; "-copy": the copy engines move the bytes,
"-acc": the blocks merged into the ring's states by the attention kernels, TRANSPORTS), extra.transport_ms every
transport's, timed in the same turns; extra.transport_check each later transport's difference from the first.
--compute-floor (ring rows): issue 26's floor, in the same turns: extra.compute_only_ms, the ring program with
its shifts returning their inputs and no SMs reserved (each step computes on the member's own K/V: the same
blocks and glue, no transfer; timing only; each shift's inputs pass an optimization barrier of their own, else
XLA merges the steps' identical attention calls), extra.kernel_floor_ms, our attention kernel on each member's query
chunks against the keys they see (one call per chunk, every member at once), and extra.compute_over_floor
(target <= 1.05).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.bench import results, timing
from pk_jax.bench.compile_ahead import CompileAhead

AX = "sp"


@dataclasses.dataclass(frozen=True)
class Case:
    op: str             # ring_attention | ulysses_attention
    b: int
    s: int
    n: int
    d: int
    causal: bool
    layout: str         # zigzag | contiguous
    backward: bool

    @property
    def name(self) -> str:
        suffix = "_causal" if self.causal else ""
        if self.op == "ring_attention":
            suffix += f"_{self.layout}"
        return ("fwd_bwd" if self.backward else "fwd") + suffix


def cases(g: int, small: bool) -> list[Case]:
    """Ring: B16 N16 D128, S 12288 and 24576 (G <= 2) or 49152 (G >= 4: the issue's 4-GPU rows); Ulysses: B16 N128
    D128, S 2048/4096/8192 (small: tiny)."""
    ring = (8, [32 * g], 4, 16) if small else (16, [12288, 24576 if g <= 2 else 49152], 16, 128)
    uly = (8, [16 * g], 2 * g, 16) if small else (16, [2048, 4096, 8192], 128, 128)
    out = []
    for backward in (False, True):
        b, sizes, n, d = ring
        for s in sizes:
            out.append(Case("ring_attention", b, s, n, d, False, "contiguous", backward))  # layouts equal
            for layout in ("zigzag", "contiguous"):
                out.append(Case("ring_attention", b, s, n, d, True, layout, backward))
        b, sizes, n, d = uly
        for s in sizes:
            for causal in (False, True):
                out.append(Case("ulysses_attention", b, s, n, d, causal, "contiguous", backward))
    return out


def _positions(c: Case, g: int, rank) -> jax.Array:
    """Global positions of this member's local rows in the case's layout."""
    t = c.s // g
    if c.layout == "contiguous":
        return rank * t + jnp.arange(t)
    half = t // 2
    return jnp.concatenate([rank * half + jnp.arange(half), (2 * g - 1 - rank) * half + jnp.arange(half)])


def _gathered_attention(c: Case, g: int, implementation: str | None) -> Callable:
    def fn(q, k, v):
        k, v = (jax.lax.all_gather(x, AX, axis=1, tiled=True) for x in (k, v))
        mask = None
        if c.causal:
            rank = jax.lax.axis_index(AX)
            q_pos = _positions(c, g, rank)
            kv_pos = jnp.concatenate([_positions(c, g, r) for r in range(g)])
            mask = (q_pos[:, None] >= kv_pos[None, :])[None, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
    return fn


def _ours(c: Case) -> Callable:
    if c.op == "ring_attention":
        return lambda q, k, v: pk_jax.ring_attention(q, k, v, AX, causal=c.causal, layout=c.layout)
    impl = "cudnn" if jax.devices()[0].platform == "gpu" else None
    return lambda q, k, v: pk_jax.ulysses_attention(q, k, v, AX, causal=c.causal, implementation=impl)


def _program(fn: Callable, mesh: Mesh | None, backward: bool) -> Callable:
    body = fn if mesh is None else jax.shard_map(fn, mesh=mesh, in_specs=P(None, AX), out_specs=P(None, AX),
                                                 check_vma=False)
    if backward:
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(body(q, k, v).astype(jnp.float32)), (0, 1, 2)))
    return jax.jit(body)


def _peak_bytes(compiled) -> int | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


@contextlib.contextmanager
def _env(var: str, value: str | None) -> Iterator[None]:
    """$var = value while a program is traced and compiled (None: leave it as it is)."""
    if value is None:
        yield
        return
    old = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old


# --ring-transports names: the ring's transport; for "pk" what moves the bytes ("-copy": PK_JAX_RING_SHIFT_ENGINE=copy)
# and where the ring folds blocks into its states ("-acc": PK_JAX_RING_MERGE=kernel, in the attention kernels;
# "-dq": =dq, the backward's dQ only); "-cudnn": the block pairs cuDNN can mask on cuDNN (PK_JAX_RING_LOCAL=cudnn).
TRANSPORTS = {f"pk{'-copy' if engine == 'copy' else ''}{suffix}": {
                  "PK_JAX_RING_TRANSPORT": "pk", "PK_JAX_RING_SHIFT_ENGINE": engine, "PK_JAX_RING_MERGE": merge,
                  "PK_JAX_RING_LOCAL": "pk", "PK_JAX_RING_SUMS": "eager", "PK_JAX_RING_ACC_DTYPE": "float32"}
              for engine in ("sm", "copy") for suffix, merge in (("", "xla"), ("-acc", "kernel"), ("-dq", "dq"))}
TRANSPORTS["pk-copy-dq-cudnn"] = {**TRANSPORTS["pk-copy-dq"], "PK_JAX_RING_LOCAL": "cudnn"}
# "-bf16hops": every dK/dV hop of the backward in the input dtype ($PK_JAX_RING_ACC_DTYPE=input).
TRANSPORTS["pk-copy-dq-cudnn-bf16hops"] = {**TRANSPORTS["pk-copy-dq-cudnn"], "PK_JAX_RING_ACC_DTYPE": "input"}
# "-deferred": blocks merged and gradient parts summed once at the end ($PK_JAX_RING_SUMS=deferred, row_sum.py;
# the default since 2026-11-27: "pk-copy-dq-cudnn" is the eager sums, as measured before).
TRANSPORTS["pk-copy-dq-cudnn-deferred"] = {**TRANSPORTS["pk-copy-dq-cudnn"], "PK_JAX_RING_SUMS": "deferred"}
# "-split": cuDNN also takes the bottom-right pairs, as two calls each ($PK_JAX_RING_LOCAL=cudnn-split).
TRANSPORTS["pk-copy-dq-cudnn-split"] = {**TRANSPORTS["pk-copy-dq-cudnn"], "PK_JAX_RING_LOCAL": "cudnn-split"}
TRANSPORTS["pk-copy-dq-cudnn-deferred-split"] = {**TRANSPORTS["pk-copy-dq-cudnn-deferred"], "PK_JAX_RING_LOCAL": "cudnn-split"}
# "default": the settings as they are (the defaults); "direct": the defaults but $PK_JAX_RING_MERGE=dq-direct (our
# backward kernel reads q / dO rows in place and adds dQ into the ring's state itself); "split" / "whole": the
# defaults but $PK_JAX_RING_LOCAL=cudnn-split / cudnn-whole (every bottom-right pair split for cuDNN / none: the
# default splits from cudnn_block.SPLIT_MIN_ROWS rows). A/B against the defaults with these: every name above pins
# eager sums, which are no longer the default.
TRANSPORTS["default"] = {}
TRANSPORTS["direct"] = {"PK_JAX_RING_MERGE": "dq-direct"}
TRANSPORTS["split"] = {"PK_JAX_RING_LOCAL": "cudnn-split"}
TRANSPORTS["whole"] = {"PK_JAX_RING_LOCAL": "cudnn-whole"}
# "pk-direct": the defaults with every pair on our kernels and dq-direct: no cuDNN per-call work (its memsets, dO.O
# pass and dQ conversion), which bounds the 4-GPU fwd+bwd rows (docs/benchmarks.md, session 22).
TRANSPORTS["pk-direct"] = {"PK_JAX_RING_LOCAL": "pk", "PK_JAX_RING_MERGE": "dq-direct"}
# "cudnn-fwd": the forward's pairs on cuDNN (its forward is the faster), the backward's on our kernel with dq-direct
# (no cuDNN per-call backward work); "cudnn-fwd-dq": the same with the dQ added by the conversion kernel ("dq").
TRANSPORTS["cudnn-fwd"] = {"PK_JAX_RING_LOCAL": "cudnn-fwd", "PK_JAX_RING_MERGE": "dq-direct"}
TRANSPORTS["cudnn-fwd-dq"] = {"PK_JAX_RING_LOCAL": "cudnn-fwd", "PK_JAX_RING_MERGE": "dq"}
TRANSPORTS["xla"] = {"PK_JAX_RING_TRANSPORT": "xla", "PK_JAX_RING_LOCAL": "pk"}


@contextlib.contextmanager
def _transport(name: str | None) -> Iterator[None]:
    """The settings of transport `name` (TRANSPORTS) while a program is traced and compiled (None: leave them)."""
    with contextlib.ExitStack() as stack:
        for var, value in (TRANSPORTS[name] if name is not None else {}).items():
            stack.enter_context(_env(var, value))
        yield


def _compile(jitted, args, ahead: concurrent.futures.Future | None = None):
    """(callable, peak bytes, error): a contender that fails to compile (e.g. out of memory) is reported. `ahead`:
    the same program's compile started earlier (compile_ahead.CompileAhead); its result is taken instead of compiling again."""
    try:
        compiled = ahead.result() if ahead is not None else jitted.lower(*args).compile()
        return (lambda xs: compiled(*xs)), _peak_bytes(compiled), None
    except Exception as e:  # noqa: BLE001 - reported in the row, the suite goes on
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _baseline(c: Case, g: int, mesh: Mesh, args, ahead: concurrent.futures.Future | None = None):
    """The all-gather baseline with cuDNN where it accepts the call, else XLA. `ahead`: the first
    implementation's compile, started earlier."""
    impls = ["cudnn", None] if jax.devices()[0].platform == "gpu" else [None]
    err = None
    for i, impl in enumerate(impls):
        fn, peak, err = _compile(_program(_gathered_attention(c, g, impl), mesh, c.backward), args,
                                 ahead if i == 0 else None)
        if fn is not None:
            try:
                jax.block_until_ready(fn(args))
                return fn, peak, impl or "xla", None
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None, None, None, err


def _alone_program(c: Case, g: int, dtype):
    """(program, abstract inputs) of _attention_alone, or None if G does not divide B."""
    if c.b % g:
        return None
    impl = "cudnn" if jax.devices()[0].platform == "gpu" else None
    spec = jax.ShapeDtypeStruct((c.b // g, c.s, c.n, c.d), dtype)
    attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=c.causal, implementation=impl)
    return _program(attend, None, c.backward), [spec] * 3


def _attention_alone(c: Case, g: int, dtype, ahead: concurrent.futures.Future | None = None):
    """One device's share without communication: B/G whole sequences (None if G does not divide B), on random
    inputs drawn as ours are. Not zeros: tensor cores fed zeros draw less power and hold higher clocks, so zeros
    made this floor optimistic (bench runs before session 19; their `bound` columns are too high)."""
    made = _alone_program(c, g, dtype)
    if made is None:
        return None
    program, specs = made
    make = jax.jit(lambda key: jax.random.normal(key, specs[0].shape, jnp.float32).astype(dtype))
    args = [make(key) for key in jax.random.split(jax.random.key(1000 + c.s), 3)]
    fn, _, err = _compile(program, args, ahead)
    return None if fn is None else (fn, args)


@contextlib.contextmanager
def _communication_off() -> Iterator[None]:
    """While a ring program is traced: the ring shifts of pk_jax/context/ring_overlap.py return their inputs
    (each step computes on the member's own K/V block: the same block shapes, pairs and glue, no transfer) and the
    attention kernels leave no SMs free. Timing only: the result is not attention of the sequence.

    Each replaced shift_start passes its inputs through an optimization barrier with its own constant (a count of
    the calls): with plain pass-throughs every step of a non-causal ring calls the attention on identical operands
    and XLA's CSE keeps one call for all of them (4.7 ms measured against 8.1 ms for one kernel doing a member's
    work). The barrier costs nothing at run time, and XLA cannot prove two steps' blocks equal through it."""
    from pk_jax.context import ring_overlap

    calls = itertools.count()

    def start(xs, axes, **kw) -> tuple[tuple[jax.Array, ...], jax.Array]:
        # A distinct constant per call: no two barriers are the same instruction, so none is merged.
        return jax.lax.optimization_barrier((tuple(xs), jnp.int32(next(calls))))

    saved = ring_overlap.shift_start, ring_overlap.shift_done
    ring_overlap.shift_start = start
    ring_overlap.shift_done = lambda ys, token, **kw: tuple(ys)
    try:
        with _env("PK_JAX_RING_RESERVE_SMS", "0"):
            yield
    finally:
        ring_overlap.shift_start, ring_overlap.shift_done = saved


def _member_blocks(c: Case, g: int, rank: int) -> list[tuple[int, int, int]]:
    """The attention a ring member owes, as calls of our kernel: (first query row, rows, visible keys) of its local
    rows, against the global sequence's first `visible keys` keys, causal with the rows' global offset."""
    t = c.s // g
    if not c.causal:
        return [(0, t, c.s)]
    if c.layout == "contiguous":
        return [(0, t, (rank + 1) * t)]
    half = t // 2
    return [(0, half, (rank + 1) * half), (half, half, (2 * g - rank) * half)]


def _member_offset(c: Case, g: int, rank, start: int):
    """Global position of local row `start` of member `rank` (traced or not) in the case's layout."""
    t = c.s // g
    if c.layout == "contiguous":
        return rank * t + start
    return rank * (t // 2) if start == 0 else (2 * g - 1 - rank) * (t // 2)


def _kernel_floor(c: Case, g: int, mesh: Mesh, args):
    """Issue 26's floor for a ring member's compute: our attention kernel (pk_jax.attention) on the member's own
    query chunks (_member_blocks; split beforehand, so no slice is copied in the program) against the whole K/V
    (replicated beforehand; the causal mask, placed by the chunk's global offset, skips the keys the chunk does
    not see), one call per chunk, every member at once; fwd+bwd differentiates inside shard_map, per device (no
    cross-device sum of the replicated K/V's gradients). Values are those of the arrays as laid out (timing only).
    Returns (jitted program, its arguments)."""
    starts = [(start, rows) for start, rows, _ in _member_blocks(c, g, 0)]
    split = jax.jit(lambda q: tuple(q.reshape(c.b, g, c.s // g, c.n, c.d)[:, :, a:a + r].reshape(c.b, g * r, c.n, c.d)
                                    for a, r in starts), out_shardings=NamedSharding(mesh, P(None, AX)))
    rep = NamedSharding(mesh, P())
    floor_args = [split(args[0]), jax.device_put(args[1], rep), jax.device_put(args[2], rep)]

    def chunks(qs, k, v):
        rank = jax.lax.axis_index(AX)
        return tuple(pk_jax.attention(q, k, v, causal=c.causal, implementation="pk",
                                      q_offset=_member_offset(c, g, rank, a) if c.causal else 0)
                     for q, (a, _) in zip(qs, starts))

    q_spec = tuple(P(None, AX) for _ in starts)
    if c.backward:
        def body(qs, k, v):
            loss = lambda qs, k, v: sum(jnp.sum(o.astype(jnp.float32)) for o in chunks(qs, k, v))
            value, (dqs, dk, dv) = jax.value_and_grad(loss, (0, 1, 2))(qs, k, v)
            return value[None], dqs, dk[None], dv[None]
        out_specs = (P(AX), q_spec, P(AX), P(AX))
    else:
        body, out_specs = chunks, q_spec
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(q_spec, P(), P()), out_specs=out_specs,
                                    check_vma=False))
    return program, floor_args


def _compute_floor_contenders(c: Case, g: int, mesh: Mesh, args):
    """[(name, fn of the suite's args)]: the ring with communication off (always the "pk" transport, whose shifts
    _communication_off removes), and _kernel_floor; {name: error} for those that did not compile."""
    with _transport("pk"), _communication_off():
        off, _, err_off = _compile(_program(_ours(c), mesh, c.backward), args)
    program, floor_args = _kernel_floor(c, g, mesh, args)
    floor, _, err_floor = _compile(program, floor_args)
    out = []
    if off is not None:
        out.append(("compute_only", off))
    if floor is not None:
        out.append(("kernel_floor", lambda xs, f=floor: f(floor_args)))
    return out, {k: v for k, v in (("compute_only", err_off), ("kernel_floor", err_floor)) if v}


def run(small: bool, reps: int, dtype=jnp.bfloat16, only: str | None = None, names: list[str] | None = None,
        seqs: list[int] | None = None, transports: list[str] | None = None, compute_floor: bool = False) -> list[dict]:
    """Every case (or only op `only`, case names `names`, total lengths `seqs`): ours, the baseline and our
    attention alone on one member's share, in the same turns. `transports`: the ring's transports to time
    (the first is ours_ms); None: the environment's. compute_floor: ring rows also time the ring with
    communication off (_communication_off: extra.compute_only_ms) and our kernel on the member's blocks
    (_kernel_floor: extra.kernel_floor_ms); extra.compute_over_floor is issue 26's "within 5%" (<= 1.05)."""
    devices = jax.devices()
    g = len(devices)
    mesh = Mesh(np.array(devices), (AX,))
    rows = []
    sharding = NamedSharding(mesh, P(None, AX))
    selected = []
    for c in cases(g, small):
        if (only and c.op != only) or (names and c.name not in names) or (seqs and c.s not in seqs):
            continue
        if c.op == "ulysses_attention" and c.n % g:
            print(f"  skip {c.op} {c.name} N={c.n}: G={g} does not divide the heads")
            continue
        selected.append(c)
    ahead = CompileAhead()  # compiled on a thread pool before the first timing (pk_jax/bench/compile_ahead.py)
    for c in selected:
        specs = [jax.ShapeDtypeStruct((c.b, c.s, c.n, c.d), dtype, sharding=sharding)] * 3
        if not transports or c.op != "ring_attention":  # other transports: compiled inside their settings, below
            ahead.add((c, "ours"), _program(_ours(c), mesh, c.backward), specs)
        if jax.devices()[0].platform == "gpu":
            ahead.add((c, "base"), _program(_gathered_attention(c, g, "cudnn"), mesh, c.backward), specs)
        alone = _alone_program(c, g, dtype)
        if alone is not None:
            ahead.add((c, "alone"), *alone)
    ahead.wait()  # every compile done before the first timing
    for c in selected:
        keys = jax.random.split(jax.random.key(len(rows)), 3)
        make = jax.jit(lambda key: jax.random.normal(key, (c.b, c.s, c.n, c.d), jnp.float32).astype(dtype),
                       out_shardings=sharding)
        args = [make(key) for key in keys]
        ring_transports = (transports or [None]) if c.op == "ring_attention" else [None]
        compiled = []
        for i, t in enumerate(ring_transports):
            with _transport(t):
                fn, fn_peak, err = _compile(_program(_ours(c), mesh, c.backward), args,
                                            ahead.get((c, "ours")) if i == 0 and t is None else None)
            if fn is None:
                raise RuntimeError(f"pk_jax.bench context: {c.op} {c.name} (transport {t}) failed to compile: {err}")
            compiled.append((fn, fn_peak))
        (ours, peak), others = compiled[0], [fn for fn, _ in compiled[1:]]
        base, base_peak, base_impl, base_err = _baseline(c, g, mesh, args, ahead.get((c, "base")))
        alone = _attention_alone(c, g, dtype, ahead.get((c, "alone")))
        got = ours(args)
        transport_check = {}
        for t, fn in zip(ring_transports[1:], others):
            d = max(results.rel_err(a, b) for a, b in zip(jax.tree.leaves(fn(args)), jax.tree.leaves(got)))
            transport_check[t] = f"rel={d:.1e}"
        check = "no baseline"
        if base is not None:
            want = base(args)
            err_v = max(results.rel_err(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            check = f"ok rel={err_v:.1e}" if err_v < 3e-2 else f"MISMATCH rel={err_v:.1e}"
        floor_fns, floor_errs = ([], {})
        if compute_floor and c.op == "ring_attention":
            floor_fns, floor_errs = _compute_floor_contenders(c, g, mesh, args)
        extras = [fn for _, fn in floor_fns]
        fns = [ours] + ([base] if base else []) + ([lambda xs, a=alone: a[0](a[1])] if alone else []) + others + extras
        times = timing.time_interleaved(fns, args, reps=reps, ops_per_call=1, min_sample_ms=timing.DEVICE_SAMPLE_MS)
        floor_ms = dict(zip([name for name, _ in floor_fns], times[len(times) - len(extras):]))
        times = times[:len(times) - len(extras)]
        other_ms = times[len(fns) - len(extras) - len(others):]
        times = times[:len(fns) - len(extras) - len(others)]
        ours_ms = times[0]
        base_ms = times[1] if base else None
        alone_ms = times[-1] if alone else None
        rows.append({
            "op": c.op, "case": c.name, "shape": [c.b, c.s, c.n, c.d], "dtype": jnp.dtype(dtype).name, "group": g,
            "ours_ms": round(ours_ms, 5), "baseline": f"all_gather K/V + jax.nn.dot_product_attention ({base_impl})",
            "baseline_ms": None if base_ms is None else round(base_ms, 5),
            "ratio": None if base_ms is None else round(base_ms / ours_ms, 4),
            "extra": {"peak_bytes": peak, "baseline_peak_bytes": base_peak, "baseline_error": base_err,
                      "attention_alone_ms": None if alone_ms is None else round(alone_ms, 5),
                      "reps": reps, "check": check,
                      **({"transport_ms": {t: round(ms, 5) for t, ms in zip(ring_transports, [ours_ms, *other_ms])},
                          "transport_check": transport_check} if others else {})},
        })
        if compute_floor and c.op == "ring_attention":
            e = rows[-1]["extra"]
            e.update({f"{k}_ms": round(v, 5) for k, v in floor_ms.items()})
            if floor_errs:
                e["compute_floor_errors"] = floor_errs
            if len(floor_ms) == 2:
                e["compute_over_floor"] = round(floor_ms["compute_only"] / floor_ms["kernel_floor"], 4)
        results.add_partial(rows[-1])  # before its line: a run killed once the line is out keeps the row
        print(f"  {c.op:<18}{c.name:<26}{str(rows[-1]['shape']):<24} ours {ours_ms:9.3f} ms  "
              f"base {'-' if base_ms is None else f'{base_ms:9.3f}'} ms  alone "
              f"{'-' if alone_ms is None else f'{alone_ms:9.3f}'} ms  peak {peak / 2**20 if peak else 0:8.1f} MiB  "
              f"{check}{'' if base_err is None else '  baseline: ' + base_err}"
              + "".join(f"  [{t} {ms:.3f} ms]" for t, ms in zip(ring_transports, [ours_ms, *other_ms]) if others)
              + "".join(f"  {k} {v:.3f} ms" for k, v in floor_ms.items())
              + (f"  compute/floor {rows[-1]['extra']['compute_over_floor']:.3f}"
                 if "compute_over_floor" in rows[-1]["extra"] else "")
              + "".join(f"  [{k}: {v}]" for k, v in floor_errs.items()),
              flush=True)
        del args
    return rows


def print_table(rows) -> None:
    head = f"{'op':<18}{'case':<26}{'shape':<24}{'G':>3}{'ours ms':>11}{'base ms':>11}{'ratio':>7}{'alone ms':>10}{'peak MiB':>10}  check"
    print(head)
    print("-" * len(head))
    for r in rows:
        e = r["extra"]
        fmt = lambda x, spec: "-" if x is None else format(x, spec)
        print(f"{r['op']:<18}{r['case']:<26}{str(r['shape']):<24}{r['group']:>3}{r['ours_ms']:>11.3f}"
              f"{fmt(r['baseline_ms'], '11.3f'):>11}{fmt(r['ratio'], '7.2f'):>7}{fmt(e['attention_alone_ms'], '10.3f'):>10}"
              f"{fmt(None if e['peak_bytes'] is None else e['peak_bytes'] / 2**20, '10.1f'):>10}  {e['check']}")
