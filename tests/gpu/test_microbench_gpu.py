"""The transfer and sync microbenchmarks on GPUs: every mechanism moves the right bytes (the C++
side compares destination with source after timing), and the latency probes return sane values."""

from __future__ import annotations

import pytest

from pk_jax import _ext, runtime

MIN_GPUS = 2


def ordinals() -> list[int]:
    return [d.local_hardware_id for d in runtime.gpu_devices()]


@pytest.mark.parametrize("mechanism", ["copy_engine", "tma_store", "tma_load", "tma_store_add", "reg_store",
                                       "reg_load"])
@pytest.mark.parametrize("message", [128, 4096, 1 << 20])
@pytest.mark.parametrize("sms", [1, 132])
def test_transfer_mechanisms_move_the_bytes(mechanism, message, sms):
    d = ordinals()
    ms, gbps, moved = _ext.ext.mb_transfer(mechanism, d[0], d[1], 16 << 20, message, sms, 2)
    assert ms > 0 and 0 < gbps < 2000 and moved > 0


@pytest.mark.parametrize("mechanism", ["copy_engine", "tma_store", "tma_store_add", "reg_store"])
def test_all_pairs(mechanism):
    assert 0 < _ext.ext.mb_all_pairs(mechanism, ordinals(), 16 << 20, 132, 2) < 2000


def test_bad_arguments_raise():
    d = ordinals()
    with pytest.raises(RuntimeError, match="unknown mechanism"):
        _ext.ext.mb_transfer("smoke_signals", d[0], d[1], 1 << 20, 4096, 1, 1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        _ext.ext.mb_transfer("tma_store", d[0], d[1], 1 << 20, 24, 1, 1)


def test_latency_probes():
    d = ordinals()
    assert 1 < _ext.ext.mb_mbarrier_handoff_ns(d[0], 10_000) < 5_000
    assert 10 < _ext.ext.mb_hbm_flag_handoff_ns(d[0], 2_000) < 50_000
    assert 100 < _ext.ext.mb_peer_round_trip_ns(d[0], d[1], 2_000) < 200_000
    assert runtime.ensure_initialized() is None
    assert 100 < _ext.ext.mb_group_barrier_ns(2_000) < 200_000
    runtime.check()


@pytest.mark.parametrize("mechanism", ["copy_engine", "tma_store", "reg_store"])
def test_all_to_all_moves_the_bytes(mechanism):
    """The smallest a2a size of the bench over every local GPU (up to 8); the C++ side checks every
    received slot against the (src, dst, index) pattern and raises on a wrong word."""
    from pk_jax.bench.microbench import A2A_SIZES

    d = ordinals()[:8]
    if mechanism != "copy_engine" and _ext.ext.mb_missing_peer_access(d):
        pytest.skip(f"no peer access: {_ext.ext.mb_missing_peer_access(d)}")
    ms, gpu_ms = _ext.ext.mb_all_to_all(mechanism, d, A2A_SIZES[0], 132, 2)
    # ms: median over rounds of the slowest GPU, so no GPU's own median exceeds it.
    assert ms > 0 and len(gpu_ms) == len(d) and 0 < max(gpu_ms) <= ms * 1.0001
    assert (len(d) - 1) * A2A_SIZES[0] / (ms * 1e-3) / 1e9 < 2000  # per-GPU receive GB/s, sane


def test_all_to_all_bad_arguments_raise():
    d = ordinals()[:8]
    with pytest.raises(RuntimeError, match="unknown all-to-all mechanism"):
        _ext.ext.mb_all_to_all("tma_load", d, 1 << 20, 132, 1)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        _ext.ext.mb_all_to_all("tma_store", d, (32 << 10) + 16, 132, 1)
