"""Runtime pieces that need no GPU: the multicast guard, group resolution (C++ vs Python), the
bench CLI's CPU mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pk_jax
from pk_jax import _ext
from pk_jax.sharding import GroupTable

needs_ext = pytest.mark.skipif(not pk_jax.extension_available(), reason="CUDA extension not built")
MULTICAST_VARS = ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                  "PK_JAX_ENABLE_MULTICAST")


@pytest.fixture
def clean_env(monkeypatch):
    for v in MULTICAST_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


@needs_ext
def test_multicast_off_by_default(clean_env):
    allowed, reason = pk_jax.runtime.multicast_policy()
    assert not allowed and "not requested" in reason


@needs_ext
@pytest.mark.parametrize("var,value", [("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"),
                                       ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")])
def test_multicast_refused_when_machine_forbids_it(var, value):
    # Described environments: no test sets the opt-in in the real one.
    allowed, reason = _ext.ext.multicast_policy_of({"PK_JAX_ENABLE_MULTICAST": "1", var: value})
    assert not allowed and var in reason


@needs_ext
def test_multicast_only_with_explicit_opt_in():
    assert _ext.ext.multicast_policy_of({"PK_JAX_ENABLE_MULTICAST": "1"})[0]
    assert not _ext.ext.multicast_policy_of({"PK_JAX_ENABLE_MULTICAST": "0"})[0]


@needs_ext
@pytest.mark.parametrize("shape,axes", [((8,), (0,)), ((2, 4), (1,)), ((2, 4), (0,)), ((2, 4), (0, 1)),
                                        ((2, 4), (1, 0)), ((2, 2, 2), (0, 2)), ((4, 2), (1,))])
def test_cpp_group_resolution_matches_python(shape, axes):
    rng = np.random.default_rng(len(shape) * 10 + sum(axes))
    ids = tuple(int(i) for i in rng.permutation(int(np.prod(shape))) + 100)
    table = GroupTable(ids, shape, axes, True)
    for dev in ids:
        members, rank = table.members(dev)
        assert _ext.ext.resolve_group(dev, list(ids), list(shape), list(axes)) == (members, rank)
        assert members[rank] == dev and len(set(members)) == len(members)


@needs_ext
def test_cpp_group_resolution_rejects_foreign_device():
    with pytest.raises(ValueError, match="not in the op's mesh"):
        _ext.ext.resolve_group(99, [0, 1], [2], [0])


def test_bench_cli_runs_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "pk_jax.bench", "collectives", "--op", "all_to_all", "--reps", "1",
                        "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["suite"] == "collectives" and doc["rows"]
    for row in doc["rows"]:
        assert {"op", "case", "shape", "dtype", "group", "ours_ms", "baseline", "baseline_ms", "ratio"} <= row.keys()
        assert row["extra"]["check"] == "ok"


@pytest.mark.parametrize("suite", ["transfer", "sync"])
def test_microbench_cli_fails_clearly_without_gpus(suite, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "pk_jax.bench", suite, "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0
    assert "needs >= 2 CUDA GPUs" in p.stderr + p.stdout


def test_saturation_point_from_sm_sweep():
    from pk_jax.bench.microbench import saturation_sms

    rows = [{"case": "tma_store", "extra": {"sweep": "sm_count", "sms": s, "gbps": g}}
            for s, g in [(1, 40), (4, 150), (8, 300), (16, 340), (132, 350)]]
    assert saturation_sms(rows, "tma_store") == 16  # first point >= 0.9 x 350 = 315 GB/s
    assert saturation_sms(rows, "tma_store", fraction=0.8) == 8
    assert saturation_sms(rows, "reg_store") is None


@pytest.mark.parametrize("suite,args", [("gemm", []), ("tp_gemm", ["--op", "matmul_all_reduce"])])
def test_gemm_bench_clis_write_results_format(suite, args, tmp_path):
    """The GEMM suites run end to end on CPU (jnp.dot / the composition underneath) and write rows in
    the shape of shared/notes/results-format.md, with the per-suite extras the issues ask for."""
    out = tmp_path / f"{suite}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PK_JAX_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-m", "pk_jax.bench", suite, "--quick", "--reps", "1", *args,
                        "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["suite"] == suite and doc["rows"] and {"device", "commit", "date", "command"} <= doc.keys()
    for row in doc["rows"]:
        assert {"op", "case", "shape", "dtype", "group", "ours_ms", "baseline", "baseline_ms", "ratio"} <= row.keys()
        assert len(row["extra"]["mnk"]) == 3 and row["extra"]["check"] == "ok"
        if suite == "tp_gemm":
            assert {"bound_ms", "non_overlapped_fraction", "num_comm_sms"} <= row["extra"].keys()
    if suite == "gemm":  # the default suite includes the backward layouts' rows
        layouts = {(r["case"], r["extra"]["layout"], r["extra"]["shards"]) for r in doc["rows"] if "layout" in r["extra"]}
        assert {("layout_NT", "NT", 1), ("layout_TN", "TN", 1)} <= layouts
