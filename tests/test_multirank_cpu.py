"""The multi-rank suite (tests/multirank) on CPU: 2 processes over gloo run a float32 subset of
check_ops.py, check_training.py, check_jit.py, check_moe.py, the small-path sweep and replays, and a
short soak through the launcher (every pk_jax op lowers to its jax.lax fallback there, so this checks
the harness and the fallbacks across processes), plus the harness's pieces in this process: groups of
a 2-D mesh, that a wrong result fails, row merging, the faults judge, the small sweep's refusal and
variant checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import pk_jax
from pk_jax.bench import hlo_checks

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "multirank"))

import faults  # noqa: E402
import harness  # noqa: E402
import small_cases  # noqa: E402


def _launch(script: str, tmp_path: Path, *args: str, **env_vars: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_vars)
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


def test_small_path_sweep_two_cpu_ranks(tmp_path):
    """check_small.py --quick (float32: 4 B, 1004 B, 1 MiB + 4): the ten small ops per size match
    NumPy, the jaxpr holds the small variants, and where a forced algorithm cannot serve the size (the LL
    ops above 1 MiB, two-shot with words that do not split over G) the row names the API's refusal and
    ran `auto`: at G = 2 the LL128 all_reduce up to 8 MiB, else the bulk path."""
    proc, rows = _launch("check_small.py", tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert len(rows) == 3 * 10 and all(r["extra"]["ok"] for r in rows), rows
    by = {(r["op"], r["case"]): r["extra"] for r in rows}
    assert {c.split("/")[0] for _, c in by} == {"small_one_shot", "small_two_shot", "small", "small_chunked",
                                                  "small_pipelined", "small_ll128", "axis0_tiled", "last_tiled", "dim0", "last"}
    for (op, case), e in by.items():
        kind = case.split("/")[0]
        big = case.split("/")[1] == "1048580B@x"
        odd_words = kind == "small_two_shot" and not big  # 1 and 251 words over G = 2
        ll_only = op != "all_reduce" or kind in ("small_one_shot", "small_two_shot")
        refused = (big and ll_only) or odd_words
        assert ("refused" in e) == refused, (op, case, e)
        assert e["algorithm"] == ("auto" if refused else kind if op == "all_reduce" else "small")
        if op != "all_reduce":
            want = "bulk" if big else 2
        elif kind == "small_pipelined":  # served at every size
            want = 5
        elif kind == "small_chunked":
            want = 4
        elif kind == "small_one_shot" and not refused:
            want = 2
        else:  # small_ll128, "small" and every refusal (auto) over G = 2 up to 8 MiB: the LL128 lines
            want = 6
        assert e["variant"] == want, (op, case, e)
    assert "serves 1..1048576 bytes" in by["all_reduce", "small_one_shot/1048580B@x"]["refused"]
    assert "divisible by the group size 2" in by["all_reduce", "small_two_shot/1004B@x"]["refused"]


def test_small_path_replays_two_cpu_ranks(tmp_path):
    """check_small_replay.py: 20 replays of the seven-op small program, each exact against NumPy."""
    proc, rows = _launch("check_small_replay.py", tmp_path, "--replays", "20")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert [r["case"] for r in rows] == ["20x@x"], rows
    e = rows[0]["extra"]
    assert e["ok"] and e["replays"] == 20 and e["bad_replays"] == 0 and e["max_err"] == 0.0, e


def test_small_chain_two_cpu_ranks(tmp_path):
    """check_small_chain.py --quick: chains of dependent all_reduces, exact after every call, for each algorithm."""
    proc, rows = _launch("check_small_chain.py", tmp_path, "--chain", "4", "--sizes", "4096", "65536")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert len(rows) == 2 * 2 and all(r["extra"]["ok"] and r["extra"]["max_err"] == 0.0 for r in rows), rows
    assert {r["case"].split("/")[0] for r in rows} == {"small_ll128", "small_one_shot"}
    assert all(r["extra"]["calls"] == 3 and r["extra"]["chain"] == 4 for r in rows), rows


def test_small_ops_fail_a_refusal_the_limits_do_not_predict():
    """The API refusing what it should serve (or serving what it should refuse) is a MISMATCH, which
    check_small.py fails; the expected refusals run `auto` with auto's own variant."""
    quiet = small_cases.small_ops(2, 1004, np.float32, lambda fn, shape: "")
    assert [o.refused.startswith("MISMATCH") for o in quiet] == [False, True] + [False] * 8  # two-shot: 251 words
    # small_chunked 4, small_pipelined 5, small_ll128 6; "small" and the refused two-shot (auto) take LL128 at G = 2
    assert [o.want for o in quiet] == [2, 6, 6, 4, 5, 6, 2, 2, 2, 2]
    loud = small_cases.small_ops(2, 1004, np.float32, lambda fn, shape: "no")
    assert [o.refused.startswith("MISMATCH") for o in loud] == [True, False] + [True] * 8
    assert all(o.algorithm == "auto" for o in loud)
    big = small_cases.small_ops(4, 8 << 20, np.float16, lambda fn, shape: "too big")
    # auto at G = 4, 8 MiB: the all_reduces take the pipelined chunk flags (two-shot), the rest bulk (24 MiB to send)
    assert [o.want for o in big] == [5] * 6 + [small_cases.BULK] * 4
    # The chunk flags and the LL128 lines serve 8 MiB ("small" picks the former), so refusing those four is a mismatch.
    assert [o.refused.startswith("MISMATCH") for o in big] == [False, False, True, True, True, True] + [False] * 4
    assert small_cases.small_ops(2, 6, np.float32, lambda fn, shape: "") == []  # 1.5 elements
    assert small_cases.factor_shape(1000, 3) == (1, 8, 125) and small_cases.factor_shape(3, 2) == (1, 3)


