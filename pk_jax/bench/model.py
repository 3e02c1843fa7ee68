"""`python -m pk_jax.bench model`: a Llama-style tensor- and sequence-parallel transformer layer
(pk_jax/bench/llama_layer.py) and its MLP block alone, forward and forward+backward (gradients of every
parameter and the input), pk_jax's fused ops vs the same layer in plain XLA (jnp.dot + jax.lax
collectives), timed in turns in the same run.

Floor: the GEMMs of the step alone (llama_layer.gemm_flops: every projection, the MLP, attention's
causal half of 4 T^2 H hd) at the peak bf16 rate measured here (a 8192^3 jnp.dot on one GPU), per
GPU; `bound_speedup` = XLA ms / floor ms (the most any implementation could gain over XLA),
`ours_bound_speedup` = ours ms / floor ms. Communication is not in the floor.

Memory, Llama-3-70B widths, T = 16384, G = 1 (the largest default case): parameters 0.62 G x 2 B =
1.24 GB (gelu; swiglu 1.7 GB) and as much for their gradients; saved activations ~4 GB (x, two norms,
qkv 0.34 GB, attention output, the MLP's (T, f) input and gelu output 0.94 GB each); attention, one KV
head (8 query heads) at a time under jax.checkpoint: float32 logits 8.6 GB, with the softmax and its
gradient at most ~4x that live: well under 50 GB of the H200's 141 GB. Without the per-KV-head remat the
64 heads' float32 logits alone take 69 GB, and their softmax and gradients would not fit.

Group size: the mesh is all devices (`--group` takes the first G). Under jax.distributed (one process
per GPU, `--distributed`) the mesh is global and only process 0 prints and writes files.

Ranks sharing one GPU (`python -m pk_jax.launch -n 2 --share-gpu -m pk_jax.bench model --distributed`, the
multi-rank test mode): XLA's collectives cannot run there (NCCL refuses the duplicate GPU) and timings
mean nothing, so each case is checked instead against a float32 reference of the whole layer that every
process computes unsharded on its own device (output and every gradient, on its addressable shards);
defaults shrink to the 8B width at T = 4096. The pk_jax layer exchanges only through pk_jax ops there
(its norm scales through pk_jax.pcast, whose gradient sum is pk_jax.all_reduce).
"""

from __future__ import annotations

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pk_jax import distributed
from pk_jax.bench import llama_layer as L
from pk_jax.bench import results, timing

AX = "tp"
DEFAULT_TOKENS = (8192, 16384)
CPU_SMALL = L.LayerShape("cpu-small", 256, 1024, 8, 8, head_dim=32)  # plumbing runs without a GPU
CHECK_TOL = 3e-2  # relative norm difference ours vs XLA, both bf16 (measured ~1e-2 at most on CPU)
REF_TOL = 5e-2    # ours (bf16) vs the float32 reference, per shard (ranks sharing a GPU)
SHARED_BASELINE = "none: ranks share one GPU (XLA's collectives cannot run there; timings not meaningful)"


def _main_process() -> bool:
    return jax.process_index() == 0


def say(*args, **kw) -> None:
    if _main_process():
        print(*args, **kw, flush=True)


def measured_peak_tflops(reps: int) -> float:
    """bf16 TFLOP/s of an 8192^3 jnp.dot on the first device (cuBLAS), median of `reps` calls of 8."""
    dev = jax.local_devices()[0]
    if dev.platform != "gpu":
        return float("nan")
    n, k = 8192, 8
    make = jax.jit(lambda key: jax.random.normal(key, (n, n), jnp.float32).astype(jnp.bfloat16),
                   out_shardings=jax.sharding.SingleDeviceSharding(dev))
    a = [make(jax.random.key(i)) for i in range(k)]
    b = [make(jax.random.key(100 + i)) for i in range(k)]
    dots = jax.jit(lambda xs, ys: [jnp.dot(x, y) for x, y in zip(xs, ys)])
    ms = timing.time_interleaved([lambda ins: dots(*ins)], (a, b), reps=reps, ops_per_call=k)[0]
    return 2.0 * n ** 3 / ms / 1e9


