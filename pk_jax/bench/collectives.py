"""`python -m pk_jax.bench collectives`: pk_jax vs jax.lax (NCCL on GPUs) side by side."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.bench import results, timing

AX = "x"


@dataclasses.dataclass
class Case:
    op: str
    case: str
    shape: list[int]             # the results-format x-axis shape
    in_global: tuple[int, ...]   # global input, sharded by in_spec
    in_spec: P
    out_spec: P
    ours: Callable
    lax: Callable
    recv_bytes: Callable[[int], float]  # bytes each GPU must receive, from local input bytes
    exact: bool


def cases(g: int, quick: bool, variants: bool = False) -> list[Case]:
    # Bandwidth sizes only (small messages: --latency). Few cases, so the suite stays within ~90 s.
    ag_n = [512, 1024] if quick else [8192, 16384]
    ar_n = [256, 1024] if quick else [1024, 4096, 16384]
    a2a_s = [256, 1024] if quick else [16384, 65536]
    f = (g - 1) / g
    out: list[Case] = []
    for n in ag_n:
        out.append(Case("all_gather", "lastdim", [n, n], (n, n), P(None, AX), P(),
                        lambda x: pk_jax.all_gather(x, AX, axis=1, tiled=True),
                        lambda x: jax.lax.all_gather(x, AX, axis=1, tiled=True),
                        lambda b: b * (g - 1), True))
        if variants:
            out.append(Case("all_gather", "lastdim_pull", [n, n], (n, n), P(None, AX), P(),
                            lambda x: pk_jax.all_gather(x, AX, axis=1, tiled=True, transport="pull"),
                            lambda x: jax.lax.all_gather(x, AX, axis=1, tiled=True),
                            lambda b: b * (g - 1), True))
        out.append(Case("all_gather", "firstdim", [n, n], (n, n), P(AX), P(),
                        lambda x: pk_jax.all_gather(x, AX, axis=0, tiled=True),
                        lambda x: jax.lax.all_gather(x, AX, axis=0, tiled=True),
                        lambda b: b * (g - 1), True))
    for n in ag_n:
        out.append(Case("reduce_scatter", "lastdim", [n, n], (g * n, n), P(AX), P(None, AX),
                        lambda x: pk_jax.reduce_scatter(x, AX, scatter_dimension=1, tiled=True),
                        lambda x: jax.lax.psum_scatter(x, AX, scatter_dimension=1, tiled=True),
                        lambda b: b * f, False))
        out.append(Case("reduce_scatter", "firstdim", [n, n], (g * n, n), P(AX), P(AX),
                        lambda x: pk_jax.reduce_scatter(x, AX, scatter_dimension=0, tiled=True),
                        lambda x: jax.lax.psum_scatter(x, AX, scatter_dimension=0, tiled=True),
                        lambda b: b * f, False))
    for n in ar_n:
        for algo in ("auto", "one_shot", "two_shot"):
            out.append(Case("all_reduce", algo, [n, n], (g * n, n), P(AX), P(),
                            lambda x, a=algo: pk_jax.all_reduce(x, AX, algorithm=a),
                            lambda x: jax.lax.psum(x, AX),
                            lambda b: 2 * b * f, False))
    for s in a2a_s:
        out.append(Case("all_to_all", "seq_heads", [1, s, 128, 128], (1, s, 128, 128), P(None, AX),
                        P(None, None, AX),
                        lambda x: pk_jax.all_to_all(x, AX, 2, 1, tiled=True),
                        lambda x: jax.lax.all_to_all(x, AX, 2, 1, tiled=True),
                        lambda b: b * f, True))
        if variants:
            out.append(Case("all_to_all", "seq_heads_pull", [1, s, 128, 128], (1, s, 128, 128), P(None, AX),
                            P(None, None, AX),
                            lambda x: pk_jax.all_to_all(x, AX, 2, 1, tiled=True, transport="pull"),
                            lambda x: jax.lax.all_to_all(x, AX, 2, 1, tiled=True),
                            lambda b: b * f, True))
    return out


def _random_inputs(mesh: Mesh, c: Case, dtype, k: int, seed: int) -> list[jax.Array]:
    sharding = NamedSharding(mesh, c.in_spec)
    make = jax.jit(lambda key: jax.random.normal(key, c.in_global, jnp.float32).astype(dtype),
                   out_shardings=sharding)
    return [make(jax.random.key(seed + i)) for i in range(k)]


def _runner(mesh: Mesh, c: Case, fn: Callable, k: int) -> Callable:
    body = jax.shard_map(lambda *xs: [fn(x) for x in xs], mesh=mesh, in_specs=(c.in_spec,) * k,
                         out_specs=[c.out_spec] * k, check_vma=False)
    jitted = jax.jit(body)
    return lambda xs: jitted(*xs)


def _check(ours: jax.Array, ref: jax.Array, exact: bool) -> str:
    a = np.asarray(ours.astype(jnp.float32))
    b = np.asarray(ref.astype(jnp.float32))
    if exact:
        return "ok" if np.array_equal(a, b) else "MISMATCH"
    err = results.rel_err(a, b)
    return f"ok rel={err:.1e}" if err < 1e-2 and np.isfinite(a).all() else f"MISMATCH rel={err:.1e}"


def run(quick: bool, reps: int, dtype=jnp.bfloat16, only: str | None = None, variants: bool = False) -> list[dict]:
    devices = jax.devices()
    g = len(devices)
    # Up to 32 ops per timed call: dispatch stays a small share at these sizes (>= 2 MiB per op) and
    # compiling 64 programs of up to 32 ops keeps the suite within ~90 s. CPU: plumbing only.
    max_calls = 32 if devices[0].platform == "gpu" else 2
    mesh = Mesh(np.array(devices), (AX,))
    itemsize = jnp.dtype(dtype).itemsize
    rows = []
    start = time.perf_counter()
    for c in cases(g, quick, variants):
        if only and c.op != only:
            continue
        local_in = int(np.prod(c.in_global)) * itemsize // g
        k = timing.calls_per_measure(3 * local_in * (g if c.op == "all_gather" else 1), lo=min(4, max_calls),
                                     hi=max_calls)
        xs = _random_inputs(mesh, c, dtype, k, seed=len(rows) * 1000)
        ours_fn, lax_fn = _runner(mesh, c, c.ours, k), _runner(mesh, c, c.lax, k)
        check = _check(ours_fn(xs)[0], lax_fn(xs)[0], c.exact)
        ours_ms, lax_ms = timing.time_interleaved([ours_fn, lax_fn], xs, warmup=2, reps=reps)
        gbps = c.recv_bytes(local_in) / (ours_ms * 1e-3) / 1e9
        rows.append({
            "op": c.op, "case": c.case, "shape": c.shape, "dtype": jnp.dtype(dtype).name, "group": g,
            "ours_ms": round(ours_ms, 5), "baseline": _baseline_name(c.op), "baseline_ms": round(lax_ms, 5),
            "ratio": round(lax_ms / ours_ms, 4),
            "extra": {"gbps": round(gbps, 1), "baseline_gbps": round(c.recv_bytes(local_in) / (lax_ms * 1e-3) / 1e9, 1),
                      "calls_per_measure": k, "reps": reps, "check": check},
        })
        print(f"  {c.op:<15}{c.case:<10}{str(c.shape):<22} ours {ours_ms:8.4f} ms  lax {lax_ms:8.4f} ms  "
              f"x{lax_ms / ours_ms:5.2f}  {gbps:6.0f} GB/s  {check}", flush=True)
        del xs
    print(f"  collectives suite: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def _baseline_name(op: str) -> str:
    return {"all_gather": "jax.lax.all_gather", "reduce_scatter": "jax.lax.psum_scatter",
            "all_reduce": "jax.lax.psum", "all_to_all": "jax.lax.all_to_all"}[op]
