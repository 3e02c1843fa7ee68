"""`python -m pk_jax.launch` on GPUs: 2 ranks sharing GPU 0 under the launcher's MPS daemon, and one rank per
GPU; each rank runs tests/launch_scripts/gpu_ranks.py (every collective and a fused op against NumPy).

This pytest process already holds a GPU context with XLA's preallocation (conftest lists the GPUs), so the
ranks get XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 here; the standalone commands in docs/multiprocess.md use the
launcher's defaults."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

MIN_GPUS = 1
ROOT = Path(__file__).parent.parent.parent
SCRIPT = ROOT / "tests" / "launch_scripts" / "gpu_ranks.py"


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_MEM_FRACTION="0.1", PK_JAX_TIMEOUT_MS="5000")
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    res = subprocess.run([sys.executable, "-m", "pk_jax.launch", "--timeout", "300", *args, str(SCRIPT)], env=env,
                         capture_output=True, text=True, timeout=360, cwd=ROOT)
    print(res.stdout[-6000:], res.stderr[-6000:], sep="\n")  # shown by pytest on failure
    return res


def _assert_all_pass(res: subprocess.CompletedProcess, ranks: int) -> None:
    assert res.returncode == 0, f"launcher exit {res.returncode}"
    for r in range(ranks):
        assert f"[rank {r}] ALL PASS rank {r}" in res.stdout
    assert "FAIL" not in res.stdout


def test_two_ranks_share_one_gpu_under_mps():
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control not on PATH")
    _assert_all_pass(_launch(["--share-gpu", "-n", "2"]), 2)


def test_one_rank_per_gpu():
    n = len(jax.devices("gpu"))
    if n < 2:
        pytest.skip("needs >= 2 GPUs")
    _assert_all_pass(_launch(["-n", str(min(n, 4))]), min(n, 4))
