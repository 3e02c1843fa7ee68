"""The moe bench's JAX-composition baselines (pk_jax/bench/moe.py) on CPU devices: jax.lax.ragged_all_to_all is
not implemented by XLA:CPU, so it is emulated here from all_gather with its documented semantics; with a capacity
that drops nothing, the ragged dispatch + capacity-padded einsum MLP equals pk_jax.moe.moe_mlp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.bench import moe as bench_moe


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """jax.lax.ragged_all_to_all: rows operand[input_offsets[j] : + send_sizes[j]] of every member land on member
    j at output[output_offsets[j] :] (output_offsets in the receiver's rows)."""
    del recv_sizes
    me = jax.lax.axis_index(axis_name)
    ops, ins, sizes, outs = (jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                                          output_offsets))
    i = jnp.arange(operand.shape[0], dtype=jnp.int32)
    for s in range(ops.shape[0]):
        dest = jnp.where(i < sizes[s, me], outs[s, me] + i, output.shape[0])
        output = output.at[dest].set(ops[s][jnp.minimum(ins[s, me] + i, operand.shape[0] - 1)], mode="drop")
    return output


@pytest.mark.parametrize("g,kind", [(2, "uniform"), (4, "skewed")])
def test_ragged_mlp_baseline_equals_moe_mlp_without_drops(monkeypatch, g, kind):
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all)
    t, h, e, k, f = 32, 16, 8, 2, 24
    mesh = Mesh(np.array(jax.devices()[:g]), (bench_moe.AX,))
    rng = np.random.default_rng(g)
    scores = rng.standard_normal((g * t, e))
    if kind == "skewed":
        scores[:, 0] += 3.0
    ids = jnp.asarray(np.argsort(-scores, -1)[:, :k], jnp.int32)
    x = jnp.asarray(rng.standard_normal((g * t, h)) / 4, jnp.float32)
    wts = jnp.asarray(rng.uniform(0.1, 1, (g * t, k)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((e, h, f)) / 4, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((e, f, h)) / 4, jnp.float32)
    run = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(bench_moe.AX), out_specs=P(bench_moe.AX),
                                           check_vma=False))(x, ids, wts, wg, wu, wd)
    ours = run(lambda x, i, w, a, b, c: pk_jax.moe.moe_mlp(x, i, w, a, b, c, bench_moe.AX))
    base = run(lambda *a: bench_moe._ragged_mlp(*a, cf=float(e)))  # capacity >= every row: nothing dropped
    np.testing.assert_allclose(np.asarray(base), np.asarray(ours), rtol=2e-5, atol=2e-5)
    dropped = run(lambda *a: bench_moe._ragged_mlp(*a, cf=0.5))  # half the mean: rows dropped, others unchanged
    assert not np.allclose(np.asarray(dropped), np.asarray(ours))
    assert np.isfinite(np.asarray(dropped)).all()
