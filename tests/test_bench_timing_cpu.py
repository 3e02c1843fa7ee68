"""pk_jax.bench.timing: samples of calls issued back to back (min_sample_ms) and the per-call default."""

from __future__ import annotations

import time

import jax.numpy as jnp

from pk_jax.bench import timing


def test_calls_for_sizes_samples():
    assert timing.calls_for(2.0, None) == 1
    assert timing.calls_for(2.0, 20.0) == 10
    assert timing.calls_for(3.0, 20.0) == 7          # rounded up: a sample lasts at least min_sample_ms
    assert timing.calls_for(50.0, 20.0) == 1
    assert timing.calls_for(0.001, 20.0) == timing.MAX_CALLS_PER_SAMPLE
    assert timing.calls_for(0.0, 20.0) == 1


def test_samples_issue_calls_back_to_back_and_report_per_op():
    """A 1 ms op: with min_sample_ms 40 each sample makes many calls (~40; at least 2 unless its sizing call took
    over 20 ms) and one wait; the per-op time stays ~1 ms. Without it, one call per sample."""
    counts = {"short": 0, "long": 0}

    def op(name, ms):
        def fn(inputs):
            counts[name] += 1
            time.sleep(ms / 1e3)
            return jnp.zeros(())
        return fn

    short, long = op("short", 1.0), op("long", 60.0)
    got = timing.time_interleaved([short, long], [0], warmup=1, reps=4, ops_per_call=1, min_sample_ms=40.0)
    assert 0.9 < got[0] < 8.0 and 58.0 < got[1] < 120.0, got  # per op (loose: CI machines are noisy)
    assert counts["long"] == 1 + 1 + 4                         # warm-up, the sizing call, 4 samples of one call
    assert 1 + 1 + 4 * 2 <= counts["short"] <= 1 + 1 + 4 * 40  # several calls per sample (~40 when quiet)
    counts.update(short=0, long=0)
    timing.time_interleaved([short], [0], warmup=1, reps=3, ops_per_call=1)
    assert counts["short"] == 1 + 3
