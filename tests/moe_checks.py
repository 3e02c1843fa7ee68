"""Checks shared by the CPU and GPU MoE tests: dispatch/combine (and their VJPs) against the NumPy model of
tests/moe_model.py, and the float64 grouped-matmul reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import moe_model
import pk_jax
from pk_jax.moe import routing

TOKENS, HIDDEN = 12, 8


def routed(devices, g, ids, x, weights, num_experts, capacity=None, recv_rows=None, cot=None):
    """One jitted shard_map: dispatch, scale each received row by (1 + its global expert id), combine; and the
    VJP of the combined output against `cot`. Returns recv (G, R, H), counts (G, L), received (G,), out
    (G, T, H), dx (G, T, H), dweights (G, T, K)."""
    local = num_experts // g

    def member(x, ids, weights, cot):
        def layer(x, weights):
            recv, counts, h = pk_jax.moe.dispatch(x, ids, "ep", num_experts=num_experts, capacity=capacity,
                                                  recv_rows=recv_rows)
            expert = jax.lax.axis_index("ep") * local + jnp.repeat(jnp.arange(local), counts,
                                                                     total_repeat_length=recv.shape[0])
            y = recv * (1.0 + expert.astype(recv.dtype))[:, None]
            return pk_jax.moe.combine(y, weights, h), (recv, counts, h.received[None])

        out, vjp, (recv, counts, received) = jax.vjp(layer, x, weights, has_aux=True)
        dx, dw = vjp(cot)
        return recv, counts, received, out, dx, dw

    f = jax.jit(jax.shard_map(member, mesh=Mesh(np.array(devices[:g]), ("ep",)), in_specs=P("ep"), out_specs=P("ep")))
    flat = lambda a: a.reshape(g * a.shape[1], *a.shape[2:])
    res = f(flat(x), flat(ids), flat(weights), flat(cot))
    return [np.asarray(r).reshape(g, -1, *r.shape[1:]) for r in res]


def check_routing(devices, g, num_experts, top_k, kind, capacity=None, recv_rows=None, seed=0):
    rng = np.random.default_rng(seed)
    ids = moe_model.random_routing(rng, g, TOKENS, top_k, num_experts, kind)
    x = rng.standard_normal((g, TOKENS, HIDDEN)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, (g, TOKENS, top_k)).astype(np.float32)
    cot = rng.standard_normal((g, TOKENS, HIDDEN)).astype(np.float32)
    recv, counts, received, out, dx, dw = routed(devices, g, ids, x, weights, num_experts, capacity, recv_rows, cot)
    r = recv.shape[1]
    sizes = routing.routing_sizes(g, num_experts, TOKENS, top_k, capacity, recv_rows)
    assert r == sizes.recv_rows
    rows, want_counts, arrived = moe_model.dispatch_model(ids, num_experts, capacity, r)
    for d in range(g):
        want = np.array([x[s, t] for s, t, _ in rows[d]]).reshape(-1, HIDDEN)
        np.testing.assert_array_equal(recv[d, :len(want)], want, err_msg=f"member {d}: received rows/order")
        assert not recv[d, len(want):].any(), f"member {d}: rows past the counts must be zero"
        np.testing.assert_array_equal(counts[d], want_counts[d], err_msg=f"member {d}: expert counts")
    scale = 1.0 + ids.astype(np.float64)
    coef = np.where(arrived, weights * scale, 0.0)  # (G, T, K): each arrived choice weighted exactly once
    want_out = coef.sum(-1)[..., None] * x
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5, err_msg="combine")
    np.testing.assert_allclose(dx, coef.sum(-1)[..., None] * cot, rtol=1e-5, atol=1e-5, err_msg="d x")
    want_dw = np.where(arrived, scale * np.einsum("gth,gth->gt", x, cot)[..., None], 0.0)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5, err_msg="d topk_weights")
    return received, arrived


def grouped_refs(x, w, gs, dy):
    """float64 forward and VJP of the grouped matmul."""
    out = moe_model.dense_grouped_matmul(x, w, gs)
    dx = moe_model.dense_grouped_matmul(dy, np.swapaxes(w, 1, 2), gs)
    dw = np.zeros(w.shape)
    start = 0
    for e, n in enumerate(gs):
        end = min(start + int(n), x.shape[0])
        dw[e] = x[start:end].T.astype(np.float64) @ dy[start:end]
        start = end
    return out, dx, dw


def check_moe_mlp(devices, g, num_experts, top_k, kind, dtype, tol, *, tokens, hidden, ffn, scale, seed):
    """moe_mlp's output and all five gradients (x, weights, w_gate, w_up, w_down) over `g` members
    against the float32 single-device reference of tests/moe_model.py; relative to the largest |ref|."""
    rng = np.random.default_rng(seed)
    ids = moe_model.random_routing(rng, g, tokens, top_k, num_experts, kind).reshape(g * tokens, top_k)
    x = rng.standard_normal((g * tokens, hidden)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, (g * tokens, top_k)).astype(np.float32)
    w_gate, w_up = (rng.standard_normal((num_experts, hidden, ffn)).astype(np.float32) / scale for _ in range(2))
    w_down = rng.standard_normal((num_experts, ffn, hidden)).astype(np.float32) / scale
    cot = rng.standard_normal((g * tokens, hidden)).astype(np.float32)
    params = (x, weights, w_gate, w_up, w_down)
    sharded = jax.shard_map(lambda x, wt, a, b, c, ids: pk_jax.moe.moe_mlp(x, ids, wt, a, b, c, "ep"),
                            mesh=Mesh(np.array(devices[:g]), ("ep",)), in_specs=P("ep"), out_specs=P("ep"))

    @jax.jit
    def ours(*params):
        out, vjp = jax.vjp(lambda *p: sharded(*p, ids), *(p.astype(dtype) for p in params))
        return (out, *vjp(cot.astype(dtype)))

    @jax.jit
    def reference(*params):
        out, vjp = jax.vjp(lambda x, w, a, b, c: moe_model.moe_mlp_reference(x, ids, w, a, b, c), *params)
        return (out, *vjp(cot))

    with jax.default_matmul_precision("highest"):
        got, want = ours(*params), reference(*params)
    for name, a, b in zip(("out", "dx", "dweights", "dw_gate", "dw_up", "dw_down"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
        assert err < tol, f"moe_mlp {name} G={g} {jnp.dtype(dtype).name}: relative error {err:.2e} (tol {tol})"
