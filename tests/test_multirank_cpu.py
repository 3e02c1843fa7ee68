"""The multi-rank suite (tests/multirank) on CPU: 2 processes over gloo run a float32 subset of
check_ops.py, check_training.py, check_jit.py, check_moe.py and a short soak through the launcher (every pk_jax op lowers to its jax.lax fallback
there, so this checks the harness and the fallbacks across processes), plus the harness's pieces
in this process: groups of a 2-D mesh, that a wrong result fails, row merging, the faults judge."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "multirank"))

import faults  # noqa: E402
import harness  # noqa: E402


def _launch(script: str, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # conftest's 8 virtual devices are this process's, not the ranks'
    out = tmp_path / f"{script}.json"
    cmd = [sys.executable, "-m", "pk_jax.launch", "--cpu", "-n", "2", "--timeout", "150",
           str(ROOT / "tests" / "multirank" / script), "--quick", "--dtypes", "float32", "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, cwd=ROOT)
    return proc, json.loads(out.read_text()) if out.exists() else []


def test_check_ops_two_cpu_ranks(tmp_path):
    proc, rows = _launch("check_ops.py", tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    passed = [ln for ln in proc.stdout.splitlines() if ln.startswith("[rank 0] PASS ")]
    assert len(passed) == len(rows) >= 12, log[-4000:]
    assert "FAIL" not in proc.stdout
    ops = {r["op"] for r in rows}
    assert {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "matmul", "all_gather_matmul",
            "matmul_reduce_scatter", "matmul_all_reduce"} <= ops
    for r in rows:
        assert r["extra"]["ok"] and r["extra"]["ranks_per_gpu"] == 1 and r["extra"]["startup_s"] >= 0
        assert r["group"] == (1 if r["op"] == "matmul" else 2)


def test_training_two_cpu_ranks(tmp_path):
    """check_training.py on the fallbacks: gradients of every fused op (w as stored and transposed)
    equal the float32 reference across 2 processes, and the emitted program has no float32 GEMM."""
    proc, rows = _launch("check_training.py", tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert len(rows) == 6 and all(r["extra"]["ok"] and 0 < r["extra"]["max_err"] < 1e-2 for r in rows), rows
    assert {r["op"] for r in rows} == {"all_gather_matmul_vjp", "matmul_reduce_scatter_vjp", "matmul_all_reduce_vjp"}


def test_plain_jit_mlp_two_cpu_ranks(tmp_path):
    """check_jit.py on the fallbacks: the NamedSharding-only MLP's values and gradients across 2 processes."""
    proc, rows = _launch("check_jit.py", tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert [r["case"] for r in rows] == ["fwd@1x2", "fwd_bwd@1x2"] and all(r["extra"]["ok"] for r in rows), rows


def test_moe_two_cpu_ranks(tmp_path):
    """check_moe.py --quick on the fallbacks: dispatch / combine against the NumPy routing model (a member
    receiving nothing; top-2 with capacity drops) and moe_mlp's output and gradients (capacity drops; experts replicated
    over a data axis of the two processes, their gradients summed by pk_jax.all_reduce) across 2 processes."""
    proc, rows = _launch("check_moe.py", tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert all(r["extra"]["ok"] for r in rows) and "FAIL" not in proc.stdout, rows
    cases = {(r["op"], r["case"]) for r in rows}
    for routing in ("idle_member_k2", "skewed_k2_cap2"):
        for op in ("dispatch", "combine"):
            assert {(op, f"{routing}_fwd"), (op, f"{routing}_fwd_bwd")} <= cases, sorted(cases)
    assert {("moe_mlp", "skewed_k2_cap2_fwd_bwd"), ("moe_mlp", "skewed_k2_fwd_bwd@dp2xep1")} <= cases, sorted(cases)
    exact = [r for r in rows if r["op"] == "dispatch" and r["case"].endswith("_fwd")]
    assert exact and all(r["extra"]["max_err"] == 0 for r in exact), exact  # rows, order and counts move exactly
    assert len(rows) == 12 and {r["group"] for r in rows if r["op"] != "moe_mlp"} == {2}


def test_soak_two_cpu_ranks(tmp_path):
    proc, rows = _launch("soak.py", tmp_path, "--calls", "24")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert sum(r["extra"]["calls"] for r in rows) == 24
    assert all(r["extra"]["ok"] for r in rows)


def test_groups_of_a_2d_mesh_follow_each_axis():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    assert harness.group_of(mesh, "tp", 2) == [2, 3] and harness.position(mesh, "tp", 3) == 1
    assert harness.group_of(mesh, "dp", 1) == [1, 3] and harness.position(mesh, "dp", 1) == 0


def test_compare_fails_a_wrong_result():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    a = np.random.default_rng(0).standard_normal((2, 8, 4)).astype(np.float32)
    out = harness.stacked_array(mesh, a)
    assert harness.compare([out], lambda m: [a[m]], "exact", "float32") == (True, 0.0)
    wrong = a.copy()
    wrong[1, 3, 2] += 0.5
    ok, err = harness.compare([out], lambda m: [wrong[m]], "exact", "float32")
    assert not ok and err > 0.1
    ok, err = harness.compare([out], lambda m: [a[m] * (1 + 1e-3)], "reduce", "bfloat16")
    assert ok and 0 < err < 2.4e-2


def test_merge_fails_a_case_that_failed_or_is_missing_on_any_rank():
    row = lambda case, ok, err: {"op": "all_gather", "case": case, "shape": [2], "dtype": "float32", "group": 2,
                                 "extra": {"ok": ok, "max_err": err}}
    merged = harness.merge_rows([[row("a", True, 0.0), row("b", True, 0.0)],
                                 [row("a", True, 1e-7), row("b", False, float("inf"))]], 2, 1.5)
    assert [m["extra"]["ok"] for m in merged] == [True, False]
    assert merged[0]["extra"]["max_err"] == 1e-7 and merged[1]["extra"]["max_err"] is None
    assert merged[0]["extra"]["ranks_per_gpu"] == 2 and merged[0]["extra"]["startup_s"] == 1.5
    partial = harness.merge_rows([[row("a", True, 0.0), row("b", True, 0.0)], [row("b", True, 0.0)]], 1, 0.0)
    assert [(m["case"], m["extra"]["ok"]) for m in partial] == [("a", False), ("b", True)]


@pytest.mark.parametrize("mode", ["kill", "skip"])
def test_faults_judge(mode):
    ok_out = "STARTUP 0.1\nFAULT-OK 2.31 RuntimeError: pk_jax all_gather: ... rank 1 ..."
    dead = (9 if mode == "kill" else 0, "")
    assert faults.judge(mode, [(0, ok_out), dead, (0, ok_out)]) == (True, "", 2.31)
    assert not faults.judge(mode, [(1, "FAULT-FAIL 2.0 no error"), dead])[0]
    assert not faults.judge(mode, [(0, ok_out), dead, (None, "")])[0]  # a rank left running
    if mode == "kill":
        assert not faults.judge(mode, [(0, ok_out), (0, "")])[0]
