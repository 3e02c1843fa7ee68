"""Training a flax (nnx) tensor- and sequence-parallel MLP under plain `jax.jit` with pk_jax.nn.

No shard_map: the parameters carry their shardings (built under `jax.set_mesh`), the batch is
placed with a NamedSharding, and the partitioner's choices make pk_jax lower the up projection to
AG+GEMM and the down projection to GEMM+RS (the backward to the matching fused ops). The same model
in plain XLA (jnp.dot on the same parameters) trains alongside; the two loss curves agree to bf16
rounding. Runs on all GPUs (data x tensor mesh), or on 8 virtual CPU devices:

    python examples/flax_parallel_mlp.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import pk_jax.nn  # noqa: E402
from pk_jax.sharding import jit_matmul  # noqa: E402

COMPUTE = jnp.bfloat16


def make_mesh(tensor: int | None = None) -> jax.sharding.Mesh:
    """data x tensor over all devices (tensor: up to 4, a divisor of the device count); Auto axes,
    so the partitioner (not the types) chooses the shardings pk_jax reads."""
    n = len(jax.devices())
    tensor = tensor or max(t for t in (1, 2, 4) if n % t == 0)
    return jax.make_mesh((n // tensor, tensor), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


def make_model(mesh, features: int, hidden: int, seed: int = 0) -> pk_jax.nn.ParallelMLP:
    with jax.set_mesh(mesh):  # parameters are created sharded (flax eager sharding)
        return pk_jax.nn.ParallelMLP(features, hidden, axis_name="tensor", sequence_parallel=True, data_axis="data",
                                     dtype=COMPUTE, rngs=nnx.Rngs(seed))


def reference_apply(params: nnx.State, x: jax.Array) -> jax.Array:
    """The same MLP in plain XLA: jnp.dot with float32 accumulation, compute in COMPUTE."""
    def dense(p, h):
        y = jnp.dot(h.astype(COMPUTE), p["kernel"][...].astype(COMPUTE), preferred_element_type=jnp.float32)
        return y.astype(COMPUTE) + p["bias"][...].astype(COMPUTE)
    return dense(params["down"], jax.nn.gelu(dense(params["up"], x)))


def train(model, mesh, batches, targets, *, steps: int, lr: float, reference: bool = False) -> list[float]:
    """SGD on the mean squared error; returns the loss of every step. `reference`: plain XLA forward."""
    graphdef, params = nnx.split(model)
    apply = reference_apply if reference else (lambda p, x: nnx.merge(graphdef, p)(x))

    def loss_fn(p, x, y):
        return jnp.mean((apply(p, x).astype(jnp.float32) - y) ** 2)

    @jax.jit
    def step(p, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        return jax.tree.map(lambda a, g: a - lr * g, p, grads), loss

    losses = []
    with jax.set_mesh(mesh):
        for i in range(steps):
            params, loss = step(params, batches[i % len(batches)], targets[i % len(targets)])
            losses.append(float(loss))
    return losses


def make_data(mesh, batch: int, seq: int, features: int, count: int = 4):
    """Inputs (batch, seq, features) split on batch over data and on seq over tensor, and targets of
    a fixed random teacher."""
    sharding = NamedSharding(mesh, P("data", "tensor", None))
    keys = jax.random.split(jax.random.key(1), count + 1)
    teacher = jax.random.normal(keys[0], (features, features)) / features**0.5
    xs = [jax.device_put(jax.random.normal(k, (batch, seq, features)), sharding) for k in keys[1:]]
    return xs, [jnp.tanh(x @ teacher) for x in xs]


def main(steps: int = 20, features: int = 256, hidden: int = 512,
         seq_per_device: int = 128) -> tuple[list[float], list[float]]:
    """Trains both models; returns (pk_jax losses, plain XLA losses). The fused GPU kernels want
    >= 128 rows per GPU (seq_per_device x 2 sequences per data shard)."""
    mesh = make_mesh()
    xs, ys = make_data(mesh, batch=2 * mesh.shape["data"], seq=seq_per_device * mesh.shape["tensor"],
                       features=features)
    jit_matmul.decisions.clear()
    ours = train(make_model(mesh, features, hidden), mesh, xs, ys, steps=steps, lr=0.5)
    lowered = sorted({(role, d.name) for role, d in jit_matmul.decisions})
    ref = train(make_model(mesh, features, hidden), mesh, xs, ys, steps=steps, lr=0.5, reference=True)
    print(f"mesh {dict(mesh.shape)} on {jax.devices()[0].platform}; lowerings: {lowered}")
    for i in range(0, steps, max(1, steps // 5)):
        print(f"step {i:3d}: loss pk_jax {ours[i]:.5f}   plain XLA {ref[i]:.5f}")
    print(f"final: pk_jax {ours[-1]:.5f}, plain XLA {ref[-1]:.5f}")
    return ours, ref


if __name__ == "__main__":
    main()
