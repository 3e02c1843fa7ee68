"""The rank side of pk_jax.launch: jax.distributed.initialize() with the values the launcher set."""

from __future__ import annotations

import os
from typing import Any

import jax
from jax._src import distributed as _jax_distributed

# The launcher's environment (pk_jax/launch/rank_env.py writes it). jax 0.11 itself reads only the first.
COORDINATOR, NUM_PROCESSES, PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def initialize_from_env(**kwargs: Any) -> None:
    """Calls `jax.distributed.initialize(coordinator, num_processes, process_id, **kwargs)` with
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID as `python -m pk_jax.launch` set them.

    Call it first thing in a rank (before any jax computation). Does nothing if jax.distributed is
    already initialized. `kwargs` go to jax.distributed.initialize (e.g. initialization_timeout=60).
    Raises RuntimeError naming the missing variables when the process was not started by the launcher.
    """
    if _jax_distributed.global_state.client is not None:
        return
    missing = [v for v in (COORDINATOR, NUM_PROCESSES, PROCESS_ID) if not os.environ.get(v)]
    if missing:
        raise RuntimeError(f"pk_jax.launch.initialize_from_env: {', '.join(missing)} not set; start this script "
                           f"with `python -m pk_jax.launch -n N script.py` (or set them yourself)")
    jax.distributed.initialize(os.environ[COORDINATOR], num_processes=int(os.environ[NUM_PROCESSES]),
                               process_id=int(os.environ[PROCESS_ID]), **kwargs)
