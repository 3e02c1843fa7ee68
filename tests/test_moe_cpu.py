"""Expert parallelism on virtual CPU devices, against the NumPy model of tests/moe_model.py: dispatch's
exact output order and counts, combine's weighted sum (every token's choices arrive once, weighted once),
both VJPs, capacity and recv_rows drops, over routing cases (uniform, skewed, an expert with no tokens, a
member receiving nothing, repeated ids), top-k 1..8, 8..64 experts, groups of 1, 2, 4, 8; grouped_matmul
(ragged_dot path and the tiled scan of the GPU reference) and its gradients; moe_mlp and its gradients
against a float32 single-device reference."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import moe_model  # tests/moe_model.py and moe_checks.py (tests/ is on sys.path)
from moe_checks import TOKENS, check_moe_mlp, check_routing, grouped_refs
import pk_jax
from pk_jax.bench import hlo_checks
from pk_jax.moe import routing

# the module, not the function pk_jax.moe.grouped_matmul that shadows it as a package attribute
gm_mod = importlib.import_module("pk_jax.moe.grouped_matmul")



def mesh(g: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:g]), ("ep",))


ROUTING_CASES = [  # (G, experts, top_k, routing)
    (1, 8, 2, "uniform"),
    (2, 8, 1, "uniform"),
    (2, 8, 2, "skewed"),
    (2, 16, 5, "empty_expert"),
    (4, 8, 8, "uniform"),
    (4, 16, 4, "empty_expert"),
    (4, 64, 6, "idle_member"),
    (4, 16, 3, "repeats"),
    (8, 8, 3, "uniform"),
    (8, 32, 2, "idle_member"),
    (8, 64, 8, "skewed"),
]


@pytest.mark.parametrize("g,num_experts,top_k,kind", ROUTING_CASES)
def test_dispatch_combine_match_numpy_model(g, num_experts, top_k, kind):
    received, arrived = check_routing(jax.devices(), g, num_experts, top_k, kind)
    assert arrived.all(), "without capacity nothing drops"
    assert received.sum() == g * TOKENS * top_k


@pytest.mark.parametrize("g,num_experts,top_k,capacity", [(2, 16, 4, 1), (4, 8, 2, 2), (8, 16, 2, 3)])
def test_capacity_drops_in_gshard_priority_order(g, num_experts, top_k, capacity):
    received, arrived = check_routing(jax.devices(), g, num_experts, top_k, "skewed", capacity=capacity, seed=1)
    assert not arrived.all(), "the skewed case must overflow the capacity"
    sizes = routing.routing_sizes(g, num_experts, TOKENS, top_k, capacity, None)
    assert sizes.send_rows == min(TOKENS * top_k, num_experts // g * capacity)


def test_recv_rows_bound_drops_the_end_of_the_output_order():
    g, e, k = 4, 8, 2
    received, arrived = check_routing(jax.devices(), g, e, k, "skewed", recv_rows=10, seed=2)
    assert (received > 10).any(), "the case must overflow the bound somewhere"
    assert arrived.sum() == np.minimum(received, 10).sum()


def test_default_recv_rows_is_the_worst_case():
    sizes = routing.routing_sizes(4, 16, 12, 3, None, None)
    assert sizes.recv_rows == routing.worst_case_recv_rows(4, 12, 3) == 4 * 12 * 3
    assert pk_jax.moe.expert_capacity(12, 2, 8, 1.25) == 4  # ceil(1.25 * 24 / 8)


@pytest.mark.parametrize("n,num_keys", [(1, 1), (129, 3), (8192, 9), (8193, 65), (16384, 65), (65536, 9), (32768, 257), (70000, 9)])
def test_stable_sort_by_key_matches_a_stable_argsort(n, num_keys):
    """The counted positions (few keys) and the argsort fallback (32768 x 257, 70000): the permutation of a
    stable sort and its inverse, with a hot key (a third of the assignments) and runs crossing the blocks."""
    rng = np.random.default_rng(n + num_keys)
    key = rng.integers(0, num_keys, n).astype(np.int32)
    key[: n // 3] = num_keys - 1
    order, sorted_index = jax.jit(routing.stable_sort_by_key, static_argnums=1)(jnp.asarray(key), num_keys)
    ref = np.argsort(key, kind="stable")
    np.testing.assert_array_equal(order, ref)
    np.testing.assert_array_equal(np.asarray(sorted_index)[ref], np.arange(n))


def test_dispatch_rejects_bad_arguments():
    f = lambda x, ids, **kw: jax.shard_map(lambda x, ids: pk_jax.moe.dispatch(x, ids, "ep", **kw)[0],
                                           mesh=mesh(4), in_specs=P("ep"), out_specs=P("ep"))(x, ids)
    x, ids = jnp.zeros((16, 4)), jnp.zeros((16, 2), jnp.int32)
    with pytest.raises(ValueError, match="num_experts=6 must be a positive multiple of the group size 4"):
        f(x, ids, num_experts=6)
    with pytest.raises(ValueError, match="topk_ids must be"):
        f(x, jnp.zeros((8, 2), jnp.int32), num_experts=8)
    with pytest.raises(TypeError, match="topk_ids must be integers"):
        f(x, ids.astype(jnp.float32), num_experts=8)
    with pytest.raises(ValueError, match="capacity"):
        f(x, ids, num_experts=8, capacity=-1)


def random_groups(rng, m, e, short):
    """Random group sizes summing to m (m - 5 when short; m + 3, cut at m, when over), group 1 empty."""
    total = {"short": m - 5, "over": m + 3}.get(short, m)
    cuts = np.sort(rng.integers(0, total + 1, e - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
    sizes[0] += sizes[1]
    sizes[1] = 0
    return sizes


@pytest.mark.parametrize("m,k,n,e,short", [(40, 16, 24, 4, "exact"), (37, 8, 8, 8, "short"), (5, 4, 4, 3, "over")])
def test_grouped_matmul_and_gradients_match_dense_reference(m, k, n, e, short):
    rng = np.random.default_rng(m)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((e, k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    gs = random_groups(rng, m, e, short)
    want = grouped_refs(x, w, gs, dy)
    out, vjp = jax.vjp(lambda x, w: pk_jax.grouped_matmul(x, w, jnp.asarray(gs)), x, w)
    got = (out, *vjp(dy))
    for name, a, b in zip(("out", "dx", "dw"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)
    for tile in (1, 4, 128):  # the non-CPU reference: the (row tile, group) pair scan
        t_out = gm_mod.grouped_matmul_tiled(x, w, jnp.asarray(gs), tile_rows=tile)
        t_dw = gm_mod.grouped_weight_grad_tiled(x, dy, jnp.asarray(gs), tile_rows=tile)
        np.testing.assert_allclose(t_out, want[0], rtol=1e-4, atol=1e-4, err_msg=f"tiled out, tile {tile}")
        np.testing.assert_allclose(t_dw, want[2], rtol=1e-4, atol=1e-4, err_msg=f"tiled dw, tile {tile}")


def test_grouped_matmul_bfloat16_accumulates_in_float32():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((64, 256)).astype(np.float32), rng.standard_normal((4, 256, 16)).astype(np.float32)
    gs = np.array([10, 0, 30, 24], np.int32)
    got = pk_jax.grouped_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(gs))
    assert got.dtype == jnp.bfloat16
    xr, wr = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (x, w))
    want = moe_model.dense_grouped_matmul(xr, wr, gs)
    assert np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max() < 1e-2


def test_grouped_matmul_rejects_bad_shapes():
    with pytest.raises(ValueError, match="same k"):
        pk_jax.grouped_matmul(jnp.zeros((4, 3)), jnp.zeros((2, 5, 6)), jnp.array([2, 2]))
    with pytest.raises(ValueError, match="group_sizes must be integers of shape"):
        pk_jax.grouped_matmul(jnp.zeros((4, 3)), jnp.zeros((2, 3, 6)), jnp.array([2, 2, 0]))


@pytest.mark.parametrize("g,num_experts,top_k,kind,dtype,tol", [
    (4, 8, 2, "skewed", jnp.float32, 1e-4),
    (2, 8, 3, "uniform", jnp.bfloat16, 4e-2),
    (8, 16, 1, "idle_member", jnp.float32, 1e-4),
])
def test_moe_mlp_and_gradients_match_float32_reference(g, num_experts, top_k, kind, dtype, tol):
    check_moe_mlp(jax.devices(), g, num_experts, top_k, kind, dtype, tol, tokens=8, hidden=16, ffn=24, scale=4,
                  seed=g + top_k)


def test_grouped_matmul_weight_grad_sums_over_members_holding_replicated_weights():
    """w replicated over the axis (invariant), x sharded: dw is the sum of every member's x_e^T dy_e."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((4 * 6, 8)).astype(np.float32), rng.standard_normal((2, 8, 4)).astype(np.float32)
    gs = np.array([4, 2], np.int32)
    f = jax.shard_map(lambda x, w: pk_jax.grouped_matmul(x, w, jnp.asarray(gs)), mesh=mesh(4),
                      in_specs=(P("ep"), P()), out_specs=P("ep"))
    dw = jax.jit(jax.grad(lambda x, w: f(x, w).sum(), argnums=1))(x, w)
    want = sum(grouped_refs(xs, w, gs, np.ones((6, 4), np.float32))[2] for xs in np.split(x, 4))
    np.testing.assert_allclose(dw, want, rtol=1e-4, atol=1e-4)