def _rotating(fn, sets):
    """fn applied to the next input set each call (inputs rotate between calls, not within one)."""
    state = {"i": 0}

    def call(_):
        i = state["i"]
        state["i"] = (i + 1) % len(sets)
        return fn(*sets[i])
    return call


@jax.jit
def _max_err(ours, ref) -> jax.Array:
    """The largest relative norm difference over the leaves (output and every gradient), on the devices
    (the 70B gradients are 1.2 GB: no copies to the host)."""
    def rel(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)
    return jnp.max(jnp.stack([rel(a, b) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref))]))


def _programs(shape: L.LayerShape, ops: L.Ops, mesh, mlp_only: bool, backward: bool):
    f = L.sharded(shape, ops, mesh, AX, mlp_only, check_vma=True)
    if not backward:
        return jax.jit(lambda p, x, ct: f(p, x))

    def step(p, x, ct):
        y, vjp = jax.vjp(f, p, x)
        return y, vjp(ct)
    return jax.jit(step)


def _reference_program(shape: L.LayerShape, group: int, mlp_only: bool, backward: bool):
    """The layer unsharded in float32 on one device (every operand cast up first, so the gradients are
    float32 too): f(params, x, ct) -> y or (y, (d params, dx))."""
    f = lambda p, x: L.reference_layer(p, x, shape, group, mlp_only)
    up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
    if not backward:
        return jax.jit(lambda p, x, ct: f(up(p), up(x)))

    def step(p, x, ct):
        y, vjp = jax.vjp(f, up(p), up(x))
        return y, vjp(up(ct))
    return jax.jit(step)


def _shard_error(ours, ref) -> float:
    """The largest relative norm difference of any addressable shard of any leaf of `ours` (global
    arrays) against the same slice of `ref` (this process's unsharded float32 arrays)."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        want_all = np.asarray(b, np.float32)
        for s in a.addressable_shards:
            got, want = np.asarray(s.data, np.float32), want_all[s.index]
            worst = max(worst, float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)))
    return worst


def run_case(shape: L.LayerShape, tokens: int, mesh, params, mlp_only: bool, backward: bool, reps: int,
             peak_tflops: float, inputs: list, reference_sets: list | None = None) -> dict:
    """One row. `reference_sets` (ranks sharing a GPU): per input set, (params, x, ct) unsharded on
    this process's device; ours is then checked against the float32 reference and XLA is not run."""
    group = mesh.shape[AX]
    ours = _programs(shape, L.PK_OPS, mesh, mlp_only, backward)
    sets = [(params, x, ct) for x, ct in inputs]
    if reference_sets is None:
        xla = _programs(shape, L.XLA_OPS, mesh, mlp_only, backward)
        err = float(_max_err(ours(*sets[0]), xla(*sets[0])))
        ours_ms, xla_ms = timing.time_interleaved([_rotating(ours, sets), _rotating(xla, sets)], None, reps=reps,
                                                  ops_per_call=1)
        tol, baseline = CHECK_TOL, "xla"
    else:
        ref = _reference_program(shape, group, mlp_only, backward)
        err = _shard_error(ours(*sets[0]), ref(*reference_sets[0]))
        ours_ms = timing.time_interleaved([_rotating(ours, sets)], None, reps=reps, ops_per_call=1)[0]
        xla_ms, tol, baseline = None, REF_TOL, SHARED_BASELINE
    flops = L.gemm_flops(shape, tokens, mlp_only, backward) / group
    bound_ms = flops / (peak_tflops * 1e9) if peak_tflops == peak_tflops else None  # no GPU: no peak
    r4 = lambda v: None if bound_ms is None or xla_ms is None else round(v(), 4)
    row = {
        "op": "mlp_block" if mlp_only else "transformer_layer", "case": "fwd_bwd" if backward else "fwd",
        "shape": [tokens], "dtype": "bfloat16", "group": group, "ours_ms": round(ours_ms, 4), "baseline": baseline,
        "baseline_ms": None if xla_ms is None else round(xla_ms, 4),
        "ratio": None if xla_ms is None else round(xla_ms / ours_ms, 4),
        "extra": {"width": shape.name, "d_model": shape.d_model, "d_ff": shape.d_ff, "n_heads": shape.n_heads,
                  "n_kv_heads": shape.n_kv_heads, "head_dim": shape.head_dim, "mlp": shape.mlp,
                  "gemm_tflop_per_gpu": round(flops / 1e12, 3), "peak_tflops": r4(lambda: peak_tflops),
                  "bound_ms": None if bound_ms is None else round(bound_ms, 4),
                  "bound_speedup": r4(lambda: xla_ms / bound_ms), "ours_bound_speedup": r4(lambda: ours_ms / bound_ms),
                  "mesh": {k: int(v) for k, v in mesh.shape.items()}, "processes": jax.process_count(),
                  "attention": "jax.nn.dot_product_attention (XLA), one KV head at a time, rematerialized",
                  ("max_rel_diff_vs_xla" if xla_ms is not None else "max_rel_err_vs_f32"): float(f"{err:.2e}"),
                  "check": "ok" if err < tol else "MISMATCH", "reps": reps},
    }
    say(f"  {row['op']:<17} {row['case']:<7} {shape.name:<10} T={tokens:<6} G={group}  ours {ours_ms:9.3f} ms  "
        f"XLA {_num(xla_ms, '9.3f')} ms  x{_num(row['ratio'], '5.3f')}  floor {_num(bound_ms, '.3f')} ms  "
        f"{'diff' if xla_ms is not None else 'err vs f32'} {err:.1e} {row['extra']['check']}")
    return row


