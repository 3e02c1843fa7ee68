"""`pk_jax.sharding.matmul` / `einsum` under plain jit on 8 CPU devices (data 2 x tensor 4): for each
sharding case the partitioner's shardings lead to the expected lowering (forward and backward, read
from `pk_jax.sharding.decisions`), and values and gradients equal a float32 jnp.dot reference."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import pk_jax.sharding as pks

_seed = itertools.count(100)
BF16_TOL = 2e-2  # relative to the largest reference magnitude: bf16 inputs and outputs


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "tp"), axis_types=(AxisType.Auto,) * 2)


def _normal(shape, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(next(_seed)), shape, jnp.float32).astype(dtype)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def run_case(mesh, x_spec, w_spec, out_spec, x_shape=(64, 32), w_shape=(32, 48), matmul=pks.matmul):
    """Value and gradients (one jit: forward + VJP) vs the f32 reference; returns {role: [names]}."""
    x, w, ct = _normal(x_shape), _normal(w_shape), _normal((*x_shape[:-1], w_shape[1]))

    def fwd(x, w):
        y = matmul(x, w)
        return y if out_spec is None else jax.lax.with_sharding_constraint(y, NamedSharding(mesh, out_spec))

    def value_and_grads(x, w, ct):
        y, vjp = jax.vjp(fwd, x, w)
        return y, *vjp(ct)

    shard = lambda s: NamedSharding(mesh, s)
    pks.decisions.clear()
    y, dx, dw = jax.jit(value_and_grads, in_shardings=(shard(x_spec), shard(w_spec), None))(x, w, ct)
    f32 = lambda a: a.astype(jnp.float32)
    ry, ref_vjp = jax.vjp(jnp.dot, f32(x), f32(w))
    rdx, rdw = ref_vjp(f32(ct))
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    for name, got, want in (("y", y, ry), ("dx", dx, rdx), ("dw", dw, rdw)):
        assert _rel(got, want) < BF16_TOL, f"{name}: relative error {_rel(got, want):.2e}"
    roles: dict[str, list[str]] = {}
    for role, d in pks.decisions:
        roles.setdefault(role, []).append(d.name)
    return roles


def test_column_parallel_sequence_parallel_input_is_all_gather_matmul(mesh):
    roles = run_case(mesh, P("tp", None), P(None, "tp"), P(None, "tp"))
    assert roles["forward"] == ["all_gather_matmul"]
    assert roles["dx"] == ["matmul_reduce_scatter"]      # dy (f split) @ w^T, dx wanted sequence-split
    assert roles["dw"] == ["all_gather_k+matmul"]         # x^T gathered over tokens, dy local columns


def test_row_parallel_sequence_parallel_output_is_matmul_reduce_scatter(mesh):
    roles = run_case(mesh, P(None, "tp"), P("tp", None), P("tp", None))
    assert roles["forward"] == ["matmul_reduce_scatter"]
    assert roles["dx"] == ["all_gather_matmul"]           # dy (sequence-split) @ w^T (columns split)
    assert roles["dw"] == ["all_gather_k+matmul"]


def test_row_parallel_replicated_output_is_matmul_all_reduce(mesh):
    roles = run_case(mesh, P(None, "tp"), P("tp", None), P())
    assert roles == {"forward": ["matmul_all_reduce"], "dx": ["matmul"], "dw": ["matmul"]}


def test_data_parallel_rows_column_weights_is_local_matmul(mesh):
    roles = run_case(mesh, P("data", None), P(None, "tp"), P("data", "tp"))
    assert roles["forward"] == ["matmul"]
    assert roles["dx"] == ["matmul_all_reduce"]           # the column layer's dx sums over tp
    assert roles["dw"] == ["matmul_all_reduce"]           # summed over data


def test_data_by_tensor_sequence_parallel_mlp(mesh):
    """Two layers on the 2-D mesh: AG+GEMM then GEMM+RS forward, the mirror image backward. The
    hidden activation is constrained column-split (as pk_jax.nn does): with 3-D activations Shardy
    otherwise may keep h sequence-split, and the second matmul would gather w2 instead."""
    x, w1, w2 = _normal((4, 32, 32)), _normal((32, 64)), _normal((64, 32))
    spec = NamedSharding(mesh, P("data", "tp", None))

    def mlp(x, w1, w2):
        h = jax.lax.with_sharding_constraint(pks.matmul(x, w1), NamedSharding(mesh, P("data", None, "tp")))
        return jax.lax.with_sharding_constraint(pks.matmul(jax.nn.gelu(h), w2), spec)

    def loss(x, w1, w2, f):
        return jnp.sum(f(x, w1, w2).astype(jnp.float32) ** 2)

    shard = lambda s: NamedSharding(mesh, s)
    pks.decisions.clear()
    fn = jax.jit(jax.value_and_grad(lambda *a: loss(*a, mlp), argnums=(0, 1, 2)),
                 in_shardings=(spec, shard(P(None, "tp")), shard(P("tp", None))))
    val, grads = fn(x, w1, w2)
    ref = lambda x, a, b: jax.nn.gelu(jnp.dot(x, a)) @ b
    f32 = [a.astype(jnp.float32) for a in (x, w1, w2)]
    rval, rgrads = jax.value_and_grad(lambda *a: loss(*a, ref), argnums=(0, 1, 2))(*f32)
    assert _rel(val, rval) < BF16_TOL
    for got, want in zip(grads, rgrads):
        assert _rel(got, want) < 3 * BF16_TOL
    names = [(r, d.name, d.group) for r, d in pks.decisions]
    assert sorted(n for n in names if n[0] == "forward") == [("forward", "all_gather_matmul", ("tp",)),
                                                              ("forward", "matmul_reduce_scatter", ("tp",))]
    assert ("dx", "all_gather_matmul", ("tp",)) in names and ("dx", "matmul_reduce_scatter", ("tp",)) in names
    assert all(d.group in {(), ("data",), ("tp",), ("data", "tp")} for _, d in pks.decisions)


def test_einsum_weight_stored_transposed(mesh):
    ein = lambda x, w: pks.einsum("bsd,fd->bsf", x, w)
    x, w = _normal((2, 32, 16)), _normal((24, 16))
    spec = NamedSharding(mesh, P("data", "tp", None))
    y = jax.jit(ein, in_shardings=(spec, NamedSharding(mesh, P("tp", None))))(x, w)
    want = jnp.einsum("bsd,fd->bsf", x.astype(jnp.float32), w.astype(jnp.float32))
    assert _rel(y, want) < BF16_TOL


@pytest.mark.parametrize("subscripts", ["...d,df", "...d,dfg->...f", "...d,ef->...f", "...d,df->...fd"])
def test_einsum_rejects_other_patterns(subscripts):
    with pytest.raises(ValueError, match="subscripts"):
        pks.einsum(subscripts, jnp.ones((4, 8)), jnp.ones((8, 8)))


def test_explicit_axes_raise_naming_the_fix():
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="AxisType.Auto"):
        pks.matmul(jnp.ones((8, 4)), jnp.ones((4, 4)))


def test_shape_errors_name_the_arguments():
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., d\) and w \(d, f\)"):
        pks.matmul(jnp.ones((8, 4)), jnp.ones((5, 4)))


def test_fused_op_lowering_inside_the_partitioner_finds_its_mesh_group(mesh):
    """What the CUDA lowering of `pk_tp_gemm` needs (a concrete mesh and the group's axes) is there
    when the op is lowered from the partition callback: probed through a CPU lowering rule."""
    from jax.interpreters import mlir

    from pk_jax import tp_gemm
    from pk_jax.sharding import group_table

    seen = []

    def probe(ctx, x, w, *, spec):
        seen.append((spec.op, group_table(ctx.module_context.axis_context, spec.axis_name)))
        return tp_gemm._lax_lowering(ctx, x, w, spec=spec)

    mlir.register_lowering(tp_gemm.pk_tp_gemm_p, probe, platform="cpu")
    try:
        x, w = _normal((64, 32)), _normal((32, 48))
        shard = lambda s: NamedSharding(mesh, s)
        jax.jit(pks.matmul, in_shardings=(shard(P("tp", None)), shard(P(None, "tp")))).lower(x, w).compile()
    finally:
        mlir.register_lowering(tp_gemm.pk_tp_gemm_p, tp_gemm._lax_lowering, platform="cpu")
    (op, table), = seen
    assert op == "all_gather_matmul" and table is not None
    assert table.mesh_shape == (2, 4) and table.group_axes == (1,)
    assert table.mesh_ids == tuple(d.id for d in mesh.devices.flat)
