"""Quick check of the fused TP GEMMs on the first two GPUs (device bring-up; exits non-zero on error)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax

mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
cases = {
    "ag": (lambda a, b: pk_jax.all_gather_matmul(a, b, "x", num_comm_sms=4),
           lambda a, b: dot(jax.lax.all_gather(a, "x", tiled=True), b), (P("x"), P()), P("x"), (512, 256), (256, 384)),
    "rs": (lambda a, b: pk_jax.matmul_reduce_scatter(a, b, "x", num_comm_sms=4),
           lambda a, b: jax.lax.psum_scatter(dot(a, b), "x", tiled=True), (P(None, "x"), P("x")), P("x"),
           (512, 512), (512, 384)),
    "ar": (lambda a, b: pk_jax.matmul_all_reduce(a, b, "x", num_comm_sms=4),
           lambda a, b: jax.lax.psum(dot(a, b), "x"), (P(None, "x"), P("x")), P(), (512, 512), (512, 384)),
}
bad = 0
for name in sys.argv[1:] or cases:
    ours, ref, specs, out, xs, ws = cases[name]
    x = jax.device_put(jax.random.normal(jax.random.key(0), xs).astype(jnp.bfloat16), NamedSharding(mesh, specs[0]))
    w = jax.device_put(jax.random.normal(jax.random.key(1), ws).astype(jnp.bfloat16), NamedSharding(mesh, specs[1]))
    f = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False))
    got = np.asarray(f(ours)(x, w).astype(jnp.float32))
    want = np.asarray(f(ref)(x, w).astype(jnp.float32))
    pk_jax.runtime.check()
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"{name}: rel err {err:.2e} nan {np.isnan(got).sum()}", flush=True)
    bad += not err < 1e-2
sys.exit(bad)
