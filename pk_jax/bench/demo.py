"""`python -m pk_jax.bench demo`: what pk_jax gives on this machine, in under two minutes.

One row per op family at one representative size, pk_jax against XLA (cuBLAS / NCCL / cuDNN) in the same
run, timed in turns (pk_jax/bench/timing.py), then a table and a bar chart. On one GPU it shows what one GPU
can (our GEMM against cuBLAS, our causal attention forward against cuDNN) and says which rows need several
GPUs. Without GPUs it runs tiny sizes on 8
virtual CPU devices: plumbing only. The full suites stay behind `python -m pk_jax.bench <suite>`.
The fused ops run their cached autotuned schedule or the default one (tuning takes minutes; the tp_gemm
suite does it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import pk_jax
from pk_jax.bench import results, timing
from pk_jax.bench.progress import Progress

AX = "x"


@dataclasses.dataclass
class Item:
    family: str
    op: str
    shape: tuple[int, ...]          # the results-format shape
    min_devices: int
    ins: list[tuple[tuple[int, ...], P]]  # global input shapes and their shardings
    out_spec: P
    ours: Callable
    xla: Callable
    baseline: str


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def items(g: int, small: bool) -> list[Item]:
    """The demo's rows for a group of g devices (sizes: representative on GPUs, tiny on CPU)."""
    n, c, r, s = (256, 256, 128, 512) if small else (8192, 16384, 4096, 32768)
    f = c // 4
    qkv = (1, 256, 4, 64) if small else (4, 8192, 16, 128)  # (B, S, N, D), causal
    attn_impl = None if small else "cudnn"
    return [
        Item("GEMM (1 GPU)", "matmul", (n, n, n), 1, [((n, n), P()), ((n, n), P())], P(),
             pk_jax.matmul, _dot, "jnp.dot (cuBLAS)"),
        Item("attention (1 GPU)", "attention", qkv, 1, [(qkv, P())] * 3, P(),
             lambda q, k, v: pk_jax.attention(q, k, v, causal=True, implementation="pk"),
             lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attn_impl),
             "jax.nn.dot_product_attention (cuDNN)"),
        Item("collectives", "all_gather", (c, c), 2, [((c, c), P(None, AX))], P(),
             lambda x: pk_jax.all_gather(x, AX, axis=1, tiled=True),
             lambda x: jax.lax.all_gather(x, AX, axis=1, tiled=True), "jax.lax.all_gather"),
        Item("collectives", "all_reduce", (r, r), 2, [((g * r, r), P(AX))], P(),
             lambda x: pk_jax.all_reduce(x, AX), lambda x: jax.lax.psum(x, AX), "jax.lax.psum"),
        Item("collectives", "all_to_all", (1, s, 128, 128), 2, [((1, s, 128, 128), P(None, AX))], P(None, None, AX),
             lambda x: pk_jax.all_to_all(x, AX, 2, 1, tiled=True),
             lambda x: jax.lax.all_to_all(x, AX, 2, 1, tiled=True), "jax.lax.all_to_all"),
        Item("fused GEMMs", "all_gather_matmul", (c,), 2, [((c, c), P(AX)), ((c, f), P())], P(AX),
             lambda x, w: pk_jax.all_gather_matmul(x, w, AX),
             lambda x, w: _dot(jax.lax.all_gather(x, AX, tiled=True), w), "jnp.dot + jax.lax.all_gather"),
        Item("fused GEMMs", "matmul_reduce_scatter", (c,), 2, [((c, g * f), P(None, AX)), ((g * f, c), P(AX))], P(AX),
             lambda x, w: pk_jax.matmul_reduce_scatter(x, w, AX),
             lambda x, w: jax.lax.psum_scatter(_dot(x, w), AX, tiled=True), "jnp.dot + jax.lax.psum_scatter"),
    ]


