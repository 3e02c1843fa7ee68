"""Start-up of multi-process jobs, part 2: the POSIX fds of XLA's virtual-memory chunks travel to the other
processes of the host (pk_jax/distributed.py shares XLA's memory this way when legacy CUDA IPC refuses it).

Over Unix sockets in a private per-job directory (ffi/fd_passing.h: 0700, peers' uid and pid checked);
the directory's path and the pids go through the jax.distributed key-value store.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING

from pk_jax import _kv

if TYPE_CHECKING:
    from pk_jax.distributed import DomainPlan

_FD_MAGIC = "pk_jax-fd/1"
_job_dir: str | None = None  # the per-job socket directory this process created (removed after start-up)


def fd_payload(device_id: int, region: int, chunk: int) -> bytes:
    """What travels with each fd: which device's region and chunk it is."""
    return f"{_FD_MAGIC} {device_id} {region} {chunk}".encode()


def parse_fd_payload(payload: bytes) -> tuple[int, int, int]:
    """(device id, region, chunk) of an fd message; ValueError when it is not one."""
    parts = payload.decode("ascii", "replace").split(" ")
    if len(parts) != 4 or parts[0] != _FD_MAGIC or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"pk_jax.initialize: unexpected fd message {payload[:60]!r}")
    return int(parts[1]), int(parts[2]), int(parts[3])


def close_fds(fds) -> None:
    for fd in list(fds):
        try:
            os.close(fd)
        except OSError:
            pass


def exchange_fds(native, plan: DomainPlan, rank: int, my_fds: dict[int, list[list[int]]], peers: dict[int, dict],
                 timeout: float, prefix: str) -> dict[tuple[int, int, int], int]:
    """Sends every fd of our regions to each other process of this host and receives theirs:
    {(device id, region, chunk): fd} (ours to close). The host's lowest rank creates the job directory
    (0700) and publishes it; each process listens on it at its index among the host's ranks, accepting
    only the job's pids. A thread receives while this one sends, so no order of sends can deadlock."""
    global _job_dir
    local = plan.local_ranks
    host = plan.host_of[rank]
    if rank == local[0]:
        _job_dir = native.fd_create_job_dir()
        atexit.register(remove_job_dir)  # also when start-up fails past this point
        _kv.put(f"{prefix}fd/{host}/dir", _job_dir)
    _kv.put(f"{prefix}fd/pid/{rank}", str(os.getpid()))
    job_dir = _kv.get(f"{prefix}fd/{host}/dir", timeout)
    pids = [int(_kv.get(f"{prefix}fd/pid/{p}", timeout)) for p in local]
    endpoint = native.fd_endpoint(job_dir, local.index(rank), pids)
    timeout_ms = int(timeout * 1000)
    expected = {(dev_id, region, c): local.index(plan.process_of[dev_id])
                for dev_id, exp in peers.items() for region, n in enumerate(exp.get("chunks", ())) for c in range(n)}
    received: dict[tuple[int, int, int], int] = {}
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            while len(received) < len(expected):
                sender, fd, payload = endpoint.receive(timeout_ms)
                try:
                    key = parse_fd_payload(payload)
                    if key not in expected or key in received:
                        raise ValueError(f"pk_jax.initialize: unexpected or repeated fd for {key}")
                    if expected[key] != sender or fd < 0:
                        raise ValueError(f"pk_jax.initialize: the fd for {key} came from host index {sender}, "
                                         f"not from its owner's {expected[key]} (or without an fd)")
                except Exception:
                    close_fds([fd] if fd >= 0 else [])
                    raise
                received[key] = fd
        except BaseException as e:  # noqa: BLE001 - reported by the sending thread
            errors.append(e)

    receiver = threading.Thread(target=receive, name="pk_jax-fd-receive", daemon=True)
    receiver.start()
    try:
        for dev_id, regions in my_fds.items():
            for p in local:
                if p == rank:
                    continue
                for region, fds in enumerate(regions):
                    for c, fd in enumerate(fds):
                        endpoint.send(local.index(p), fd, fd_payload(dev_id, region, c), timeout_ms)
        receiver.join(timeout + 5)
        if receiver.is_alive():
            raise TimeoutError(f"pk_jax.initialize: rank {rank}: the peers' fds did not all arrive within "
                               f"{timeout:.0f} s")
        if errors:
            raise RuntimeError(f"pk_jax.initialize: rank {rank}: receiving the peers' memory fds failed: "
                               f"{errors[0]}") from errors[0]
    except BaseException:
        receiver.join(1)
        close_fds(received.values())
        raise
    return received  # our endpoint (and socket) goes with this frame; a receiver still running keeps it


def remove_job_dir() -> None:
    """After start-up (every endpoint is closed by then): the job directory this process created."""
    global _job_dir
    if _job_dir is not None:
        try:
            for name in os.listdir(_job_dir):  # sockets of peers that failed before closing theirs
                os.unlink(os.path.join(_job_dir, name))
            os.rmdir(_job_dir)
        except OSError:
            pass
        _job_dir = None