def run(shapes: list[L.LayerShape], tokens: list[int], group: int | None, reps: int, out_dir: str,
        blocks: list[str]) -> list[dict]:
    devices = jax.devices()
    group = group or len(devices)
    if group > len(devices):
        raise ValueError(f"--group {group}: only {len(devices)} devices")
    if jax.process_count() > 1 and group != len(devices):
        raise ValueError(f"--group {group}: under jax.distributed the mesh is every device ({len(devices)})")
    mesh = Mesh(np.array(devices[:group]), (AX,))
    shared = distributed.shares_gpu()
    peak = float("nan") if shared else measured_peak_tflops(reps)
    say(f"peak bf16 GEMM (8192^3 jnp.dot, one GPU): {peak:.0f} TFLOP/s")
    rows = []
    for shape in shapes:
        shape.local(group)  # fails early, naming the width, when the group does not divide it
        for t in tokens:
            if t % group:
                raise ValueError(f"--tokens {t} is not divisible by the group size {group}")
            x_sh = NamedSharding(mesh, P(AX))
            make = jax.jit(lambda key, t=t, d=shape.d_model: jax.random.normal(key, (t, d), jnp.float32)
                           .astype(jnp.bfloat16), out_shardings=x_sh)
            inputs = [(make(jax.random.key(2 * i)), make(jax.random.key(2 * i + 1))) for i in range(2)]
            local_inputs = []
            if shared:  # random values do not depend on the sharding (threefry is partitionable), so an
                # unsharded copy made on this process's device equals the global arrays
                local = jax.jit(lambda key, t=t, d=shape.d_model: jax.random.normal(key, (t, d), jnp.float32)
                                .astype(jnp.bfloat16))
                local_inputs = [(local(jax.random.key(0)), local(jax.random.key(1)))]  # = inputs[0]
            for block in blocks:
                mlp_only = block == "mlp_block"
                specs = L.param_specs(shape, AX, mlp_only)
                params = L.init_params(jax.random.key(7), shape, jnp.bfloat16, mlp_only,
                                       {k: NamedSharding(mesh, s) for k, s in specs.items()})
                ref_sets = None
                if shared:
                    local_params = L.init_params(jax.random.key(7), shape, jnp.bfloat16, mlp_only)
                    ref_sets = [(local_params, x, ct) for x, ct in local_inputs]
                for backward in (False, True):
                    rows.append(run_case(shape, t, mesh, params, mlp_only, backward, reps, peak, inputs, ref_sets))
                    if _main_process():
                        with open(os.path.join(out_dir, "model.partial.json"), "w") as f:
                            json.dump(rows, f, indent=1)  # survives a cut-off run
                del params, ref_sets
            del inputs, local_inputs
    return rows


