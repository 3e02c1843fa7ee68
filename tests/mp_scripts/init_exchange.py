"""One process of tests/test_distributed_cpu.py: runs pk_jax.initialize()'s exchange over the real
jax.distributed key-value store (CPU, gloo), with a fake native runtime that stands in for the GPU
calls, and writes what the runtime was told to a JSON file.
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

    def add_local_device(self, ordinal, device_id, slot, process, probe_ptr, staging_bytes):
        self.calls["add"].append([ordinal, device_id, slot, process, probe_ptr])
        handles = [f"xla{device_id}".encode(), f"stage{device_id}".encode()]
        return f"ctrl{device_id}".encode(), [1, 2], [3, 4], handles, ""

    def attach_member(self, device_id, slot, process, ctrl, regions):
        self.calls["attach"].append([device_id, slot, process, ctrl.decode(), [r.decode() for r in regions]])
        return [mapped_address(rank, device_id, i) for i in range(len(regions))]

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
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"info": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(info).items()},
               "calls": native.calls if native else {}}, f)
print("done", flush=True)
jax.distributed.shutdown()
