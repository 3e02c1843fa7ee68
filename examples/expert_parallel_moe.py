"""A mixture-of-experts layer trained with its experts sharded over every device (expert parallelism).

Tokens are sharded over the "ep" axis (each device routes its own), and so are the experts: device r holds
experts r*L .. r*L + L - 1. A replicated router picks each token's top-k experts; pk_jax.moe.moe_mlp sends
every token to its experts' devices (dispatch), runs their SwiGLU MLPs (grouped GEMMs) and brings the
weighted results home (combine). jax.grad trains the router and the experts together to fit a fixed random
function of the input. The weights are float32 here, so on GPUs the experts' GEMMs run XLA's ragged_dot (our
grouped GEMM kernel takes bf16 / f16: cast x and the expert weights to use it). Runs on all GPUs, or on 8
virtual CPU devices (unless XLA_FLAGS is already set):

    python examples/expert_parallel_moe.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402

D_MODEL, D_FF, EXPERTS_PER_DEVICE, TOP_K = 32, 64, 2, 2


def init(key, experts: int):
    k = jax.random.split(key, 4)
    w = lambda key, shape, fan_in: jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)
    return {"router": w(k[0], (D_MODEL, experts), D_MODEL),
            "gate": w(k[1], (experts, D_MODEL, D_FF), D_MODEL), "up": w(k[2], (experts, D_MODEL, D_FF), D_MODEL),
            "down": w(k[3], (experts, D_FF, D_MODEL), D_FF)}


def moe_layer(params, x):
    """x: (T_local, D_MODEL), this device's tokens; params' expert weights: this device's L experts
    (the router is replicated). Returns (T_local, D_MODEL)."""
    logits = x @ params["router"]                                   # (T, E)
    top_logits, top_ids = jax.lax.top_k(logits, TOP_K)
    weights = jax.nn.softmax(top_logits, axis=-1)                   # gradients reach the router through these
    y = pk_jax.moe.moe_mlp(x, top_ids, weights, params["gate"], params["up"], params["down"], "ep")
    return x + y


def main(steps: int = 30, tokens_per_device: int = 64) -> tuple[float, float]:
    devices = np.array(jax.devices())
    g = len(devices)
    mesh = Mesh(devices, ("ep",))
    experts = EXPERTS_PER_DEVICE * g
    x = jax.random.normal(jax.random.key(0), (g * tokens_per_device, D_MODEL), jnp.float32)
    target = x + jnp.tanh(x @ jax.random.normal(jax.random.key(2), (D_MODEL, D_MODEL)) / np.sqrt(D_MODEL))
    tokens = NamedSharding(mesh, P("ep"))
    x, target = jax.device_put(x, tokens), jax.device_put(target, tokens)
    specs = {"router": P(), "gate": P("ep"), "up": P("ep"), "down": P("ep")}  # experts sharded, router replicated
    params = jax.device_put(init(jax.random.key(1), experts), {k: NamedSharding(mesh, s) for k, s in specs.items()})

    layer = jax.shard_map(moe_layer, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))
    loss = lambda p, x, t: jnp.mean((layer(p, x) - t) ** 2)

    @jax.jit
    def step(p, x, t):
        value, grads = jax.value_and_grad(loss)(p, x, t)
        return jax.tree.map(lambda w, g_: w - 0.3 * g_, p, grads), value

    first = value = None
    for i in range(steps):
        params, value = step(params, x, target)
        first = float(value) if first is None else first
        if i % 10 == 0 or i == steps - 1:
            print(f"step {i:2d}  loss {float(value):.4f}")
    print(f"{g} devices, {experts} experts ({EXPERTS_PER_DEVICE} per device), top-{TOP_K}, "
          f"{tokens_per_device} tokens per device; loss {first:.4f} -> {float(value):.4f}")
    assert float(value) < first, "training did not reduce the loss"
    return first, float(value)


if __name__ == "__main__":
    main()