def print_table(rows: list[dict]) -> None:
    head = (f"{'op':<18}{'case':<9}{'width':<12}{'T':>7}{'G':>3}{'ours ms':>11}{'XLA ms':>11}{'ratio':>8}"
            f"{'floor ms':>10}{'XLA/floor':>10}  check")
    say(head)
    say("-" * len(head))
    for r in rows:
        e = r["extra"]
        say(f"{r['op']:<18}{r['case']:<9}{e['width']:<12}{r['shape'][0]:>7}{r['group']:>3}{r['ours_ms']:>11.3f}"
            f"{_num(r['baseline_ms'], '.3f'):>11}{_num(r['ratio'], '.3f'):>8}{_num(e['bound_ms'], '.3f'):>10}"
            f"{_num(e['bound_speedup'], '.3f'):>10}  {e['check']}")


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def plot(rows: list[dict], path: str) -> None:
    """One panel per (op, case): ms by T, ours vs XLA vs the GEMM floor, a line per width."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib missing: no plot")
        return
    panels = sorted({(r["op"], r["case"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, (op, case) in zip(axes[0], panels):
        for width in sorted({r["extra"]["width"] for r in rows}):
            pts = sorted((r["shape"][0], r["ours_ms"], r["baseline_ms"], r["extra"]["bound_ms"]) for r in rows
                         if r["op"] == op and r["case"] == case and r["extra"]["width"] == width)
            if not pts:
                continue
            t = [p[0] for p in pts]
            line, = ax.plot(t, [p[1] for p in pts], marker="o", label=f"{width} pk_jax")
            if pts[0][2] is not None:
                ax.plot(t, [p[2] for p in pts], marker="s", ls=":", color=line.get_color(), label=f"{width} XLA")
            if pts[0][3] is not None:
                ax.plot(t, [p[3] for p in pts], ls="--", color="gray", alpha=0.6, label=f"{width} GEMM floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("ms per step")
        ax.set_title(f"{op} {case} (G={rows[0]['group']})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    say(f"wrote {path}")


def main(args) -> int:
    """Entry from `python -m pk_jax.bench model` (jax already initialized, distributed if asked)."""
    on_gpu = jax.devices()[0].platform == "gpu"
    shared = distributed.shares_gpu()
    tokens = args.tokens or (([4096] if shared else list(DEFAULT_TOKENS)) if on_gpu else [256])
    default_widths = ([L.WIDTHS["llama3-8b"]] if shared else list(L.WIDTHS.values())) if on_gpu else [CPU_SMALL]
    widths = [L.WIDTHS[w] for w in args.widths] if args.widths else default_widths
    shapes = [L.LayerShape(**{**w.__dict__, "mlp": args.mlp}) for w in widths]
    reps = args.reps or 20
    out = args.out
    say(f"pk_jax.bench model: {results.device_description()}, {jax.process_count()} process(es), {reps} reps, "
        f"MLP {args.mlp}")
    if not on_gpu:
        say("  (no GPU: a small width on CPU devices; only the plumbing means anything)")
    if shared:
        say("  (ranks share one GPU: checked against a float32 reference, XLA not run, timings not meaningful)")
    with warnings.catch_warnings():
        # At group 1 every fused op is its composition (nothing to communicate); say so once, not per op.
        warnings.filterwarnings("ignore", message=r".*group size must be 2\.\.8")
        rows = run(shapes, tokens, args.group, reps, os.path.dirname(os.path.abspath(out)),
                   args.blocks or ["transformer_layer", "mlp_block"])
    if _main_process():
        results.write(out, "model", rows)
        say()
        print_table(rows)
        plot(rows, os.path.splitext(out)[0] + ".png")
        say(f"\nwrote {out}")
    return 1 if any(r["extra"]["check"] != "ok" for r in rows) else 0
