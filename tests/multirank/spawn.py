"""Starts the ranks of a multi-rank script without the launcher's fail-fast: faults.py needs the other
ranks to run on after one dies. The job's plan, each rank's environment and the MPS daemon (ranks
sharing a GPU) are the launcher's own (pk_jax.launch)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # run as a file: the checkout's pk_jax
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pk_jax.launch.mps import MpsDaemon  # noqa: E402
from pk_jax.launch.rank_env import free_port, local_gpus, plan_job, rank_env  # noqa: E402


def ranks_per_gpu(n: int, requested: str | int) -> int:
    """'auto': spread n ranks over the visible GPUs (ceil(n / GPUs); 1 without GPUs); an int as given."""
    if requested != "auto":
        return max(int(requested), 1)
    gpus = len(local_gpus())
    return max(-(-n // gpus), 1) if gpus else 1


def run_ranks(argv: Sequence[str], n: int, *, per_gpu: int = 1, cpu: bool = False, cpu_devices: int = 1,
              timeout_s: float = 300, extra_env: dict[str, str] | None = None) -> list[tuple[int | None, str]]:
    """Runs `python argv...` as n ranks and waits for all; returns (exit code, output) per rank. A rank
    still running after timeout_s is killed (its process group) and reported with code None."""
    base = dict(os.environ, **(extra_env or {}))
    # pytest's conftest asks for 8 virtual CPU devices; a CPU rank's count is the plan's
    base["XLA_FLAGS"] = " ".join(f for f in base.get("XLA_FLAGS", "").split()
                                 if not f.startswith("--xla_force_host_platform_device_count"))
    plan = plan_job(n, () if cpu else local_gpus(base), per_gpu, cpu, cpu_devices, f"127.0.0.1:{free_port()}")
    daemon = MpsDaemon(base) if plan.ranks_per_gpu > 1 else None
    try:
        if daemon is not None:
            daemon.start()
            plan = dataclasses.replace(plan, mps_dirs=daemon.dirs)
        procs = [subprocess.Popen([sys.executable, *argv], env=rank_env(plan, r, base), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(n)]
        results: list[tuple[int | None, str]] = []
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
                results.append((p.returncode, out))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
                results.append((None, out))
        return results
    finally:
        if daemon is not None:
            daemon.stop()
