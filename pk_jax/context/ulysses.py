"""Ulysses (DeepSpeed) sequence parallelism: trade the sequence sharding for a head sharding.

An all-to-all turns each member's (B, S/G, N, H) into (B, S, N/G, H): the whole sequence for N/G
heads. Attention then runs locally and unchanged (jax.nn.dot_product_attention), and a second
all-to-all restores the sequence sharding. Both all-to-alls are pk_jax.all_to_all (device-initiated
on GPUs, jax.lax.all_to_all elsewhere) and differentiable, so jax.grad needs nothing extra. The
price: the full-sequence K/V of N/G heads lives on every member, and G must divide the head count.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from pk_jax.collectives import all_to_all
from pk_jax.context.ring import check_attention_args
from pk_jax.context.ring_schedule import Layout
from pk_jax.sharding import group_size
from pk_jax.sharding.mesh_groups import AxisName
from pk_jax.sharding.zigzag import from_zigzag, to_zigzag


def kv_head_replication(kv_heads: int, q_heads: int, g: int) -> int:
    """How many times each K/V head is repeated so that G divides the K/V head count (1 if it does).

    With K not divisible by G, every K/V head is repeated rep = G / gcd(K, G) times in place (head j
    becomes heads j*rep .. j*rep+rep-1), which keeps query head n on its K/V head n // (N / K) and makes
    K * rep divisible by G; it needs N divisible by G, as Ulysses always does.
    """
    rep = g // math.gcd(kv_heads, g)
    assert (q_heads // kv_heads) % rep == 0, (kv_heads, q_heads, g)
    return rep


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: AxisName, *, causal: bool = False,
                      scale: float | None = None, layout: Layout = "contiguous",
                      implementation: Literal["xla", "cudnn"] | None = None) -> jax.Array:
    """Attention over a sequence sharded along `axis_name` by head-parallel all-to-alls.

    Call inside `jax.shard_map` with the sequence axis of q, k, v sharded over `axis_name` (G members).

    Args:
      q: (B, T, N, H) this member's queries, T = S / G; G must divide N.
      k, v: (B, T, K, H), K dividing N. If G does not divide K, each K/V head is replicated
        G / gcd(K, G) times before the exchange (see kv_head_replication) instead of failing.
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
      causal: mask key positions after the query's global position.
      scale: score scale, default 1/sqrt(H).
      layout: "contiguous" (member r holds positions [r T, (r+1) T)) or "zigzag" (the order of
        pk_jax.sharding.to_zigzag, as ring_attention's default); the result keeps the input's layout.
      implementation: passed to jax.nn.dot_product_attention for the local attention.

    Returns:
      (B, T, N, H) in q's dtype: this member's rows of the attention output.
    """
    check_attention_args("ulysses_attention", q, k, v)
    g = group_size(axis_name)
    n, kv_heads = q.shape[2], k.shape[2]
    if n % g:
        raise ValueError(f"pk_jax.ulysses_attention: the group size {g} must divide the query heads ({n}); "
                         f"use ring_attention, or a smaller sequence-parallel axis")
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"pk_jax.ulysses_attention: layout={layout!r}; use 'zigzag' or 'contiguous'")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"pk_jax.ulysses_attention: layout='zigzag' needs an even local sequence length; "
                         f"got {q.shape[1]}")
    rep = kv_head_replication(kv_heads, n, g)
    if rep > 1:
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)

    def to_heads(x):  # (B, T, heads, H) -> (B, S, heads / G, H), global sequence order
        x = all_to_all(x, axis_name, 2, 1, tiled=True)
        return from_zigzag(x, g, axis=1) if layout == "zigzag" else x

    out = jax.nn.dot_product_attention(to_heads(q), to_heads(k), to_heads(v), scale=scale, is_causal=causal,
                                       implementation=implementation)
    if layout == "zigzag":
        out = to_zigzag(out, g, axis=1)
    return all_to_all(out, axis_name, 1, 2, tiled=True)
