"""The multi-rank suite on this machine's GPUs: `python -m pk_jax.bench multirank --ranks 2 4` (on one
GPU the ranks share it under MPS; on several, one rank per GPU). Every case of check_ops, check_training,
check_jit, check_moe (expert parallelism), the soak and both fault modes must pass. The bench is the primary command; this wrapper runs it from pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MIN_GPUS = 1
ROOT = Path(__file__).resolve().parents[2]
RANKS = (2, 4)


@pytest.mark.parametrize("ranks", RANKS)
def test_multirank_suite_passes(tmp_path, ranks):
    out = tmp_path / f"multirank-{ranks}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    # This pytest process may already hold most of GPU 0 (XLA preallocates 75% when conftest lists the
    # GPUs): the ranks share what is left.
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.16 / ranks:.3f}")
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)  # the runtime shares XLA's preallocated region
    proc = subprocess.run([sys.executable, "-m", "pk_jax.bench", "multirank", "--ranks", str(ranks), "--calls", "300",
                           "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    print(log[-20000:])
    assert out.exists(), log[-4000:]
    rows = json.loads(out.read_text())["rows"]
    failed = [f"{r['op']} {r['case']} {r['dtype']}: {r['extra'].get('error', r['extra']['max_err'])}"
              for r in rows if not r["extra"]["ok"]]
    assert not failed, "\n".join(failed[:40])
    assert proc.returncode == 0, log[-4000:]
    assert {r["op"] for r in rows} >= {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "matmul",
                                       "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "fault",
                                       "dispatch", "combine", "moe_mlp"}
    assert all(r["extra"]["startup_s"] is not None for r in rows)