def _runner(mesh: Mesh, item: Item, fn: Callable, count: int) -> Callable:
    specs = tuple([spec] * count for _, spec in item.ins)
    body = jax.shard_map(lambda *args: [fn(*a) for a in zip(*args)], mesh=mesh, in_specs=specs,
                         out_specs=[item.out_spec] * count, check_vma=False)
    jitted = jax.jit(body)
    return lambda args: jitted(*args)


def _inputs(mesh: Mesh, item: Item, count: int, dtype) -> tuple[list, ...]:
    out = []
    for j, (shape, spec) in enumerate(item.ins):
        make = jax.jit(lambda key, shape=shape: jax.random.normal(key, shape, jnp.float32).astype(dtype),
                       out_shardings=NamedSharding(mesh, spec))
        out.append([make(jax.random.key(100 * j + i)) for i in range(count)])
    return tuple(out)


def run(reps: int = 10, dtype=jnp.bfloat16) -> list[dict]:
    """Times every item this machine can run; rows in the results format (skipped items say why)."""
    before = os.environ.get("PK_JAX_AUTOTUNE")
    os.environ.setdefault("PK_JAX_AUTOTUNE", "0")  # cached or default schedules: tuning takes minutes
    try:
        return _run(reps, dtype)
    finally:
        if before is None:
            os.environ.pop("PK_JAX_AUTOTUNE", None)


def _run(reps: int, dtype) -> list[dict]:
    devices = jax.devices()
    on_gpu = devices[0].platform == "gpu"
    g = len(devices)
    todo = items(g, small=not on_gpu)
    rows, bar = [], Progress(len(todo), "demo")
    for item in todo:
        if g < item.min_devices:
            print(f"  {item.op:<22} needs {item.min_devices} GPUs (this machine has {g}): skipped")
            rows.append({"op": item.op, "family": item.family, "skipped": f"needs {item.min_devices} GPUs"})
            bar.step(item.op)
            continue
        mesh = Mesh(np.array(devices[:1] if item.min_devices == 1 else devices), (AX,))
        count = 4 if on_gpu else 1
        args = _inputs(mesh, item, count, dtype)
        ours, xla = _runner(mesh, item, item.ours, count), _runner(mesh, item, item.xla, count)
        err = results.rel_err(ours(args)[0], xla(args)[0])
        ours_ms, xla_ms = timing.time_interleaved([ours, xla], args, reps=reps, ops_per_call=count)
        rows.append({"op": item.op, "family": item.family, "case": "demo", "shape": list(item.shape),
                     "dtype": jnp.dtype(dtype).name, "group": 1 if item.min_devices == 1 else g,
                     "ours_ms": round(ours_ms, 5), "baseline": item.baseline, "baseline_ms": round(xla_ms, 5),
                     "ratio": round(xla_ms / ours_ms, 4),
                     "extra": {"rel_err": float(f"{err:.2e}"), "check": "ok" if err < 1e-2 else "MISMATCH"}})
        bar.step(item.op)
        del args
    return rows


def print_summary(rows: list[dict]) -> None:
    head = f"{'family':<19}{'op':<23}{'shape':<20}{'G':>3}{'pk_jax ms':>11}{'XLA ms':>10}{'speedup':>9}  check"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['family']:<19}{r['op']:<23}{r['skipped']}")
            continue
        print(f"{r['family']:<19}{r['op']:<23}{str(r['shape']):<20}{r['group']:>3}{r['ours_ms']:>11.4f}"
              f"{r['baseline_ms']:>10.4f}{r['ratio']:>8.2f}x  {r['extra']['check']}")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    done = [r for r in rows if "skipped" not in r]
    if not done:
        return
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(done) + 1.2))
    labels = [f"{r['op']} {'x'.join(map(str, r['shape']))}" for r in done]
    ax.barh(labels, [r["ratio"] for r in done], color=["tab:green" if r["ratio"] >= 1 else "tab:red" for r in done])
    ax.axvline(1.0, color="gray", ls="--")
    ax.set_xlabel("speedup over XLA (same run)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
