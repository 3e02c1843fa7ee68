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


def routing_inputs(g: int, num_experts: int, top_k: int, kind: str, seed: int, recv_rows: int) -> dict:
    """Stacked (G, ...) inputs of one routing check, identical wherever the seed is: ids (G, T, K) int32, x,
    cot (G, T, H), weights (G, T, K) float32, and d_recv (G, R, H), a cotangent of dispatch's output."""
    rng = np.random.default_rng(seed)
    ids = moe_model.random_routing(rng, g, TOKENS, top_k, num_experts, kind)
    x = rng.standard_normal((g, TOKENS, HIDDEN)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, (g, TOKENS, top_k)).astype(np.float32)
    cot = rng.standard_normal((g, TOKENS, HIDDEN)).astype(np.float32)
    d_recv = np.random.default_rng([seed, 1]).standard_normal((g, recv_rows, HIDDEN)).astype(np.float32)
    return dict(ids=ids, x=x, weights=weights, cot=cot, d_recv=d_recv)


ROUTED_OUTPUTS = ("recv", "counts", "received", "out", "dx", "dweights", "dx_dispatch")


def routed_member(axis: str, num_experts: int, capacity: int | None = None, recv_rows: int | None = None):
    """One member's program (call inside shard_map over `axis`, G members): dispatch, scale each received row
    by (1 + its global expert id), combine; the VJP of the combined output against `cot`; and the VJP of
    dispatch alone against `d_recv`. (ids (T, K), x (T, H), weights (T, K), cot (T, H), d_recv (R, H)) ->
    the ROUTED_OUTPUTS: recv (R, H), counts (L,), received (1,), out (T, H), dx (T, H), dweights (T, K),
    dx_dispatch (T, H)."""

    def member(ids, x, weights, cot, d_recv):
        g = jax.lax.axis_size(axis)
        local = num_experts // g

        def layer(x, weights):
            recv, counts, h = pk_jax.moe.dispatch(x, ids, axis, num_experts=num_experts, capacity=capacity,
                                                  recv_rows=recv_rows)
            expert = jax.lax.axis_index(axis) * local + jnp.repeat(jnp.arange(local), counts,
                                                                     total_repeat_length=recv.shape[0])
            y = recv * (1.0 + expert.astype(recv.dtype))[:, None]
            return (pk_jax.moe.combine(y, weights, h), recv), (counts, h.received[None])

        # One forward (one routing plan), two cotangents: the pipeline's (cot on out) and dispatch's alone
        # (d_recv on recv).
        (out, recv), vjp, (counts, received) = jax.vjp(layer, x, weights, has_aux=True)
        dx, dw = vjp((cot, jnp.zeros_like(recv)))
        dx_dispatch, _ = vjp((jnp.zeros_like(out), d_recv))
        return recv, counts, received, out, dx, dw, dx_dispatch

    return member


def routed(devices, g, inputs: dict, num_experts, capacity=None, recv_rows=None) -> dict:
    """routed_member over `g` of `devices` (one process): the ROUTED_OUTPUTS, stacked (G, ...)."""
    f = jax.jit(jax.shard_map(routed_member("ep", num_experts, capacity, recv_rows),
                              mesh=Mesh(np.array(devices[:g]), ("ep",)), in_specs=P("ep"), out_specs=P("ep")))
    flat = lambda a: a.reshape(g * a.shape[1], *a.shape[2:])
    res = f(*(flat(inputs[k]) for k in ("ids", "x", "weights", "cot", "d_recv")))
    return {k: np.asarray(r).reshape(g, -1, *r.shape[1:]) for k, r in zip(ROUTED_OUTPUTS, res)}


def routing_expected(inputs: dict, num_experts: int, capacity: int | None, recv_rows: int) -> dict:
    """The NumPy model's ROUTED_OUTPUTS (G, ...) for routing_inputs, and `arrived` (G, T, K): the assignments
    that arrived. Each arrived choice is counted once and weighted once, dropped ones add zero: combine's
    out = sum of arrived weights * (1 + expert) * x, and the VJPs follow (float64)."""
    ids, x, weights, cot, d_recv = (inputs[k] for k in ("ids", "x", "weights", "cot", "d_recv"))
    g, _, hidden = x.shape
    rows, counts, arrived = moe_model.dispatch_model(ids, num_experts, capacity, recv_rows)
    recv = np.zeros((g, recv_rows, hidden), np.float32)
    dx_dispatch = np.zeros(x.shape)
    for d in range(g):
        for i, (s, t, _) in enumerate(rows[d]):
            recv[d, i] = x[s, t]
            dx_dispatch[s, t] += d_recv[d, i]
    keep = np.stack([moe_model.capacity_keep(ids[s], capacity) for s in range(g)])
    dest = ids // (num_experts // g)
    received = np.array([[(keep & (dest == d)).sum()] for d in range(g)])
    scale = 1.0 + ids.astype(np.float64)
    coef = np.where(arrived, weights * scale, 0.0)  # (G, T, K): each arrived choice weighted exactly once
    return dict(recv=recv, counts=np.stack(counts), received=received, out=coef.sum(-1)[..., None] * x,
                dx=coef.sum(-1)[..., None] * cot,
                dweights=np.where(arrived, scale * np.einsum("gth,gth->gt", x, cot)[..., None], 0.0),
                dx_dispatch=dx_dispatch, arrived=arrived)


def check_routing(devices, g, num_experts, top_k, kind, capacity=None, recv_rows=None, seed=0):
    sizes = routing.routing_sizes(g, num_experts, TOKENS, top_k, capacity, recv_rows)
    inputs = routing_inputs(g, num_experts, top_k, kind, seed, sizes.recv_rows)
    got = routed(devices, g, inputs, num_experts, capacity, recv_rows)
    assert got["recv"].shape[1] == sizes.recv_rows
    want = routing_expected(inputs, num_experts, capacity, sizes.recv_rows)
    for d in range(g):
        np.testing.assert_array_equal(got["recv"][d], want["recv"][d],
                                      err_msg=f"member {d}: received rows/order (zero past the counts)")
        np.testing.assert_array_equal(got["counts"][d], want["counts"][d], err_msg=f"member {d}: expert counts")
    np.testing.assert_array_equal(got["received"], want["received"], err_msg="rows sent to each member")
    for name, what in (("out", "combine"), ("dx", "d x"), ("dweights", "d topk_weights"),
                       ("dx_dispatch", "d x of dispatch alone")):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=what)
    return got["received"][:, 0], want["arrived"]


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
