"""A NumPy model of pk_jax.moe routing (dispatch order, capacity and recv_rows drops, combine) and float32
references of grouped_matmul and moe_mlp, shared by the CPU and GPU MoE tests."""

from __future__ import annotations

import numpy as np


def random_routing(rng: np.random.Generator, g: int, tokens: int, top_k: int, num_experts: int,
                   kind: str) -> np.ndarray:
    """(G, T, K) expert ids. kind: uniform | skewed (3 hot experts take most choices) | empty_expert (expert 1
    never chosen) | idle_member (no token picks member 1's experts; needs G >= 2), all distinct per token;
    repeats: uniform with repeats allowed (a token may pick one expert twice)."""
    if kind == "repeats":
        return rng.integers(0, num_experts, (g, tokens, top_k)).astype(np.int32)
    scores = rng.standard_normal((g, tokens, num_experts))
    local = num_experts // g
    if kind == "skewed":
        scores[..., [0, num_experts // 2, num_experts - 1]] += 3.0
    elif kind == "empty_expert":
        scores[..., 1] = -np.inf
    elif kind == "idle_member":
        scores[..., local:2 * local] = -np.inf
    elif kind != "uniform":
        raise ValueError(kind)
    return np.argsort(-scores, axis=-1, kind="stable")[..., :top_k].astype(np.int32)


def capacity_keep(ids: np.ndarray, capacity: int | None) -> np.ndarray:
    """(T, K) bool for one member: GShard priority, choice rank first, then token position."""
    t, k = ids.shape
    keep = np.ones((t, k), bool)
    if capacity is None:
        return keep
    used: dict[int, int] = {}
    for kk in range(k):
        for tt in range(t):
            e = int(ids[tt, kk])
            keep[tt, kk] = used.get(e, 0) < capacity
            used[e] = used.get(e, 0) + 1
    return keep


def dispatch_model(ids: np.ndarray, num_experts: int, capacity: int | None, recv_rows: int):
    """ids (G, T, K) -> per member d: list of (source, token, choice) in output order, counts (L,), and the
    (G, T, K) bool of assignments that arrived (not dropped by capacity or the recv_rows bound)."""
    g, t, k = ids.shape
    local = num_experts // g
    keep = np.stack([capacity_keep(ids[s], capacity) for s in range(g)])
    arrived = np.zeros_like(keep)
    rows, counts = [], []
    for d in range(g):
        order, cnt = [], np.zeros(local, np.int64)
        for l in range(local):
            for s in range(g):
                for tt in range(t):
                    for kk in range(k):
                        if ids[s, tt, kk] == d * local + l and keep[s, tt, kk] and len(order) < recv_rows:
                            order.append((s, tt, kk))
                            cnt[l] += 1
                            arrived[s, tt, kk] = True
        rows.append(order)
        counts.append(cnt)
    return rows, counts, arrived


def dense_grouped_matmul(x: np.ndarray, w: np.ndarray, group_sizes: np.ndarray) -> np.ndarray:
    """float64 reference of ragged_dot: rows of group e times w[e], rows past the sum zero."""
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for e, n in enumerate(group_sizes):
        end = min(start + int(n), x.shape[0])
        out[start:end] = x[start:end].astype(np.float64) @ w[e].astype(np.float64)
        start = end
    return out


def moe_mlp_reference(x, ids, weights, w_gate, w_up, w_down):
    """Single-device float32 jnp reference of moe_mlp over all experts (nothing dropped), differentiable.

    x (N, H), ids (N, K), weights (N, K), w_gate/w_up (E, H, F), w_down (E, F, H)."""
    import jax
    import jax.numpy as jnp

    def expert(e, row):
        return (jax.nn.silu(row @ w_gate[e]) * (row @ w_up[e])) @ w_down[e]

    per_choice = jax.vmap(lambda row, es: jax.vmap(lambda e: expert(e, row))(es))(x, ids)  # (N, K, H)
    return jnp.einsum("nkh,nk->nh", per_choice, weights)


def group_segments(group_sizes, m: int):
    """(group, first row, end row) of each group's rows, cut at m."""
    start = 0
    for e, size in enumerate(group_sizes):
        end = min(start + int(size), m)
        yield e, start, end
        start = end


def swiglu_experts_reference(x, w_gate, w_up, w_down, group_sizes, dy):
    """float32 NumPy forward and gradients of SwiGLU experts over contiguous groups of rows (pk_jax's
    expert_ffn): y (m, H), dx (m, H), dw_gate, dw_up (E, H, F), dw_down (E, F, H); rows past the sum zero."""
    m = x.shape[0]
    y, dx = np.zeros((m, w_down.shape[2]), np.float32), np.zeros_like(x)
    dwg, dwu, dwd = np.zeros_like(w_gate), np.zeros_like(w_up), np.zeros_like(w_down)
    for e, lo, hi in group_segments(group_sizes, m):
        xe, dye = x[lo:hi], dy[lo:hi]
        g, u = xe @ w_gate[e], xe @ w_up[e]
        s = 1 / (1 + np.exp(-g))
        h = g * s * u
        y[lo:hi] = h @ w_down[e]
        dh = dye @ w_down[e].T
        dwd[e] = h.T @ dye
        dg, du = dh * u * s * (1 + g * (1 - s)), dh * g * s
        dx[lo:hi] = dg @ w_gate[e].T + du @ w_up[e].T
        dwg[e], dwu[e] = xe.T @ dg, xe.T @ du
    return y, dx, dwg, dwu, dwd