def test_moe_mlp_exchanges_only_through_pk_jax_collectives():
    """Forward and backward of moe_mlp over ep=4 of a (dp=2, ep=4) mesh, expert weights replicated over dp:
    the counts, rows and dp's weight-gradient sum are pk_collective calls, no jax.lax collective, and the
    values (gradients summed over dp) match the float32 reference."""
    g, dp, e, k, t, h, f = 4, 2, 8, 2, 6, 8, 12
    rng = np.random.default_rng(11)
    ids = moe_model.random_routing(rng, dp * g, t, k, e, "skewed").reshape(dp * g * t, k)
    x, cot = (rng.standard_normal((dp * g * t, h)).astype(np.float32) for _ in range(2))
    wt = rng.uniform(0.1, 1.0, (dp * g * t, k)).astype(np.float32)
    wg, wu = (rng.standard_normal((e, h, f)).astype(np.float32) / 4 for _ in range(2))
    wd = rng.standard_normal((e, f, h)).astype(np.float32) / 4
    grid = Mesh(np.array(jax.devices()[:dp * g]).reshape(dp, g), ("dp", "ep"))
    tok = P(("dp", "ep"))
    layer = jax.shard_map(lambda x, ids, wt, a, b, c: pk_jax.moe.moe_mlp(x, ids, wt, a, b, c, "ep"), mesh=grid,
                          in_specs=(tok, tok, tok, P("ep"), P("ep"), P("ep")), out_specs=tok)

    def step(fn, *params):
        out, vjp = jax.vjp(fn, *params)
        return (out, *vjp(cot))

    ours = lambda *p: step(lambda x, wt, a, b, c: layer(x, ids, wt, a, b, c), *p)
    reference = lambda *p: step(lambda x, *rest: moe_model.moe_mlp_reference(x, ids, *rest), *p)
    names = hlo_checks.primitive_names(jax.make_jaxpr(ours)(x, wt, wg, wu, wd).jaxpr)
    lax_left = names & hlo_checks.LAX_COLLECTIVES
    assert "pk_collective" in names and not lax_left, sorted(lax_left)
    with jax.default_matmul_precision("highest"):
        got, want = jax.jit(ours)(x, wt, wg, wu, wd), jax.jit(reference)(x, wt, wg, wu, wd)
    for name, a, b in zip(("out", "dx", "dweights", "dw_gate", "dw_up", "dw_down"), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def test_routing_refuses_more_assignments_than_float32_counts_hold():
    """The counts cross members as float32 (pk_jax.all_to_all moves floats): exact up to 2^24 = T * K."""
    assert routing.routing_sizes(2, 4, 1 << 23, 2, None, None).send_rows == 1 << 24
    assert float(np.float32(1 << 24)) == 1 << 24 and float(np.float32((1 << 24) + 1)) != (1 << 24) + 1
    with pytest.raises(ValueError, match="exceeds 16777216"):
        routing.routing_sizes(2, 4, (1 << 23) + 1, 2, None, None)
