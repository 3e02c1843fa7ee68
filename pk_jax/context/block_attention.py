"""Attention of one query block against one key/value block, with its log-sum-exp, and its backward.

The XLA path of block attention: pk_jax.attention's fallback and reference, the ring's backward, and
the ring's forward where our attention kernel does not take the call (float32, other head dims; the
ring binds the kernel itself otherwise, pk_jax/context/ring.py). XLA einsums with float32 accumulation, run over query chunks (lax.map / lax.scan) so that the
score matrix never exceeds SCORE_BYTES_BUDGET, whatever the block length.

Shapes: q (B, Tq, N, H); k, v (B, Tk, K, H) with K dividing N (GQA: query head n reads K/V head
n // (N / K), as jax.nn.dot_product_attention); out (B, Tq, N, H) float32; lse (B, Tq, N) float32.
Causal masks are placed by global positions: query row i sits at q_offset + i, key column j at
kv_offset + j, and the row sees the column when q_offset + i >= kv_offset + j. A row that sees no
column has lse = -inf and out = 0, so merging it changes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pk_jax.context._varying import full_varying

# Largest float32 score matrix one query chunk may materialize (the XLA path's working set).
SCORE_BYTES_BUDGET = 1 << 30
Offset = int | jax.Array


def query_chunk_rows(b: int, tq: int, n: int, tk: int, budget: int = SCORE_BYTES_BUDGET) -> int:
    """Rows per query chunk: the largest divisor of tq whose (B, N, rows, Tk) f32 scores fit `budget`."""
    cap = max(1, budget // (b * n * tk * 4))
    if tq <= cap:
        return tq
    return max(d for d in range(1, cap + 1) if tq % d == 0)


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    b, t, n, h = q.shape
    return q.reshape(b, t, kv_heads, n // kv_heads, h)


def _scores(q: jax.Array, k: jax.Array, scale: float, causal: bool, q_offset: Offset,
            kv_offset: Offset) -> jax.Array:
    """(B, K, R, Tq, Tk) float32 scaled scores, -inf where masked. q grouped (B, Tq, K, R, H)."""
    s = jnp.einsum("bqgrh,bkgh->bgrqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        rows = q_offset + lax.broadcasted_iota(jnp.int32, (q.shape[1], k.shape[1]), 0)
        cols = kv_offset + lax.broadcasted_iota(jnp.int32, (q.shape[1], k.shape[1]), 1)
        s = jnp.where(rows >= cols, s, -jnp.inf)
    return s


def _finite(x: jax.Array) -> jax.Array:
    """-inf (a row that sees nothing) -> 0, so exp(s - m) stays 0 instead of nan."""
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _chunk_fwd(q, k, v, scale, causal, q_offset, kv_offset):
    s = _scores(q, k, scale, causal, q_offset, kv_offset)
    m = _finite(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bgrqk,bkgh->bqgrh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    safe_l = jnp.where(l > 0, l, 1.0)
    o = o / jnp.moveaxis(safe_l[..., 0], -1, 1)[..., None]
    lse = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)[..., 0]  # (B, K, R, Tq)
    return o, jnp.moveaxis(lse, -1, 1)  # (B, Tq, K, R, H), (B, Tq, K, R)


def block_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, causal: bool,
                    q_offset: Offset = 0, kv_offset: Offset = 0) -> tuple[jax.Array, jax.Array]:
    """softmax(q k^T * scale + mask) v for one block pair -> (out float32 (B, Tq, N, H), lse (B, Tq, N))."""
    b, tq, n, h = q.shape
    kvh = k.shape[2]
    rows = query_chunk_rows(b, tq, n, k.shape[1])
    qg = _grouped(q, kvh)
    if rows == tq:
        o, lse = _chunk_fwd(qg, k, v, scale, causal, q_offset, kv_offset)
    else:
        chunks = qg.reshape(b, tq // rows, rows, *qg.shape[2:]).swapaxes(0, 1)
        starts = jnp.arange(tq // rows, dtype=jnp.int32) * rows
        o, lse = lax.map(lambda a: _chunk_fwd(a[0], k, v, scale, causal, q_offset + a[1], kv_offset),
                         (chunks, starts))
        o = o.swapaxes(0, 1).reshape(b, tq, *o.shape[3:])
        lse = lse.swapaxes(0, 1).reshape(b, tq, *lse.shape[3:])
    return o.reshape(b, tq, n, h), lse.reshape(b, tq, n)


def _chunk_bwd(q, k, v, do, lse, delta, scale, causal, q_offset, kv_offset):
    """One query chunk's (dq, dk, dv) in float32, recomputing P from the final lse (grouped layout)."""
    s = _scores(q, k, scale, causal, q_offset, kv_offset)
    lse_t = jnp.moveaxis(lse, 1, -1)[..., None]                     # (B, K, R, Tq, 1)
    p = jnp.exp(s - _finite(lse_t))                                 # masked -> exp(-inf) = 0
    dv = jnp.einsum("bgrqk,bqgrh->bkgh", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqgrh,bkgh->bgrqk", do, v, preferred_element_type=jnp.float32)
    ds = p * (dp - jnp.moveaxis(delta, 1, -1)[..., None]) * scale
    dq = jnp.einsum("bgrqk,bkgh->bqgrh", ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bgrqk,bqgrh->bkgh", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
    return dq, dk, dv


def block_attention_bwd(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array,
                        delta: jax.Array, *, scale: float, causal: bool, q_offset: Offset = 0,
                        kv_offset: Offset = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of one block pair's share of the attention, float32.

    lse (B, Tq, N) is the log-sum-exp of the row over the WHOLE sequence (the final forward's) and
    delta (B, Tq, N) = sum_h(do * out) of the final output, so P = exp(s - lse) is the row's global
    softmax restricted to this block and the pairs' gradients simply add up.
    Returns dq (B, Tq, N, H), dk and dv (B, Tk, K, H).
    """
    b, tq, n, h = q.shape
    kvh = k.shape[2]
    rows = query_chunk_rows(b, tq, n, k.shape[1])
    qg, dog = _grouped(q, kvh), _grouped(do, kvh)
    lse_g, delta_g = lse.reshape(b, tq, kvh, n // kvh), delta.reshape(b, tq, kvh, n // kvh)
    if rows == tq:
        dq, dk, dv = _chunk_bwd(qg, k, v, dog, lse_g, delta_g, scale, causal, q_offset, kv_offset)
    else:
        split = lambda x: x.reshape(b, tq // rows, rows, *x.shape[2:]).swapaxes(0, 1)
        starts = jnp.arange(tq // rows, dtype=jnp.int32) * rows

        def body(acc, a):
            dq_c, dk_c, dv_c = _chunk_bwd(a[0], k, v, a[1], a[2], a[3], scale, causal, q_offset + a[4],
                                          kv_offset)
            return (acc[0] + dk_c, acc[1] + dv_c), dq_c

        zeros = full_varying(k.shape, 0.0, jnp.float32, like=(q, k, v, do, lse, delta))
        (dk, dv), dq = lax.scan(body, (zeros, zeros),
                                (split(qg), split(dog), split(lse_g), split(delta_g), starts))
        dq = dq.swapaxes(0, 1).reshape(b, tq, *dq.shape[3:])
    return dq.reshape(b, tq, n, h), dk, dv
