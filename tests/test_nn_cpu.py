"""pk_jax.nn on 8 CPU devices (data 2 x tensor 4): the layer functions inside shard_map and under
plain jit, the flax modules, and the flax example's loss curve against the same model in plain XLA."""

from __future__ import annotations

import importlib.util
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import pk_jax.nn as nn
import pk_jax.sharding as pks

_seed = itertools.count(300)
BF16_TOL = 3e-2  # relative to the largest reference magnitude, two bf16 layers


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


def _normal(shape, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(next(_seed)), shape, jnp.float32)).astype(jnp.bfloat16)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _mlp_inputs():
    return (_normal((4, 32, 32)), _normal((32, 64), 32**-0.5), _normal((64, 32), 64**-0.5), _normal((64,)),
            _normal((32,)))


def _reference(x, w1, w2, b1, b2):
    f32 = [a.astype(jnp.float32) for a in (x, w1, w2, b1, b2)]
    x, w1, w2, b1, b2 = f32
    return jax.nn.gelu(x @ w1 + b1) @ w2 + b2


def _loss(f):
    return lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parallel_mlp_inside_shard_map(mesh, sequence_parallel):
    args = _mlp_inputs()
    x_spec = P("data", "tensor" if sequence_parallel else None, None)
    specs = (x_spec, P(None, "tensor"), P("tensor", None), P("tensor"), P())
    block = lambda *a: nn.parallel_mlp(*a, axis_name="tensor", sequence_parallel=sequence_parallel)
    fn = jax.shard_map(block, mesh=mesh, in_specs=specs, out_specs=x_spec)
    y, grads = jax.jit(lambda *a: (fn(*a), jax.grad(_loss(fn), argnums=(0, 1, 2, 3, 4))(*a)))(*args)
    assert _rel(y, _reference(*args)) < BF16_TOL
    ref_grads = jax.grad(_loss(_reference), argnums=(0, 1, 2, 3, 4))(*args)
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < BF16_TOL


@pytest.mark.parametrize("sequence_parallel, forward", [(False, ["matmul", "matmul_all_reduce"]),
                                                        (True, ["all_gather_matmul", "matmul_reduce_scatter"])])
def test_parallel_mlp_under_plain_jit(mesh, sequence_parallel, forward):
    args = _mlp_inputs()
    x_spec = P("data", "tensor" if sequence_parallel else None, None)
    specs = (x_spec, P(None, "tensor"), P("tensor", None), P("tensor"), P())
    block = lambda *a: nn.parallel_mlp(*a, axis_name="tensor", sequence_parallel=sequence_parallel,
                                       data_axis="data", mesh=mesh)
    pks.decisions.clear()
    y = jax.jit(block, in_shardings=tuple(NamedSharding(mesh, s) for s in specs))(*args)
    assert sorted(d.name for r, d in pks.decisions if r == "forward") == forward
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, x_spec), y.ndim)
    assert _rel(y, _reference(*args)) < BF16_TOL


def test_flax_modules_shard_their_parameters_and_match(mesh):
    from flax import nnx
    with jax.set_mesh(mesh):
        model = nn.ParallelMLP(32, 64, axis_name="tensor", sequence_parallel=True, data_axis="data",
                               dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        assert model.up.kernel[...].sharding.spec == P(None, "tensor")
        assert model.down.kernel[...].sharding.spec == P("tensor", None)
        x = jax.device_put(_normal((4, 32, 32)), P("data", "tensor", None))
        y = nnx.jit(lambda m, x: m(x))(model, x)
    p = nnx.state(model)
    want = _reference(x, p["up"]["kernel"][...], p["down"]["kernel"][...], p["up"]["bias"][...],
                      p["down"]["bias"][...])
    assert y.dtype == jnp.bfloat16 and _rel(y, want) < BF16_TOL


def test_row_parallel_rejects_unknown_reduce():
    with pytest.raises(ValueError, match="reduce='sum'"):
        nn.row_parallel_linear(jnp.ones((8, 4)), jnp.ones((4, 4)), axis_name="tensor", reduce="sum")


def test_plain_jit_without_mesh_says_how_to_pass_one():
    with pytest.raises(ValueError, match="jax.set_mesh"):
        jax.jit(lambda x, w: nn.column_parallel_linear(x, w, axis_name="tensor"))(jnp.ones((8, 4)), jnp.ones((4, 4)))


def test_flax_example_loss_curve_matches_plain_xla():
    path = pathlib.Path(__file__).parents[1] / "examples" / "flax_parallel_mlp.py"
    spec = importlib.util.spec_from_file_location("flax_parallel_mlp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    ours, ref = example.main(steps=6, features=64, hidden=128, seq_per_device=8)
    assert ours[-1] < ours[0]  # it trains
    np.testing.assert_allclose(ours, ref, rtol=1e-2)


def test_flax_module_inside_shard_map(mesh):
    """The same module on local parameter blocks: state specs from the parameters' sharding metadata."""
    from flax import nnx
    with jax.set_mesh(mesh):
        model = nn.ParallelMLP(32, 64, axis_name="tensor", sequence_parallel=True, dtype=jnp.bfloat16,
                               rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    state_specs = nnx.get_partition_spec(state)
    x_spec = P("data", "tensor", None)
    x = _normal((4, 32, 32))
    fn = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x), mesh=mesh, in_specs=(state_specs, x_spec),
                       out_specs=x_spec)
    y = jax.jit(fn)(state, x)
    want = _reference(x, state["up"]["kernel"][...], state["down"]["kernel"][...], state["up"]["bias"][...],
                      state["down"]["bias"][...])
    assert _rel(y, want) < BF16_TOL
