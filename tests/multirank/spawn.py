"""Starts the ranks of a multi-rank script directly (no launcher fail-fast): faults.py needs every
rank to run on after one dies. Sets the environment pk_jax.launch sets (harness.init_distributed
reads it) and, when ranks share a GPU, runs an MPS daemon for the job (shared/notes/one-gpu-ranks.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_gpus() -> int:
    """GPUs this machine shows (CUDA_VISIBLE_DEVICES, else nvidia-smi -L); 0 without any."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([v for v in vis.split(",") if v.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def ranks_per_gpu(n: int, requested: str | int) -> int:
    """'auto': spread n ranks over the local GPUs (ceil(n / gpus)); an int as given."""
    if requested != "auto":
        return max(int(requested), 1)
    gpus = local_gpus()
    return max(-(-n // gpus), 1) if gpus else 1


@contextlib.contextmanager
def mps_daemon(env: dict[str, str]) -> Iterator[None]:
    """An MPS control daemon in a per-job directory (mode 0700), stopped and removed at exit."""
    if shutil.which("nvidia-cuda-mps-control") is None:
        raise RuntimeError("ranks share a GPU but nvidia-cuda-mps-control is not on PATH (install the CUDA MPS tools, "
                           "or use one rank per GPU)")
    d = tempfile.mkdtemp(prefix="pk-jax-mps-")
    env.update(CUDA_MPS_PIPE_DIRECTORY=d, CUDA_MPS_LOG_DIRECTORY=d)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
    try:
        yield
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=env, timeout=60)
        shutil.rmtree(d, ignore_errors=True)


def rank_env(base: dict[str, str], rank: int, n: int, port: int, per_gpu: int, cpu: bool,
             cpu_devices: int) -> dict[str, str]:
    env = dict(base, PYTHONUNBUFFERED="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               PK_JAX_NUM_PROCESSES=str(n), PK_JAX_PROCESS_ID=str(rank), JAX_NUM_PROCESSES=str(n),
               JAX_PROCESS_ID=str(rank), PK_JAX_LOCAL_RANK=str(rank), PK_JAX_LOCAL_WORLD=str(n))
    # pytest's conftest gives 8 virtual CPU devices; a rank's count comes from PK_JAX_CPU_DEVICES
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    if cpu:
        env.update(JAX_PLATFORMS="cpu", PK_JAX_CPU_DEVICES=str(cpu_devices))
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(rank // per_gpu)
        if per_gpu > 1:
            env.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(100 // per_gpu))
            env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.8 / per_gpu:.3f}")
    return env


def run_ranks(argv: Sequence[str], n: int, *, per_gpu: int = 1, cpu: bool = False, cpu_devices: int = 1,
              timeout_s: float = 300, extra_env: dict[str, str] | None = None) -> list[tuple[int | None, str]]:
    """Runs `python argv...` as n ranks and waits for all; returns (exit code, output) per rank.
    A rank still running after timeout_s is killed (its process group) and reported with code None."""
    base = dict(os.environ, **(extra_env or {}))
    ctx = mps_daemon(base) if per_gpu > 1 and not cpu else contextlib.nullcontext()
    with ctx:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, *argv], env=rank_env(base, r, n, port, per_gpu, cpu, cpu_devices),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for r in range(n)]
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