def test_small_variant_check_reads_the_cuda_lowering(monkeypatch):
    """variant_problems on a program lowered for CUDA (a stand-in group table: no GPU here): the
    pk_collective custom calls' (op, variant) are read from the StableHLO's backend_config and a bulk
    call where a small one is wanted is reported; the compiled-HLO spelling parses the same."""
    from pk_jax import _ext, runtime

    if not _ext.available():
        pytest.skip("the CUDA lowering is registered only with the extension")
    table = type("Table", (), {"mesh_ids": (0, 1), "mesh_shape": (2,), "group_axes": (0,)})
    monkeypatch.setattr(runtime, "lowering_group", lambda ctx, axis: (table, None))
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

    def body(v):
        return (pk_jax.all_reduce(v, "x", algorithm="small_two_shot"),
                pk_jax.all_gather(v, "x", tiled=True, algorithm="small"),
                pk_jax.all_reduce(v, "x", algorithm="one_shot"))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    traced = f.trace(jax.ShapeDtypeStruct((8, 4), jnp.float32))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    found = small_cases.jaxpr_variants(traced.jaxpr.jaxpr)
    assert found == [(3, 3), (1, 2), (3, 0)]
    want = [("all_reduce", 3), ("all_gather", 2), ("all_reduce", small_cases.BULK)]
    assert small_cases.variant_problems(want, found, text) == ["", "", ""]
    wrong = small_cases.variant_problems([("all_reduce", 3), ("all_gather", 2), ("all_reduce", 2)], found, text)
    assert wrong[:2] == ["", ""] and "jaxpr variant 0, want 2" in wrong[2] and "holds 0 pk_collective" in wrong[2]
    hlo = ('  %ffi = f32[4,4]{1,0} custom-call(f32[4,4]{1,0} %p), custom_call_target="pk_collective", '
           'api_version=API_VERSION_TYPED_FFI, backend_config={box = dense<[1, 4]> : tensor<2xi64>, op = 3 : i32, '
           'variant = 3 : i32, vec_bytes = 16 : i32}')
    assert hlo_checks.custom_call_attrs(hlo, "pk_collective") == [{"op": 3, "variant": 3, "vec_bytes": 16}]


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


def test_moe_fused_path_two_cpu_ranks(tmp_path):
    """check_moe.py --smoke with PK_JAX_MOE_DISPATCH=fused: the fused path's primitives (their jax.lax emulation
    over gloo on CPU) across 2 processes, exact dispatch rows and counts."""
    proc, rows = _launch("check_moe.py", tmp_path, "--smoke", PK_JAX_MOE_DISPATCH="fused")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert all(r["extra"]["ok"] for r in rows) and "FAIL" not in proc.stdout, rows
    assert {(r["op"], r["case"]) for r in rows} == {(op, f"{routing}_{case}") for op in ("dispatch", "combine")
                                                    for routing in ("uniform_k2", "skewed_k2_cap2")
                                                    for case in ("fwd", "fwd_bwd")}
    exact = [r for r in rows if r["op"] == "dispatch" and r["case"].endswith("_fwd")]
    assert exact and all(r["extra"]["max_err"] == 0 for r in exact), exact


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


def test_faults_judge_shots():
    """Mode shots: rank 1 picked the other LL128 kernel, so it must report the mismatch too."""
    ok_out = "STARTUP 0.1\nFAULT-OK 0.41 RuntimeError: pk_jax all_reduce: ... small_ll128 ... PK_JAX_AR_LL128_SHOTS"
    assert faults.judge("shots", [(0, ok_out), (0, ok_out)]) == (True, "", 0.41)
    assert not faults.judge("shots", [(0, ok_out), (1, "FAULT-FAIL 2.0 no error: ")])[0]
    assert not faults.judge("shots", [(0, ok_out), (0, "")])[0]


@pytest.mark.parametrize("mode", ["kill", "skip"])
def test_faults_judge(mode):
    ok_out = "STARTUP 0.1\nFAULT-OK 2.31 RuntimeError: pk_jax all_gather: ... rank 1 ..."
    dead = (9 if mode == "kill" else 0, "")
    assert faults.judge(mode, [(0, ok_out), dead, (0, ok_out)]) == (True, "", 2.31)
    assert not faults.judge(mode, [(1, "FAULT-FAIL 2.0 no error"), dead])[0]
    assert not faults.judge(mode, [(0, ok_out), dead, (None, "")])[0]  # a rank left running
    if mode == "kill":
        assert not faults.judge(mode, [(0, ok_out), (0, "")])[0]


def test_ring_two_cpu_ranks(tmp_path):
    """check_ring.py on the fallbacks across 2 processes: the ring shift (lax.ppermute there) moves blocks
    exactly, with an all_reduce in flight, and ring attention's output and gradients match the float32
    reference."""
    proc, rows = _launch("check_ring.py", tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert {r["op"] for r in rows} == {"ring_shift", "ring_attention"} and len(rows) == 3, rows
    assert all(r["extra"]["ok"] for r in rows), rows
