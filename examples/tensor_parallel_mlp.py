"""A Megatron-style tensor-parallel MLP block, two ways:

1. the only change from plain JAX is one call each: `jax.lax.psum` -> `pk_jax.all_reduce`, and
   `jax.lax.all_gather` -> `pk_jax.all_gather` for the sequence-parallel input;
2. the communication fused into the GEMMs (paper 4.1): `pk_jax.all_gather_matmul` for the first
   projection and `pk_jax.matmul_reduce_scatter` for the second (sequence-parallel output).

Runs on all GPUs, or on 8 virtual CPU devices:

    python examples/tensor_parallel_mlp.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402


def mlp_block(x, w_in, w_out, *, gather, reduce):
    """x: (tokens/tp, d) sequence-sharded; w_in: (d, f/tp); w_out: (f/tp, d). Returns (tokens, d)."""
    x = gather(x, "tp", axis=0, tiled=True)             # sequence parallel -> full sequence
    h = jax.nn.gelu(x @ w_in)
    return reduce(h @ w_out, "tp")                       # row-parallel projection: sum partials


def fused_mlp_block(x, w_in, w_out):
    """Same shapes; returns (tokens/tp, d), sequence-sharded again."""
    h = jax.nn.gelu(pk_jax.all_gather_matmul(x, w_in, "tp"))  # all_gather(x) @ w_in in one kernel
    return pk_jax.matmul_reduce_scatter(h, w_out, "tp")       # psum_scatter(h @ w_out) in one kernel


def main():
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("tp",))
    tokens, d, f = 128 * len(devices), 256, 1024  # the fused kernels want >= 128 rows per GPU
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (tokens, d), jnp.bfloat16)
    w_in = jax.random.normal(k2, (d, f), jnp.bfloat16) / d**0.5
    w_out = jax.random.normal(k3, (f, d), jnp.bfloat16) / f**0.5

    def run(gather, reduce):
        block = lambda x, a, b: mlp_block(x, a, b, gather=gather, reduce=reduce)
        fn = jax.shard_map(block, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P())
        return jax.jit(fn)(x, w_in, w_out)

    ours = run(pk_jax.all_gather, pk_jax.all_reduce)
    ref = run(jax.lax.all_gather, jax.lax.psum)
    err = float(jnp.linalg.norm((ours - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    print(f"{len(devices)} x {devices[0].platform}: output {ours.shape}, relative difference vs jax.lax {err:.1e}")

    specs = dict(mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
    fused = jax.jit(jax.shard_map(fused_mlp_block, **specs))(x, w_in, w_out)
    unfused = jax.jit(jax.shard_map(
        lambda x, a, b: jax.lax.psum_scatter(jax.nn.gelu(jax.lax.all_gather(x, "tp", tiled=True) @ a) @ b, "tp",
                                             tiled=True), **specs))(x, w_in, w_out)
    err = float(jnp.linalg.norm((fused - unfused).astype(jnp.float32)) / jnp.linalg.norm(unfused.astype(jnp.float32)))
    print(f"fused AG+GEMM / GEMM+RS block: output {fused.shape}, relative difference vs jax.lax {err:.1e}")


if __name__ == "__main__":
    main()
