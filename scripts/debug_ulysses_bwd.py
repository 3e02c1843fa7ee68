"""Ulysses fwd+bwd once at a given shape on every visible GPU (a crash hunt): --nobarrier drops the backward's
barrier over the forward's residuals."""
import argparse, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import pk_jax
import pk_jax.context.ulysses as U

ap = argparse.ArgumentParser()
ap.add_argument("--shape", type=int, nargs=4, default=[16, 2048, 128, 128])
ap.add_argument("--nobarrier", action="store_true")
ap.add_argument("--impl", default="cudnn")
ap.add_argument("--fwd", action="store_true")
a = ap.parse_args()
if a.nobarrier:
    def bwd(axes, c, local, vjps, d_out):
        vjp = lambda i, xs: list(vjps[i](xs[0]))
        return tuple(U._pipelined_in_place([d_out], local.chunks, vjp, axes, local.own_on_xla))
    U._ulysses_async.defvjp(U._async_fwd, bwd)
g = len(jax.devices()); m = Mesh(np.array(jax.devices()), ("sp",))
impl = None if a.impl == "none" else a.impl
body = jax.shard_map(lambda q, k, v: pk_jax.ulysses_attention(q, k, v, "sp", implementation=impl), mesh=m,
                     in_specs=P(None, "sp"), out_specs=P(None, "sp"), check_vma=False)
f = jax.jit(body) if a.fwd else jax.jit(jax.grad(lambda q, k, v: jnp.sum(body(q, k, v).astype(jnp.float32)), (0, 1, 2)))
xs = [jax.random.normal(jax.random.key(i), a.shape, jnp.bfloat16) for i in range(3)]
print("G", g, "shape", a.shape, "nobarrier", a.nobarrier, flush=True)
c = f.lower(*xs).compile(); print("compiled", flush=True)
for i in range(3):
    t = time.perf_counter(); r = c(*xs); jax.block_until_ready(r); print("run", i, time.perf_counter() - t, flush=True)
print("OK", float(jnp.sum(jnp.abs(jax.tree_util.tree_leaves(r)[0].astype(jnp.float32)))), flush=True)
