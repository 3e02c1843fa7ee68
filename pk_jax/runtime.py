"""The symmetric-memory runtime: set-up, error state and transport policy.

The runtime initializes itself the first time an op is lowered for GPUs; nothing here is needed for
ordinary use. It allocates a small symmetric control region per GPU (signals, pointer mailboxes,
epochs), enables peer access, and loads every kernel before any cross-GPU wait can be in flight.
Data never passes through a staging heap: kernels move it directly between XLA's own buffers on
the group's GPUs, so there is no heap size to choose and no input is too large.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax

from pk_jax import _ext, distributed

_lock = threading.Lock()
_init_error: str | None = None


def gpu_devices() -> list[jax.Device]:
    """Local CUDA devices of this process (empty without GPUs)."""
    try:
        return [d for d in jax.local_devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def ensure_initialized() -> str | None:
    """Initializes the runtime for all local GPUs once (in a jax.distributed job: pk_jax.initialize(),
    which every process reaches at the same lowering). Returns None on success, else why the GPU
    path is unavailable (the caller then lowers to jax.lax)."""
    global _init_error
    if _ext.ext is None:
        return "the CUDA extension is not installed"
    if jax.process_count() > 1:
        if not _ext.ext.is_initialized():
            try:
                distributed.initialize()
            except (RuntimeError, TimeoutError) as e:
                return str(e)
        return None
    with _lock:
        if _ext.ext.is_initialized():
            return None
        if _init_error is not None:
            return _init_error
        devices = gpu_devices()
        if len(devices) < 2:
            _init_error = "fewer than 2 local GPUs"
            return _init_error
        try:
            _ext.ext.initialize([d.local_hardware_id for d in devices], [d.id for d in devices])
        except RuntimeError as e:
            _init_error = str(e)
            return _init_error
    return None


def is_initialized() -> bool:
    return _ext.ext is not None and _ext.ext.is_initialized()


def check() -> None:
    """Raises RuntimeError if a GPU recorded a failure (e.g. a peer that never arrived)."""
    if _ext.ext is not None:
        msg = _ext.ext.first_error()
        if msg:
            raise RuntimeError(msg)


def reset() -> None:
    """Clears recorded errors and all signal state. Only when no pk_jax op is in flight."""
    if is_initialized():
        _ext.ext.reset()


def set_timeout_ms(ms: int) -> None:
    """How long a GPU waits for a peer before reporting an error (default 5000, or
    PK_JAX_TIMEOUT_MS). Applies to ops launched (or graph-captured) afterwards."""
    if ms <= 0:
        raise ValueError(f"set_timeout_ms: ms must be positive, got {ms}")
    if _ext.ext is None:
        raise RuntimeError("set_timeout_ms: the CUDA extension is not installed")
    _ext.ext.set_timeout_ms(int(ms))


def multicast_policy() -> tuple[bool, str]:
    """(allowed, reason). Multicast is never used unless PK_JAX_ENABLE_MULTICAST=1 and none of
    NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set; all
    current kernels are peer-to-peer."""
    if _ext.ext is None:
        return False, "the CUDA extension is not installed"
    return _ext.ext.multicast_policy()


def stats() -> dict[str, int]:
    """Counters of the runtime: `staged_buffers`, buffers that went through the staging heap (multi-process
    jobs; 0 when every buffer lay in the memory shared at start-up)."""
    return {"staged_buffers": int(_ext.ext.staged_buffers()) if _ext.ext is not None else 0}


def multicast_plan(group_size: int, nbytes: int, supported: Sequence[bool], *, num_hosts: int = 1,
                   region_bytes: int | None = None) -> tuple[str, str]:
    """("multimem" | "peer_to_peer", reason): the transport a collective over `group_size` GPUs moving
    `nbytes` per GPU would take. `supported[r]`: whether member r's GPU reports multicast support
    (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED); `num_hosts`: hosts the group spans; `region_bytes`: bytes
    per GPU of the group's multicast region (None: not limiting). The policy's refusal (see
    multicast_policy) always wins. The multimem path is built and unit-tested but unmeasured on hardware."""
    supported = [bool(s) for s in supported]
    if len(supported) != group_size:
        raise ValueError(f"multicast_plan: supported lists {len(supported)} GPUs for group_size={group_size}; "
                         "pass one flag per member")
    if nbytes < 0:
        raise ValueError(f"multicast_plan: nbytes must be >= 0, got {nbytes}")
    if _ext.ext is None:
        return "peer_to_peer", "multicast refused: the CUDA extension is not installed"
    return _ext.ext.multicast_plan(int(group_size), int(nbytes), supported, int(num_hosts),
                                   -1 if region_bytes is None else int(region_bytes), *_ext.ext.multicast_policy())


def lowering_group(ctx, axis_name) -> tuple[object | None, str | None]:
    """(group table, None) when a GPU kernel can serve this lowering over `axis_name`, else
    (None, why not). Initializes the runtime on first use."""
    from pk_jax.sharding import group_table

    if (reason := ensure_initialized()) is not None:
        return None, reason
    table = group_table(ctx.module_context.axis_context, axis_name)
    if table is None:
        return None, "no concrete mesh is known (pass a jax.sharding.Mesh to shard_map or use jax.set_mesh)"
    if not table.all_local:
        if not distributed.is_multiprocess():
            return None, "the mesh spans several processes: call pk_jax.initialize() after jax.distributed.initialize()"
        if not distributed.groups_within_hosts(table):
            return None, f"mesh axis {axis_name!r} crosses hosts (XLA/NCCL carries it; pk_jax kernels span one host)"
    return table, None


def lax_fallback_allowed(op: str, reason: str) -> None:
    """Raises when a jax.lax fallback cannot run: ranks that share one GPU (the MPS test mode), where
    NCCL refuses the duplicate GPU."""
    if distributed.shares_gpu():
        raise RuntimeError(f"pk_jax {op}: cannot fall back to jax.lax ({reason}): this job runs several ranks on one "
                           f"GPU, where XLA's collectives fail (NCCL: duplicate GPU). Run it with one process per GPU, "
                           f"or change the call so the pk_jax kernel can serve it.")
