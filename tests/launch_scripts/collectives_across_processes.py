"""A rank of tests/test_launch_cpu.py (run by `python -m pk_jax.launch --cpu -n 2 --cpu-devices 2`):
jax.distributed from the launcher's environment, a mesh over both processes' CPU devices, every pk_jax
collective and a fused op in shard_map against the same program written with jax.lax (on CPU pk_jax
lowers to jax.lax, so this checks the fallbacks across processes), all_reduce against NumPy too, and a
round trip through the distributed key-value store. Prints `OK <what>` per check."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import pk_jax
from pk_jax import _kv
from pk_jax.launch import initialize_from_env

initialize_from_env(initialization_timeout=60)
rank, ranks = jax.process_index(), jax.process_count()
assert ranks == int(os.environ["JAX_NUM_PROCESSES"]) and rank == int(os.environ["JAX_PROCESS_ID"])
assert os.environ["PK_JAX_LOCAL_RANK"] == str(rank) and os.environ["PK_JAX_LOCAL_WORLD"] == str(ranks)
info = pk_jax.initialize()
assert info.ranks == ranks and info.rank == rank and not info.kernels, info
print(f"OK init rank {rank} of {ranks}, {len(jax.local_devices())} local of {jax.device_count()} devices")

mesh = Mesh(np.array(jax.devices()), ("x",))
g = mesh.size
rng = np.random.default_rng(1234)  # every process draws the same global inputs
x_host = rng.standard_normal((g * 8, 16), dtype=np.float32)
a_host = rng.standard_normal((8, g * 16), dtype=np.float32)
w_host = rng.standard_normal((g * 16, 32), dtype=np.float32)


def global_array(host: np.ndarray, spec: P) -> jax.Array:
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def local_blocks(arr: jax.Array) -> list[np.ndarray]:
    return [np.asarray(s.data) for s in sorted(arr.addressable_shards, key=lambda s: s.device.id)]


def compare(name: str, pk_fn, lax_fn, args: tuple, in_specs: tuple) -> list[np.ndarray]:
    def run(fn):
        mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P("x")))
        return local_blocks(mapped(*(global_array(a, s) for a, s in zip(args, in_specs))))

    got, want = run(pk_fn), run(lax_fn)
    for gb, wb in zip(got, want):
        np.testing.assert_allclose(gb, wb, rtol=1e-5, atol=1e-5, err_msg=name)
    print(f"OK {name} rank {rank}")
    return got


compare("all_gather", lambda v: pk_jax.all_gather(v, "x", axis=0, tiled=True),
        lambda v: jax.lax.all_gather(v, "x", axis=0, tiled=True), (x_host,), (P("x"),))
summed = compare("all_reduce", lambda v: pk_jax.all_reduce(v, "x"), lambda v: jax.lax.psum(v, "x"),
                 (x_host,), (P("x"),))
want_sum = x_host.reshape(g, 8, 16).sum(0)  # NumPy: every member holds the sum of the g row blocks
for block in summed:
    np.testing.assert_allclose(block, want_sum, rtol=1e-5, atol=1e-5)
print(f"OK all_reduce_vs_numpy rank {rank}")
compare("reduce_scatter", lambda v: pk_jax.reduce_scatter(v, "x", scatter_dimension=0, tiled=True),
        lambda v: jax.lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True), (x_host,), (P("x"),))
compare("all_to_all", lambda v: pk_jax.all_to_all(v, "x", 0, 1, tiled=True),
        lambda v: jax.lax.all_to_all(v, "x", 0, 1, tiled=True), (x_host,), (P("x"),))
compare("matmul_reduce_scatter", lambda a, w: pk_jax.matmul_reduce_scatter(a, w, "x"),
        lambda a, w: jax.lax.psum_scatter(jnp.dot(a, w, preferred_element_type=jnp.float32), "x",
                                          scatter_dimension=0, tiled=True),
        (a_host, w_host), (P(None, "x"), P("x", None)))

_kv.put(f"launch_test/{rank}", f"hello from {rank}")
peer = (rank + 1) % ranks
got = _kv.get(f"launch_test/{peer}", timeout_s=60)
assert got == f"hello from {peer}", got
print(f"OK kv_store rank {rank} read {got!r}")
jax.distributed.shutdown()
