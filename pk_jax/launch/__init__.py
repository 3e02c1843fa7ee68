"""`python -m pk_jax.launch`: starts a multi-process pk_jax job on this host.

    python -m pk_jax.launch [-n N] script.py [args ...]          # one rank per local GPU
    python -m pk_jax.launch [-n N] -m package.module [args ...]
    python -m pk_jax.launch --ranks-per-gpu 2 -n 2 script.py     # 2 ranks share GPU 0 under CUDA MPS (tests)
    python -m pk_jax.launch --cpu -n 2 --cpu-devices 2 script.py # CPU-only job (CI): gloo collectives

Each rank is a fresh Python process with, in its environment: JAX_COORDINATOR_ADDRESS (127.0.0.1 and a
free port), JAX_NUM_PROCESSES, JAX_PROCESS_ID, PK_JAX_LOCAL_RANK, PK_JAX_LOCAL_WORLD, PYTHONUNBUFFERED=1
and, on GPUs, CUDA_VISIBLE_DEVICES (one GPU; rank i gets GPU i // ranks_per_gpu) and PK_JAX_RANKS_PER_GPU.
jax 0.11's `jax.distributed.initialize()` reads only the coordinator address from the environment, so a
rank calls

    pk_jax.launch.initialize_from_env()   # jax.distributed.initialize(...) with the launcher's values
    pk_jax.initialize()

With --ranks-per-gpu N > 1 the launcher starts an MPS daemon in a private directory of this job (unless
CUDA_MPS_PIPE_DIRECTORY already names a running one), gives each rank CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
= 100 // N and XLA_PYTHON_CLIENT_MEM_FRACTION = 0.8 / N (unless set), and stops the daemon at the end.
With --cpu: JAX_PLATFORMS=cpu, JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo, JAX_NUM_CPU_DEVICES=K.

Output lines are forwarded prefixed `[rank i] `. The first rank to fail (non-zero exit or a signal) ends
the job: the others get SIGTERM (their whole process group), SIGKILL after a grace period, and the
launcher prints the failed rank's exit status and last lines (of stdout and of stderr) and exits with its
code (128 + signal for a signal). SIGINT/SIGTERM to the launcher stop every rank the same way (exit
130/143); --timeout S ends the job after S seconds (exit 124).
"""

from pk_jax.launch.initialize import initialize_from_env
from pk_jax.launch.cli import main

__all__ = ["initialize_from_env", "main"]
