"""The all-to-all rows of `python -m pk_jax.bench transfer` (pk_jax.bench.microbench.run_all_to_all):
row format, bandwidth arithmetic, baseline, the peer-access skip and failure rows, against a fake
extension (the GPU part is tests/gpu/test_microbench_gpu.py)."""

from __future__ import annotations

import pytest

from pk_jax.bench import microbench as mb

ROW_KEYS = {"op", "case", "shape", "dtype", "group", "ours_ms", "baseline", "baseline_ms", "ratio", "extra"}


class FakeExt:
    """mb_all_to_all returns (ms, per-GPU ms) from `times[mech]`; raises for mechanisms in `fail`."""

    def __init__(self, times, missing=(), fail=()):
        self.times, self.missing, self.fail, self.calls = times, list(missing), set(fail), []

    def mb_missing_peer_access(self, devs):
        return list(self.missing)

    def mb_all_to_all(self, mech, devs, size, sms, reps):
        self.calls.append((mech, tuple(devs), size, sms, reps))
        if mech in self.fail:
            raise RuntimeError(f"{mech} all-to-all: GPU 1 received 7 of 100 words wrong")
        ms = self.times[mech]
        return ms, [ms * 0.9] * (len(devs) - 1) + [ms]


def test_a2a_rows_format_and_bandwidth():
    ext = FakeExt({"copy_engine": 2.0, "tma_store": 1.6, "reg_store": 2.5})
    size = 16 << 20
    rows = mb.run_all_to_all(ext, [0, 1, 2, 3], [size], 132, 5)
    assert [r["case"] for r in rows] == ["a2a_copy_engine", "a2a_tma_store", "a2a_reg_store"]
    assert [c[0] for c in ext.calls] == mb.A2A_MECHANISMS  # copy engine first: the baseline
    assert all(c[1:] == ((0, 1, 2, 3), size, 132, 5) for c in ext.calls)
    for r in rows:
        assert ROW_KEYS <= r.keys()
        assert r["op"] == "transfer" and r["group"] == 4 and r["shape"] == [size] and r["dtype"] == "bytes"
        assert r["baseline"] == mb.A2A_BASELINE and r["baseline_ms"] == 2.0
        assert r["extra"]["sweep"] == "a2a" and r["extra"]["message_bytes"] == size
        assert len(r["extra"]["per_gpu_ms"]) == 4
    ce, tma, reg = rows
    # Each GPU receives 3 x 16 MiB in 2 ms; all four together four times that.
    assert ce["extra"]["gbps"] == pytest.approx(3 * size / 2e-3 / 1e9, abs=0.05)  # rounded to 0.1 GB/s
    assert ce["extra"]["aggregate_gbps"] == pytest.approx(4 * 3 * size / 2e-3 / 1e9, abs=0.05)
    assert ce["ratio"] == 1.0 and ce["extra"]["sms"] == 0
    assert tma["ratio"] == pytest.approx(2.0 / 1.6) and tma["extra"]["sms"] == 132
    assert reg["ratio"] == pytest.approx(0.8) and reg["ours_ms"] == 2.5


def test_a2a_missing_peer_access_skips_kernel_rows(capsys):
    ext = FakeExt({"copy_engine": 1.0}, missing=[(0, 2), (2, 0)])
    rows = mb.run_all_to_all(ext, [0, 1, 2], mb.A2A_SIZES_QUICK, 132, 3)
    assert [c[0] for c in ext.calls] == ["copy_engine"] * len(mb.A2A_SIZES_QUICK)
    out = capsys.readouterr().out
    assert "no peer access between GPU 0 -> GPU 2, GPU 2 -> GPU 0" in out
    skipped = [r for r in rows if r["extra"]["sweep"] == "a2a_skipped"]
    assert len(skipped) == 2 * len(mb.A2A_SIZES_QUICK)
    assert {r["case"] for r in skipped} == {"a2a_tma_store", "a2a_reg_store"}
    assert all(r["ours_ms"] is None and r["group"] == 3 and "GPU 0 -> GPU 2" in r["extra"]["error"] for r in skipped)


def test_a2a_failure_is_a_row_and_leaves_no_baseline():
    ext = FakeExt({"tma_store": 1.0, "reg_store": 1.0}, fail={"copy_engine"})
    rows = mb.run_all_to_all(ext, [0, 1], [1 << 20], 8, 1)
    assert rows[0]["extra"]["sweep"] == "a2a_failed" and "words wrong" in rows[0]["extra"]["error"]
    assert rows[1]["baseline_ms"] is None and rows[1]["ratio"] is None and rows[1]["group"] == 2


def test_a2a_sizes_are_valid_for_the_kernels():
    # The C++ side needs multiples of 16 B and, above 32 KiB, of 32 KiB (one TMA stage / register pass).
    for s in mb.A2A_SIZES + mb.A2A_SIZES_QUICK:
        assert s % 16 == 0 and (s <= 32 << 10 or s % (32 << 10) == 0)
    assert set(mb.A2A_SIZES_QUICK) <= set(mb.A2A_SIZES) and len(mb.A2A_SIZES_QUICK) < len(mb.A2A_SIZES)


def test_a2a_uses_at_most_eight_gpus():
    ext = FakeExt({"copy_engine": 1.0, "tma_store": 1.0, "reg_store": 1.0})
    rows = mb.run_all_to_all(ext, list(range(10)), [1 << 20], 132, 1)
    assert {r["group"] for r in rows} == {8} and all(len(c[1]) == 8 for c in ext.calls)


def test_plots_ignore_a2a_rows(tmp_path):
    pytest.importorskip("matplotlib")
    ext = FakeExt({"copy_engine": 1.0, "tma_store": 1.0, "reg_store": 1.0})
    rows = mb.run_all_to_all(ext, [0, 1], [1 << 20], 8, 1)
    pair = mb._row("tma_store", 1 << 20, 300.0, 1.0, 8, 1 << 20, 390.0, "message_size")
    mb._plots(rows + [pair], str(tmp_path), 390.0)
    assert (tmp_path / "transfer-message_size.png").exists()
