"""pk_jax in jax.distributed jobs (one process per GPU, or several ranks sharing a GPU under MPS).

    jax.distributed.initialize()      # or python -m pk_jax.launch, which sets everything up
    info = pk_jax.initialize()        # once, in every process; a no-op in a single process

`initialize` finds the processes on this host (the NVLink domain), and through the jax.distributed
key-value store (no extra ports, no MPI) exchanges what each GPU shares: its control block and the
memory region of XLA's allocator (legacy CUDA IPC handles, 64 bytes each), plus a staging heap. When
XLA's memory is virtual-memory memory that legacy IPC refuses (XLA's cuMemCreate allocator, created
with POSIX-fd handles), it is shared by POSIX fd instead: a descriptor through the store and one fd per
chunk over Unix sockets in a private per-job directory (ffi/fd_passing.h; peers' uid and pid checked).
Every process maps its peers' regions once; kernels then translate each published buffer address by
the region it lies in (kernels/pk/group.cuh AddressMap), so ops read and write the peers' XLA buffers
directly, with no per-call host exchange, exactly as in one process. A buffer outside the shared regions
(XLA's allocator grew after start-up, e.g. with XLA_PYTHON_CLIENT_PREALLOCATE=false) goes through the
staging heap with one copy each way; `pk_jax.runtime.stats()` counts those.

Mesh axes whose groups lie inside one host run our kernels; an axis that crosses hosts lowers to
jax.lax (XLA/NCCL), said once per op and axis. When ranks share a GPU, jax.lax collectives cannot run
across them (NCCL refuses duplicate GPUs), so such a fallback raises instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np

from pk_jax import _ext, _fd_exchange, _kv

_PREFIX = "pk_jax/init/"
MAX_DOMAIN = 8  # GPUs (ranks) per host: kernels/pk/control_block.h kMaxSlots
_lock = threading.Lock()
_info: DistributedInfo | None = None
# The probe buffers whose allocations were exported as XLA's shared region. Kept alive for the job:
# with a per-buffer allocator (XLA_PYTHON_CLIENT_ALLOCATOR=platform) freeing a probe frees the region
# the peers mapped, and a later buffer at that address would be taken for shared memory.
_probes: list = []


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """What pk_jax.initialize() set up.

    ranks: processes in the job; rank: this process's index.
    local_ranks: the processes on this host (the NVLink domain pk_jax kernels span), ascending.
    ranks_per_gpu: processes sharing one GPU (1 normally; > 1 in the MPS test mode).
    domain_device_ids: the device ids of this host's GPUs (one per local rank and GPU).
    host_of: host index of every process (processes on one host share an index).
    startup_s: seconds spent in initialize.
    staging: True when XLA's memory could not be shared, so every buffer copies through the staging heap.
    kernels: False in processes without GPUs or without the extension (every op runs jax.lax there).
    sharing: how XLA's memory is shared with this host's other processes: "cuda_ipc" (legacy CUDA IPC),
        "posix_fd" (virtual-memory chunks by POSIX fd), "" when it is not (staging) or in one process.
    """

    ranks: int
    rank: int
    local_ranks: tuple[int, ...]
    ranks_per_gpu: int
    domain_device_ids: tuple[int, ...]
    host_of: tuple[int, ...]
    startup_s: float
    staging: bool = False
    kernels: bool = True
    sharing: str = ""


def _host_key() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return os.environ.get("PK_JAX_HOST_KEY") or f"{socket.gethostname()}|{boot}"  # override: tests


def _timeout_s() -> float:
    return float(os.environ.get("PK_JAX_INIT_TIMEOUT_S", "120"))


def _staging_bytes() -> int:
    # 1 GiB: every buffer peers touch in one op must fit (2 ranks, 8B-width MLP block at T = 4096 needed
    # more than 64 MiB on an H200 where XLA's memory could not be shared).
    return max(int(os.environ.get("PK_JAX_STAGING_MB", "1024")), 1) << 20


def _fd_sharing() -> bool:
    # PK_JAX_FD_SHARING=0: never share XLA's memory by POSIX fd (legacy IPC or staging only).
    return os.environ.get("PK_JAX_FD_SHARING", "1") != "0"


def info() -> DistributedInfo | None:
    """The result of pk_jax.initialize() in this process (None before it ran)."""
    return _info


def initialize() -> DistributedInfo:
    """Sets pk_jax up in a jax.distributed job. Call once in every process, after
    jax.distributed.initialize() (collective: every process must call it). Idempotent. In a rank started
    by `python -m pk_jax.launch` it calls jax.distributed.initialize() itself if that has not run yet.

    In a single-process program it returns at once (ranks = 1); the runtime there initializes itself
    at the first op. In processes without GPUs (or without the extension) it only works out the
    layout: every op runs its jax.lax fallback there. Raises RuntimeError naming the cause when the
    GPUs of this host cannot map each other's memory, and TimeoutError when some process never calls
    initialize.
    """
    global _info
    with _lock:
        if _info is None and not _kv.available() and os.environ.get("JAX_NUM_PROCESSES"):
            from pk_jax.launch.initialize import initialize_from_env

            initialize_from_env()  # started by python -m pk_jax.launch: jax.distributed from its env
        if _info is None:
            _info = _initialize(_Native() if _ext.ext is not None else None,
                                [d for d in jax.local_devices() if d.platform == "gpu"])
        return _info


@dataclasses.dataclass(frozen=True)
class DomainPlan:
    """Who shares memory with whom: the processes of this host and a slot per GPU among them."""

    host_of: tuple[int, ...]       # host index of every process
    local_ranks: tuple[int, ...]   # processes on this process's host, ascending
    slot_of: dict[int, int]        # device id -> slot (index into the control blocks' per-peer arrays)
    process_of: dict[int, int]     # device id -> process index (this host's devices only)
    ranks_per_gpu: int


def plan_domain(procs: Sequence[dict], rank: int) -> DomainPlan:
    """`procs[p]` = {"host": key, "devices": [{"id", "pci"}, ...]} as each process published it."""
    hosts = sorted({p["host"] for p in procs})
    host_of = tuple(hosts.index(p["host"]) for p in procs)
    local_ranks = tuple(p for p in range(len(procs)) if host_of[p] == host_of[rank])
    slot_of: dict[int, int] = {}
    process_of: dict[int, int] = {}
    for p in local_ranks:
        for d in procs[p]["devices"]:
            slot_of[d["id"]] = len(slot_of)
            process_of[d["id"]] = p
    if len(slot_of) > MAX_DOMAIN:
        raise RuntimeError(f"pk_jax.initialize: {len(slot_of)} GPUs (ranks) on one host; at most {MAX_DOMAIN} "
                           f"are supported")
    pci = [d["pci"] for p in local_ranks for d in procs[p]["devices"]]
    return DomainPlan(host_of, local_ranks, slot_of, process_of, max((pci.count(x) for x in pci), default=1))


class _Native:
    """The extension's multi-process start-up calls (ffi/runtime.h); tests substitute a fake."""

    def pci_bus_id(self, ordinal: int) -> str:
        return _ext.ext.pci_bus_id(ordinal)

    def add_local_device(self, ordinal, device_id, slot, process, probe_ptr, staging_bytes, region_limit,
                         share_by_fd):
        """(ctrl handle, region begins, sizes, handles, fds per region (ours to send and close), why XLA's
        region is not shared, how it is shared)."""
        return _ext.ext.mp_add_local_device(ordinal, device_id, slot, process, probe_ptr, staging_bytes,
                                            region_limit, share_by_fd)

    def attach_member(self, device_id, slot, process, ctrl, regions, region_fds):
        """Maps a peer device's control block and regions; closes every fd of `region_fds`."""
        return _ext.ext.mp_attach_member(device_id, slot, process, ctrl, regions, region_fds)

    def region_limit(self, device) -> int:
        """Bytes XLA's allocator holds on `device` (its pool): the most of contiguous virtual-memory
        chunks around the probe that POSIX-fd sharing takes as XLA's region; 0 (the probe's chunk only)
        when the allocator does not say."""
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001 - not every backend reports
            return 0
        return int(stats.get("pool_bytes", 0) or 0)

    def fd_create_job_dir(self) -> str:
        return _ext.ext.fd_create_job_dir()

    def fd_endpoint(self, job_dir: str, index: int, pids: Sequence[int]):
        return _ext.ext.FdEndpoint(job_dir, index, list(pids))

    def set_region_delta(self, device_id, region, slot, address):
        _ext.ext.mp_set_region_delta(device_id, region, slot, address)

    def finish(self):
        _ext.ext.mp_finish()

    def probe_pointer(self, device) -> tuple[object, int]:
        probe = jax.device_put(np.zeros(256, np.uint8), device)  # any live XLA buffer of the device
        return probe, probe.unsafe_buffer_pointer()


