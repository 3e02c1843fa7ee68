"""Command line of `python -m pk_jax.launch` (usage in pk_jax/launch/__init__.py and --help)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from pk_jax.launch.mps import MpsDaemon, running_daemon
from pk_jax.launch.rank_env import LaunchError, free_port, local_gpus, plan_job, rank_env
from pk_jax.launch.supervisor import RankSpec, Supervisor

USAGE = "python -m pk_jax.launch [options] (script.py | -m module) [args ...]"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pk_jax.launch", usage=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Starts N Python processes (ranks) of one jax.distributed job on this host, coordinator on\n"
            "127.0.0.1 at a free port. Each rank's environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,\n"
            "JAX_PROCESS_ID, PK_JAX_LOCAL_RANK, PK_JAX_LOCAL_WORLD, PYTHONUNBUFFERED=1, and on GPUs\n"
            "CUDA_VISIBLE_DEVICES (rank i gets GPU i // ranks-per-gpu) and PK_JAX_RANKS_PER_GPU. In the rank,\n"
            "call pk_jax.launch.initialize_from_env() (jax.distributed.initialize with these values), then\n"
            "pk_jax.initialize()."),
        epilog=(
            "output: every line a rank writes is forwarded prefixed '[rank i] ' (stdout to stdout, stderr\n"
            "to stderr).\n"
            "exit: 0 when every rank exits 0. The first rank that fails (non-zero exit or a signal) ends\n"
            "the job: the other ranks' process groups get SIGTERM, SIGKILL after --grace seconds, and the\n"
            "launcher prints the failed rank, its exit code or signal and its last 20 lines of stdout and\n"
            "of stderr, and exits with its code (128 + signal when killed). SIGINT/SIGTERM to the launcher\n"
            "stop every rank the same way (exit 130/143; a second one kills at once); --timeout ends the\n"
            "job with exit 124. Ranks also die if the launcher is killed.\n"
            "shared GPUs: with --ranks-per-gpu N > 1 the ranks run under CUDA MPS: the launcher starts\n"
            "nvidia-cuda-mps-control -d with CUDA_MPS_PIPE_DIRECTORY/CUDA_MPS_LOG_DIRECTORY in a private\n"
            "(0700) temporary dir (unless CUDA_MPS_PIPE_DIRECTORY names a running daemon), sets\n"
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100//N and XLA_PYTHON_CLIENT_MEM_FRACTION=0.8/N per rank\n"
            "unless set, and quits the daemon and removes the dir at the end.\n"
            "examples:\n"
            "  python -m pk_jax.launch train.py --steps 10             # one rank per GPU\n"
            "  python -m pk_jax.launch --share-gpu -n 2 -m my.test     # 2 ranks on GPU 0 (MPS)\n"
            "  python -m pk_jax.launch --cpu -n 2 --cpu-devices 2 t.py # CPU job, gloo collectives"))
    p.add_argument("-n", "--nproc", type=int, default=None,
                   help="number of ranks (default: local GPUs x ranks-per-gpu; required without GPUs)")
    p.add_argument("--ranks-per-gpu", type=int, default=1, metavar="N",
                   help="ranks sharing one GPU under CUDA MPS (default 1)")
    p.add_argument("--share-gpu", action="store_const", const=2, dest="ranks_per_gpu",
                   help="same as --ranks-per-gpu 2")
    p.add_argument("--cpu", action="store_true",
                   help="CPU-only job (tests, CI): JAX_PLATFORMS=cpu, gloo CPU collectives")
    p.add_argument("--cpu-devices", type=int, default=1, metavar="K",
                   help="with --cpu: CPU devices per process (JAX_NUM_CPU_DEVICES; default 1)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop the job after S seconds, exit 124")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 10)")
    p.add_argument("-m", dest="module", metavar="module", help="run a module as a script, like python -m")
    p.add_argument("script", nargs="?", help="the Python script each rank runs, followed by its arguments")
    return p


_TAKES_VALUE = {"-n", "--nproc", "--ranks-per-gpu", "--cpu-devices", "--timeout", "--grace"}


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits the command line into the launcher's options and the rank command: everything from the
    script (or from -m MODULE) on belongs to the ranks, even options."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-m" or (a.startswith("-m") and not a.startswith("--")):
            return list(argv[:i]), list(argv[i:])
        if a == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if not a.startswith("-") or a == "-":
            return list(argv[:i]), list(argv[i:])
        i += 2 if a in _TAKES_VALUE else 1
    return list(argv), []


def rank_command(target: list[str]) -> list[str]:
    """`python -u` with the script (or -m module) and its arguments."""
    if target[0] == "-m":
        return [sys.executable, "-u", "-m", *target[1:]]
    if target[0].startswith("-m"):  # -mmodule
        return [sys.executable, "-u", "-m", target[0][2:], *target[1:]]
    return [sys.executable, "-u", *target]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    own, target = split_argv(argv)
    opts = parser.parse_args(own)  # exits on --help or a bad option
    if not target or target == ["-m"]:
        parser.error("name the script each rank runs (script.py [args]) or a module (-m module [args])")
    daemon = None
    try:
        try:
            plan = plan_job(opts.nproc, () if opts.cpu else local_gpus(), opts.ranks_per_gpu, opts.cpu,
                            opts.cpu_devices, f"127.0.0.1:{free_port()}")
            if plan.ranks_per_gpu > 1:
                mps_dirs = running_daemon(os.environ)
                if mps_dirs is None:
                    daemon = MpsDaemon(os.environ)
                    daemon.start()
                    mps_dirs = daemon.dirs
                plan = dataclasses.replace(plan, mps_dirs=mps_dirs)
        except LaunchError as e:
            print(f"pk_jax.launch: {e}", file=sys.stderr)
            return 2
        where = (f"CPU, {plan.cpu_devices} device(s) each" if plan.cpu else
                 f"GPUs {','.join(plan.gpus)}, {plan.ranks_per_gpu} rank(s) per GPU" if plan.gpus else "no GPU")
        mps = f", MPS {plan.mps_dirs[0]}" if plan.mps_dirs else ""
        print(f"pk_jax.launch: {plan.ranks} ranks ({where}{mps}), coordinator {plan.coordinator}", file=sys.stderr,
              flush=True)
        cmd = rank_command(target)
        specs = [RankSpec(cmd, rank_env(plan, r, os.environ)) for r in range(plan.ranks)]
        return Supervisor(specs, grace_s=opts.grace, timeout_s=opts.timeout).run()
    finally:
        if daemon is not None:
            daemon.stop()
