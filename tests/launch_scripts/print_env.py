"""A rank of tests/test_launch_cpu.py (no jax): prints the launcher's per-rank variables as `ENV k=v`."""

import os

NAMES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "PK_JAX_LOCAL_RANK", "PK_JAX_LOCAL_WORLD",
         "CUDA_VISIBLE_DEVICES", "PK_JAX_RANKS_PER_GPU", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
         "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "PYTHONUNBUFFERED")
for name in NAMES:
    print(f"ENV {name}={os.environ.get(name, '<unset>')}")
# The MPS pipe dir must exist while the ranks run (the daemon lives there).
print(f"ENV pipe_dir_exists={os.path.isdir(os.environ.get('CUDA_MPS_PIPE_DIRECTORY', '/nonexistent'))}")
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
if pipe:
    print(f"ENV mps_root_mode={oct(os.stat(os.path.dirname(pipe)).st_mode & 0o777)}")