def _initialize(native, gpus: Sequence) -> DistributedInfo:
    t0 = time.perf_counter()
    if jax.process_count() == 1:
        ids = tuple(d.id for d in jax.devices())
        return DistributedInfo(1, 0, (0,), 1, ids, (0,), time.perf_counter() - t0)
    rank, ranks, timeout = jax.process_index(), jax.process_count(), _timeout_s()
    kernels = native is not None and bool(gpus)
    me = {"host": _host_key(), "kernels": kernels,
          "devices": [{"id": d.id, "pci": native.pci_bus_id(d.local_hardware_id)} for d in gpus] if kernels else []}
    _kv.put(f"{_PREFIX}proc/{rank}", json.dumps(me))
    procs = [json.loads(_kv.get(f"{_PREFIX}proc/{p}", timeout)) for p in range(ranks)]
    plan = plan_domain(procs, rank)
    if not kernels:  # CPU processes: the layout only; every op runs jax.lax
        return DistributedInfo(ranks, rank, plan.local_ranks, plan.ranks_per_gpu, tuple(plan.slot_of),
                               plan.host_of, time.perf_counter() - t0, kernels=False)
    if not all(procs[p]["kernels"] for p in plan.local_ranks):
        raise RuntimeError("pk_jax.initialize: some processes on this host have no GPU or no pk_jax extension; "
                           "every process of a host must run pk_jax's kernels, or none")

    # Our exports: control block, XLA's region (found from a live buffer), the staging heap.
    shared, sharing = True, ""
    my_fds: dict[int, list[list[int]]] = {}  # device id -> fds per region (POSIX-fd sharing), ours to close
    try:
        for d in gpus:
            probe, ptr = native.probe_pointer(d)
            ctrl, _begins, sizes, handles, fds, why_not, how = native.add_local_device(
                d.local_hardware_id, d.id, plan.slot_of[d.id], rank, ptr, _staging_bytes(), native.region_limit(d),
                _fd_sharing())
            _probes.append(probe)  # the exported region must outlive the job (see _probes)
            my_fds[d.id] = [list(f) for f in fds]
            if why_not:
                shared = False
                print(f"pk_jax: rank {rank}: XLA's GPU memory cannot be shared ({why_not}); every buffer the peers "
                      f"touch goes through the staging heap (PK_JAX_STAGING_MB)", flush=True)
            else:
                sharing = how
                print(f"pk_jax: rank {rank}: {_sharing_message(how, len(fds[0]) if fds else 0, sizes[0])}",
                      flush=True)
            _kv.put(f"{_PREFIX}dev/{d.id}", json.dumps({"ctrl": bytes(ctrl).hex(),
                                                         "regions": [bytes(h).hex() for h in handles],
                                                         "chunks": [len(f) for f in fds]}))

        # Every other device of this host: its exports; the fds of regions shared by POSIX fd come over
        # the job's sockets (needed or not, every process of the host decides the same from the same data).
        peers = {dev_id: json.loads(_kv.get(f"{_PREFIX}dev/{dev_id}", timeout))
                 for dev_id in plan.slot_of if plan.process_of[dev_id] != rank}
        received: dict[tuple[int, int, int], int] = {}
        if peers and (any(any(e.get("chunks", ())) for e in peers.values()) or any(any(f) for f in my_fds.values())):
            received = _fd_exchange.exchange_fds(native, plan, rank, my_fds, peers, timeout, _PREFIX)
    finally:
        _fd_exchange.close_fds(fd for fds in my_fds.values() for f in fds for fd in f)

    # Map every other process's exports on this host; tell each owner where its regions landed here.
    try:
        for dev_id, exp in peers.items():
            p, slot = plan.process_of[dev_id], plan.slot_of[dev_id]
            chunks = exp.get("chunks", [0] * len(exp["regions"]))
            region_fds = [[received.pop((dev_id, region, c)) for c in range(n)] for region, n in enumerate(chunks)]
            mapped = native.attach_member(dev_id, slot, p, bytes.fromhex(exp["ctrl"]),
                                          [bytes.fromhex(h) for h in exp["regions"]], region_fds)
            _kv.put(f"{_PREFIX}map/{dev_id}/{rank}", json.dumps([int(a) for a in mapped]))
    finally:
        _fd_exchange.close_fds(received.values())
    for d in gpus:
        for p in plan.local_ranks:
            if p == rank:
                continue
            addrs = json.loads(_kv.get(f"{_PREFIX}map/{d.id}/{p}", timeout))
            for peer in procs[p]["devices"]:  # one address space per process: all its GPUs see the same
                for region, addr in enumerate(addrs):
                    native.set_region_delta(d.id, region, plan.slot_of[peer["id"]], addr)
    _barrier(f"{_PREFIX}ready", rank, plan.local_ranks, timeout)  # no op before every peer mapped ours
    _fd_exchange.remove_job_dir()
    native.finish()
    return DistributedInfo(ranks, rank, plan.local_ranks, plan.ranks_per_gpu, tuple(plan.slot_of), plan.host_of,
                           time.perf_counter() - t0, staging=not shared, sharing=sharing if shared else "")


