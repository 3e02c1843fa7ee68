"""Timing on the device by many back-to-back calls and one sync.

One jitted call runs the op K times on K different inputs (rotating buffers, so repeated calls do
not measure L2 hits), and the host waits once; the per-op time is the call's time over K, with K
large enough that dispatch overhead is a small fraction. Median of `reps` calls after warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import jax


def calls_per_measure(bytes_per_call: int, budget_bytes: int = 24 << 30, lo: int = 4, hi: int = 100) -> int:
    """How many rotating inputs fit in `budget_bytes` (input + output per call)."""
    return max(lo, min(hi, budget_bytes // max(bytes_per_call, 1)))


def time_per_op(fn: Callable[[Sequence[jax.Array]], object], inputs: Sequence[jax.Array], *,
                warmup: int = 8, reps: int = 20) -> tuple[float, list[float]]:
    """Median milliseconds per op of `fn(inputs)`, which applies the op once per input."""
    k = len(inputs)
    for _ in range(warmup):
        jax.block_until_ready(fn(inputs))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(inputs))
        samples.append((time.perf_counter() - t0) * 1e3 / k)
    return statistics.median(samples), samples


def turns(count: int, reps: int) -> Iterator[int]:
    """Indices of `count` contenders timed in `reps` turns, turn r starting at contender r % count, so
    no contender always follows the same one (a light op before it leaves the GPU cooler, a heavy one
    hotter). Used by the benchmark and the autotuner alike."""
    for rep in range(reps):
        for i in range(count):
            yield (rep + i) % count


MAX_CALLS_PER_SAMPLE = 32
# The suites whose ops take milliseconds (context, moe) time samples of about this long, calls back to back and
# one sync (time_interleaved's min_sample_ms): device time, not a host sync per call, which costs ~0.2 ms per
# call on 2 GPUs and ~0.47 ms on 4 (scripts/latency_floor.py, 4 x H100, 2026-11-26).
DEVICE_SAMPLE_MS = 20.0


def calls_for(call_ms: float, min_sample_ms: float | None) -> int:
    """Back-to-back calls per timed sample so that a sample lasts about `min_sample_ms` (1 when None)."""
    if not min_sample_ms or call_ms <= 0:
        return 1
    return max(1, min(MAX_CALLS_PER_SAMPLE, int(-(-min_sample_ms // call_ms))))


def time_interleaved(fns: Sequence[Callable[[Sequence], object]], inputs: Sequence, *, warmup: int = 3,
                     reps: int = 20, ops_per_call: int | None = None,
                     min_sample_ms: float | None = None) -> list[float]:
    """Median milliseconds per op of each fn, timed in `turns` so that clock and power drift hit every
    contender alike. A call applies the op `ops_per_call` times (default: once per element of `inputs`).
    min_sample_ms: each sample issues that fn's call back to back (asynchronously) until the sample lasts
    about this long, then waits once (calls_for, from one more timed warm call): a short op's time is then
    the device's, not a host sync per call (multi-GPU programs pay ~0.2-0.5 ms per call for it). None: one call
    and one wait per sample (the time a single call takes, dispatch included)."""
    k = ops_per_call or len(inputs)
    calls = []
    for fn in fns:
        for _ in range(warmup):
            jax.block_until_ready(fn(inputs))
        n = 1
        if min_sample_ms:  # one more warm call, timed, sizes the samples
            t0 = time.perf_counter()
            jax.block_until_ready(fn(inputs))
            n = calls_for((time.perf_counter() - t0) * 1e3, min_sample_ms)
        calls.append(n)
    samples: list[list[float]] = [[] for _ in fns]
    for j in turns(len(fns), reps):
        t0 = time.perf_counter()
        for _ in range(calls[j] - 1):
            fns[j](inputs)
        jax.block_until_ready(fns[j](inputs))
        samples[j].append((time.perf_counter() - t0) * 1e3 / (k * calls[j]))
    return [statistics.median(s) for s in samples]
