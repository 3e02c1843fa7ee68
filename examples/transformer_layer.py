"""Training a Llama-style tensor- and sequence-parallel transformer layer on pk_jax's fused ops.

The layer (pk_jax/bench/llama_layer.py, the same one `python -m pk_jax.bench model` times) gathers the
sequence-sharded activations inside its QKV and MLP-input GEMMs (`pk_jax.all_gather_matmul`) and
reduce-scatters inside its output and MLP-output GEMMs (`pk_jax.matmul_reduce_scatter`); the backward
pass pairs them the other way round, on fused kernels too, in bf16. This script checks the gradients
against an un-sharded float32 reference, then takes a few SGD steps on a regression target and prints
the loss going down. Small sizes: runs on all GPUs, or on 8 virtual CPU devices in seconds:

    python examples/transformer_layer.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

from pk_jax.bench import llama_layer as L  # noqa: E402

SHAPE = L.LayerShape("example", d_model=256, d_ff=1024, n_heads=8, n_kv_heads=8, head_dim=32, mlp="swiglu")


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(steps: int = 5, lr: float = 0.5) -> None:
    devices = jax.devices()
    g = max(n for n in (1, 2, 4, 8) if n <= len(devices) and SHAPE.n_kv_heads % n == 0)
    mesh = Mesh(np.array(devices[:g]), ("tp",))
    specs = L.param_specs(SHAPE, "tp")
    params = L.init_params(jax.random.key(0), SHAPE, jnp.bfloat16,
                           shardings={k: NamedSharding(mesh, s) for k, s in specs.items()})
    tokens = 128 * g  # the fused kernels want >= 128 rows per GPU
    x = jax.random.normal(jax.random.key(1), (tokens, SHAPE.d_model), jnp.float32).astype(jnp.bfloat16)
    target = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(jnp.bfloat16)
    layer = L.sharded(SHAPE, L.PK_OPS, mesh, "tp")

    def loss(p, x, layer_fn):
        return jnp.mean((layer_fn(p, x).astype(jnp.float32) - target.astype(jnp.float32)) ** 2)

    grad = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, layer), argnums=(0, 1)))
    ref_grad = jax.jit(jax.grad(lambda p, x: loss(p, x, lambda p, x: L.reference_layer(p, x, SHAPE, g)),
                                argnums=(0, 1)))
    _, (d_params, dx) = grad(params, x)
    ref_params, ref_dx = ref_grad(params, x)
    worst = max([rel_err(dx, ref_dx)] + [rel_err(d_params[k], ref_params[k]) for k in d_params])
    print(f"{g} x {devices[0].platform}: layer {SHAPE.name} d={SHAPE.d_model} f={SHAPE.d_ff} T={tokens}; "
          f"gradients of {len(d_params)} parameters and x vs float32 reference: worst relative error {worst:.1e} "
          f"({'ok' if worst < 2e-2 else 'TOO LARGE'})")

    step = jax.jit(lambda p, x: jax.tree.map(lambda w, d: (w - lr * d.astype(jnp.float32)).astype(w.dtype), p,
                                             grad(p, x)[1][0]))
    for i in range(steps):
        print(f"step {i}: loss {float(grad(params, x)[0]):.5f}")
        params = step(params, x)
    print(f"step {steps}: loss {float(grad(params, x)[0]):.5f}")


if __name__ == "__main__":
    main()
