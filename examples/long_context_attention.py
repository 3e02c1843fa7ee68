"""A causal self-attention layer trained on a sequence sharded over every device (context parallelism).

The sequence is put in zigzag order (pk_jax.sharding.to_zigzag) and sharded over the "sp" axis; each
device holds two chunks of it. The layer's attention is pk_jax.ring_attention (swap in
pk_jax.ulysses_attention to compare), its projections are ordinary per-token matmuls, and jax.grad
trains it for a few steps to copy a shifted input. Runs on all GPUs, or on 8 virtual CPU devices:

    python examples/long_context_attention.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax.sharding import from_zigzag, to_zigzag  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, D_MODEL = 4, 2, 16, 64


def init(key):
    k = jax.random.split(key, 4)
    w = lambda key, shape: jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[0])
    return {"q": w(k[0], (D_MODEL, HEADS * HEAD_DIM)), "k": w(k[1], (D_MODEL, KV_HEADS * HEAD_DIM)),
            "v": w(k[2], (D_MODEL, KV_HEADS * HEAD_DIM)), "o": w(k[3], (HEADS * HEAD_DIM, D_MODEL))}


def attention_layer(params, x):
    """x: (B, T_local, D_MODEL), this device's zigzag chunks. Returns the same shape."""
    b, t, _ = x.shape
    q = (x @ params["q"]).reshape(b, t, HEADS, HEAD_DIM)
    k = (x @ params["k"]).reshape(b, t, KV_HEADS, HEAD_DIM)
    v = (x @ params["v"]).reshape(b, t, KV_HEADS, HEAD_DIM)
    a = pk_jax.ring_attention(q, k, v, "sp", causal=True, layout="zigzag")
    return x + a.reshape(b, t, HEADS * HEAD_DIM) @ params["o"]


def main():
    devices = np.array(jax.devices())
    g = len(devices)
    mesh = Mesh(devices, ("sp",))
    seq, batch = 64 * g, 2
    x = jax.random.normal(jax.random.key(0), (batch, seq, D_MODEL), jnp.float32)
    target = jnp.roll(x, 1, axis=1)  # the previous token: needs attention, and a causal one suffices
    seq_sharded = NamedSharding(mesh, P(None, "sp"))
    xz = jax.device_put(to_zigzag(x, g), seq_sharded)
    tz = jax.device_put(to_zigzag(target, g), seq_sharded)

    layer = jax.shard_map(attention_layer, mesh=mesh, in_specs=(P(), P(None, "sp")), out_specs=P(None, "sp"))
    loss = lambda p, x, t: jnp.mean((layer(p, x) - t) ** 2)

    @jax.jit
    def step(p, x, t):
        value, grads = jax.value_and_grad(loss)(p, x, t)
        return jax.tree.map(lambda w, g_: w - 0.5 * g_, p, grads), value

    params = init(jax.random.key(1))
    first = None
    for i in range(20):
        params, value = step(params, xz, tz)
        first = float(value) if first is None else first
        if i % 5 == 0 or i == 19:
            print(f"step {i:2d}  loss {float(value):.4f}")
    out = from_zigzag(jax.jit(layer)(params, xz), g)  # back to global order for the caller
    print(f"{g} devices, sequence {seq} ({seq // g} per device), output {out.shape}; "
          f"loss {first:.4f} -> {float(value):.4f}")
    assert float(value) < first, "training did not reduce the loss"


if __name__ == "__main__":
    main()
