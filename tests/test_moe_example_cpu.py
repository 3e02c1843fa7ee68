"""examples/expert_parallel_moe.py on the CPU devices: it trains, and the router learns too (its gradient
reaches it through the top-k weights of pk_jax.moe.moe_mlp)."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def _example():
    path = pathlib.Path(__file__).parents[1] / "examples" / "expert_parallel_moe.py"
    spec = importlib.util.spec_from_file_location("expert_parallel_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moe_example_trains_router_and_experts():
    example = _example()
    first, last = example.main(steps=8, tokens_per_device=32)
    assert last < first
    g = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    params = example.init(jax.random.key(3), example.EXPERTS_PER_DEVICE * g)
    specs = {"router": P(), "gate": P("ep"), "up": P("ep"), "down": P("ep")}
    layer = jax.shard_map(example.moe_layer, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))
    x = jax.random.normal(jax.random.key(4), (g * 16, example.D_MODEL), jnp.float32)
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(layer(p, x) ** 2)))(params, x)
    for name, grad in grads.items():
        assert np.isfinite(np.asarray(grad)).all() and float(jnp.abs(grad).max()) > 0, f"no gradient for {name}"