def _sharing_message(how: str, chunks: int, size: int) -> str:
    if how == "posix_fd":
        return f"XLA's memory shared by POSIX fd ({chunks} chunk{'s' if chunks != 1 else ''}, {size / 2**20:.0f} MiB)"
    return f"XLA's memory shared by CUDA IPC ({size / 2**20:.0f} MiB)"


def _barrier(name: str, rank: int, ranks: Sequence[int], timeout: float) -> None:
    """Every process of `ranks` has reached this point."""
    _kv.put(f"{name}/{rank}", "1")
    for p in ranks:
        _kv.get(f"{name}/{p}", timeout)


def is_multiprocess() -> bool:
    return _info is not None and _info.ranks > 1 and _info.kernels


def shares_gpu() -> bool:
    """Ranks share a GPU (MPS test mode): jax.lax collectives cannot run across them."""
    return _info is not None and _info.ranks_per_gpu > 1


def groups_within_hosts(table, process_of: dict[int, int] | None = None) -> bool:
    """Whether every group of `table` (pk_jax.sharding.GroupTable) lies inside one host's domain, so
    every process lowers the op to our kernel (the decision is the same on all of them).
    `process_of`: device id -> process index (default: from jax.devices())."""
    assert _info is not None, "pk_jax.initialize() has not run"
    proc = process_of or {d.id: d.process_index for d in jax.devices()}
    for dev in table.mesh_ids:
        ids, _ = table.members(dev)
        if len({_info.host_of[proc[i]] for i in ids}) > 1:
            return False
    return True
