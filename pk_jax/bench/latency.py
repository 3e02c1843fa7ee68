"""`python -m pk_jax.bench collectives --latency`: all_reduce latency, ours vs jax.lax.psum (NCCL).

Per-op device time is measured as in a decode step: one jitted program runs a chain of CHAIN dependent
all_reduces (each one's output is the next one's input), the host syncs once, and the call's time over
CHAIN is the time per op; median of `reps` calls, ours and the baseline timed in turns. The one-call
time is a jitted program with a single all_reduce, dispatch and sync included. Sizes: the issue's sweep
(4 KiB .. 8 MiB of bf16) and decode shapes (tokens x 8192 bf16).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.bench import collectives, timing

AX = "x"
CHAIN = 64
SWEEP_BYTES = [4 << 10, 16 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]
DECODE_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
HIDDEN = 8192
# Forced algorithms timed with --variants (the crossovers of pk_jax._small_path come from these).
VARIANTS = ("small_one_shot", "small_two_shot", "small_chunked", "small_pipelined", "small_ll128", "one_shot",
            "two_shot")


def _program(mesh: Mesh, op: Callable, chain: int) -> Callable:
    """Jitted shard_map applying `op` `chain` times in a dependent sequence; input replicated shape."""

    def body(v):
        for _ in range(chain):
            v = op(v)
        return v

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX), out_specs=P(AX), check_vma=False))
    return lambda xs: f(xs[0])


def _allowed(algorithm: str, local_shape: tuple[int, ...], g: int) -> bool:
    """Whether the forced algorithm can serve this size (same rules as pk_jax.all_reduce)."""
    from pk_jax import _small_path

    nbytes = int(np.prod(local_shape)) * 2
    if algorithm.startswith("small"):
        if nbytes > _small_path.max_bytes(algorithm):
            return False
        return algorithm != "small_two_shot" or _small_path.words(nbytes) % g == 0
    return algorithm != "two_shot" or int(np.prod(local_shape)) % g == 0


def measure(mesh: Mesh, local_shape: tuple[int, ...], reps: int, variants: bool) -> dict:
    """Microseconds per op (chain) and per call (one op) of ours (auto) and jax.lax.psum."""
    g = mesh.size
    global_shape = (g * local_shape[0],) + tuple(local_shape[1:])
    # Values stay finite over the chain at G = 2 (x 2^64); larger groups overflow to inf, which
    # changes no timing. Correctness is checked on one call (check).
    make = jax.jit(lambda k: jax.random.normal(k, global_shape, jnp.float32).astype(jnp.bfloat16),
                   out_shardings=NamedSharding(mesh, P(AX)))
    xs = [make(jax.random.key(len(local_shape) * 7 + local_shape[0]))]
    ours = lambda v: pk_jax.all_reduce(v, AX)
    lax = lambda v: jax.lax.psum(v, AX)
    one = [_program(mesh, ours, 1), _program(mesh, lax, 1)]
    check = collectives._check(one[0](xs), one[1](xs), exact=False)
    names = ["auto"]
    chains = [_program(mesh, ours, CHAIN), _program(mesh, lax, CHAIN)]
    if variants:
        for algo in VARIANTS:
            if _allowed(algo, local_shape, g):
                names.append(algo)
                chains.append(_program(mesh, lambda v, a=algo: pk_jax.all_reduce(v, AX, algorithm=a), CHAIN))
    chain_ms = timing.time_interleaved(chains, xs, warmup=2, reps=reps, ops_per_call=CHAIN)
    one_ms = timing.time_interleaved(one, xs, warmup=2, reps=reps, ops_per_call=1)
    extra = {"us": round(chain_ms[0] * 1e3, 2), "baseline_us": round(chain_ms[1] * 1e3, 2),
             "one_call_us": round(one_ms[0] * 1e3, 2), "baseline_one_call_us": round(one_ms[1] * 1e3, 2),
             "chain": CHAIN, "reps": reps, "check": check}
    if variants:
        extra["variants_us"] = {n: round(t * 1e3, 2) for n, t in zip(names[1:], chain_ms[2:])}
    return {"ours_ms": chain_ms[0], "baseline_ms": chain_ms[1], "extra": extra}


def run(reps: int, variants: bool = False, quick: bool = False) -> list[dict]:
    devices = jax.devices()
    g = len(devices)
    mesh = Mesh(np.array(devices), (AX,))
    cases = [("latency", [n], (n // 2,)) for n in SWEEP_BYTES]
    cases += [("latency_decode", [t, HIDDEN], (t, HIDDEN)) for t in DECODE_TOKENS]
    if quick:
        cases = cases[:2] + cases[len(SWEEP_BYTES):len(SWEEP_BYTES) + 1]
    rows = []
    start = time.perf_counter()
    for case, shape, local in cases:
        r = measure(mesh, local, reps, variants)
        e = r["extra"]
        rows.append({"op": "all_reduce", "case": case, "shape": shape, "dtype": "bfloat16", "group": g,
                     "ours_ms": round(r["ours_ms"], 6), "baseline": "jax.lax.psum",
                     "baseline_ms": round(r["baseline_ms"], 6), "ratio": round(r["baseline_ms"] / r["ours_ms"], 4),
                     "extra": {"bytes": int(np.prod(local)) * 2, **e}})
        var = "  " + " ".join(f"{k} {v:.1f}" for k, v in e.get("variants_us", {}).items()) if variants else ""
        print(f"  all_reduce {case:<15}{str(shape):<14}{int(np.prod(local)) * 2:>9} B  ours {e['us']:7.2f} us  "
              f"psum {e['baseline_us']:7.2f} us  one call {e['one_call_us']:7.1f} / {e['baseline_one_call_us']:7.1f} us"
              f"  {e['check']}{var}", flush=True)
    print(f"  latency sweep: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'case':<16}{'shape':<14}{'bytes':>9}{'ours us':>9}{'psum us':>9}{'x':>6}{'1-call us':>11}{'psum 1-call':>12}"
    print(head)
    print("-" * len(head))
    for r in rows:
        e = r["extra"]
        print(f"{r['case']:<16}{str(r['shape']):<14}{e['bytes']:>9}{e['us']:>9.2f}{e['baseline_us']:>9.2f}"
              f"{r['ratio']:>6.2f}{e['one_call_us']:>11.1f}{e['baseline_one_call_us']:>12.1f}")
