"""What each rank of a pk_jax.launch job gets in its environment (pure functions; no processes)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping

# The MPS daemon's per-rank knobs; set only where the user has not set them.
MPS_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
MPS_PIPE_DIR, MPS_LOG_DIR = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
TOTAL_MEM_FRACTION = 0.8  # of one GPU, split among the ranks sharing it (XLA preallocates 75% by default)


class LaunchError(Exception):
    """A job that cannot start as asked; the message names the option to change."""


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """How the ranks of one job map to devices.

    ranks: processes; gpus: the GPU ids the ranks use (CUDA_VISIBLE_DEVICES entries; empty: no GPU
    assignment); ranks_per_gpu: ranks sharing one GPU; cpu: CPU-only job with `cpu_devices` each;
    coordinator: host:port of jax.distributed's coordinator; mps_dirs: (pipe, log) of the MPS daemon.
    """

    ranks: int
    gpus: tuple[str, ...]
    ranks_per_gpu: int
    cpu: bool
    cpu_devices: int
    coordinator: str
    mps_dirs: tuple[str, str] | None = None


def local_gpus(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES' entries if set, else `nvidia-smi -L`'s."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = []
        for v in (v.strip() for v in visible.split(",")):
            if not v or v.startswith("-"):  # as in CUDA: an invalid entry (e.g. -1) ends the list
                break
            gpus.append(v)
        return tuple(gpus)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(str(i) for i, _ in enumerate(line for line in out.splitlines() if line.startswith("GPU ")))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the coordinator binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_job(nproc: int | None, gpus: tuple[str, ...], ranks_per_gpu: int, cpu: bool, cpu_devices: int,
             coordinator: str) -> JobPlan:
    """Checks the options against the GPUs found and fills in the rank count."""
    if ranks_per_gpu < 1:
        raise LaunchError(f"--ranks-per-gpu must be >= 1, got {ranks_per_gpu}")
    if cpu_devices < 1:
        raise LaunchError(f"--cpu-devices must be >= 1, got {cpu_devices}")
    if nproc is not None and nproc < 1:
        raise LaunchError(f"-n must be >= 1, got {nproc}")
    if cpu:
        if ranks_per_gpu != 1:
            raise LaunchError("--cpu and --ranks-per-gpu exclude each other: drop one of them")
        if nproc is None:
            raise LaunchError("--cpu needs -n N (the number of processes)")
        return JobPlan(nproc, (), 1, True, cpu_devices, coordinator)
    if not gpus:
        if ranks_per_gpu != 1:
            raise LaunchError("--ranks-per-gpu needs a GPU, and none was found (CUDA_VISIBLE_DEVICES, nvidia-smi -L)")
        if nproc is None:
            raise LaunchError("no GPU found (CUDA_VISIBLE_DEVICES, nvidia-smi -L): pass -n N, and --cpu for a "
                              "CPU-only job")
        return JobPlan(nproc, (), 1, False, cpu_devices, coordinator)
    slots = len(gpus) * ranks_per_gpu
    ranks = slots if nproc is None else nproc
    if ranks > slots:
        raise LaunchError(f"-n {ranks} needs {-(-ranks // ranks_per_gpu)} GPUs at --ranks-per-gpu {ranks_per_gpu}, "
                          f"but {len(gpus)} are visible ({','.join(gpus)}): lower -n or raise --ranks-per-gpu")
    return JobPlan(ranks, tuple(gpus[: -(-ranks // ranks_per_gpu)]), ranks_per_gpu, False, cpu_devices, coordinator)


def rank_env(plan: JobPlan, rank: int, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of rank `rank`: `base` plus the job's variables (the user's own settings of the
    MPS share and memory fraction win)."""
    env = dict(base)
    env.update({
        "JAX_COORDINATOR_ADDRESS": plan.coordinator,
        "JAX_NUM_PROCESSES": str(plan.ranks),
        "JAX_PROCESS_ID": str(rank),
        "PK_JAX_LOCAL_RANK": str(rank),   # one host: local and global ranks coincide
        "PK_JAX_LOCAL_WORLD": str(plan.ranks),
        "PYTHONUNBUFFERED": "1",
    })
    if plan.cpu:
        env.update({"JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
                    "JAX_NUM_CPU_DEVICES": str(plan.cpu_devices)})
        return env
    if plan.gpus:
        env["CUDA_VISIBLE_DEVICES"] = plan.gpus[rank // plan.ranks_per_gpu]
        env["PK_JAX_RANKS_PER_GPU"] = str(plan.ranks_per_gpu)
    if plan.ranks_per_gpu > 1:
        env.setdefault(MPS_THREAD_PERCENTAGE, str(100 // plan.ranks_per_gpu))
        env.setdefault(MEM_FRACTION, f"{TOTAL_MEM_FRACTION / plan.ranks_per_gpu:.3f}")
    if plan.mps_dirs is not None:
        env[MPS_PIPE_DIR], env[MPS_LOG_DIR] = plan.mps_dirs
    return env
