"""One process of tests/test_distributed_cpu.py: runs pk_jax.initialize()'s exchange over the real
jax.distributed key-value store (CPU, gloo), with a fake native runtime that stands in for the GPU
calls, and writes what the runtime was told to a JSON file.
FAKE_VMM_CHUNKS=N: XLA's region is "shared by POSIX fd" in N chunks, each a real fd of a small file
naming its device and chunk; the fds cross between the processes over the real extension's Unix
sockets (the fd passing is real, only the GPU memory is fake).
Usage: init_exchange.py RANK NPROC PORT OUT_DIR"""

import json
import os
import sys
import types
import weakref

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
rank, nproc, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=rank, initialization_timeout=60)

from pk_jax import distributed  # noqa: E402

GPUS_PER_PROCESS = int(os.environ.get("FAKE_GPUS_PER_PROCESS", "1"))
VMM_CHUNKS = int(os.environ.get("FAKE_VMM_CHUNKS", "0"))


def mapped_address(process: int, owner: int, region: int) -> int:
    """Where `process` maps region `region` of device `owner` (the fake driver's rule; the test knows it)."""
    return (process + 1) << 40 | owner << 20 | region << 12


class FakeBuffer:
    """A stand-in for a jax.Array (weak-referenceable, so the test sees whether it was freed)."""


class FakeNative:
    def __init__(self):
        self.calls = {"add": [], "attach": [], "delta": [], "finish": []}
        self.probes = []

    def pci_bus_id(self, ordinal):
        return os.environ["FAKE_PCI"] + f":{ordinal}"

    def probe_pointer(self, device):
        probe = FakeBuffer()  # stands in for the live XLA buffer
        self.probes.append(weakref.ref(probe))
        return probe, 0xDEAD0000 + device.id

    def region_limit(self, device):
        return 0

    def add_local_device(self, ordinal, device_id, slot, process, probe_ptr, staging_bytes, region_limit,
                         share_by_fd):
        self.calls["add"].append([ordinal, device_id, slot, process, probe_ptr])
        handles = [f"xla{device_id}".encode(), f"stage{device_id}".encode()]
        fds = [[], []]
        if VMM_CHUNKS and share_by_fd:
            handles[0] = f"vmm{device_id}".encode()
            for c in range(VMM_CHUNKS):
                path = os.path.join(out_dir, f"chunk-{device_id}-{c}")
                with open(path, "w") as f:
                    f.write(f"dev{device_id}/chunk{c}")
                fds[0].append(os.open(path, os.O_RDONLY))
        how = "posix_fd" if fds[0] else "cuda_ipc"
        return f"ctrl{device_id}".encode(), [1, 2], [3 << 20, 4], handles, fds, "", how

    def attach_member(self, device_id, slot, process, ctrl, regions, region_fds):
        # What each received fd is (the file its owner opened), then closed as the runtime does.
        contents = [[os.pread(fd, 64, 0).decode() for fd in fds] for fds in region_fds]
        for fds in region_fds:
            for fd in fds:
                os.close(fd)
        self.calls["attach"].append([device_id, slot, process, ctrl.decode(), [r.decode() for r in regions], contents])
        return [mapped_address(rank, device_id, i) for i in range(len(regions))]

    def fd_create_job_dir(self):
        from pk_jax import _ext

        self.calls["job_dir"] = _ext.ext.fd_create_job_dir()
        return self.calls["job_dir"]

    def fd_endpoint(self, job_dir, index, pids):
        from pk_jax import _ext

        self.calls["endpoint"] = [index, len(pids), pids[index] == os.getpid()]
        return _ext.ext.FdEndpoint(job_dir, index, list(pids))

    def set_region_delta(self, device_id, region, slot, address):
        self.calls["delta"].append([device_id, region, slot, address])

    def finish(self):
        self.calls["finish"].append(rank)


cpu_only = os.environ.get("FAKE_NATIVE") == "none"  # a CPU process: no GPU, no extension
native = None if cpu_only else FakeNative()
gpus = [] if cpu_only else [types.SimpleNamespace(id=100 + GPUS_PER_PROCESS * rank + i, local_hardware_id=i) for i in range(GPUS_PER_PROCESS)]
info = distributed._initialize(native, gpus)
if native:  # every exported probe buffer is still alive after start-up (its region stays allocated)
    native.calls["probes_alive"] = [ref() is not None for ref in native.probes]
    # No fd of any chunk file (ours or a peer's) is still open here, and the job directory is gone.
    open_files = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            open_files.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    native.calls["open_chunk_fds"] = sorted(os.path.basename(p) for p in open_files if "/chunk-" in p)
    if "job_dir" in native.calls:
        native.calls["job_dir_exists"] = os.path.exists(native.calls["job_dir"])
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"info": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(info).items()},
               "calls": native.calls if native else {}}, f)
print("done", flush=True)
jax.distributed.shutdown()
