"""Merging partial attention results by their log-sum-exp (the online softmax across blocks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Combines attention over two disjoint key sets into attention over their union.

    out_*: (B, T, N, H) float32, each normalized over its own keys; lse_*: (B, T, N) float32, -inf for a
    row that saw no key (its out is ignored). Returns (out, lse) over the union, float32.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)  # both -inf: weights 0, not nan
    w_a = jnp.exp(lse_a - safe)[..., None]
    w_b = jnp.exp(lse_b - safe)[..., None]
    return out_a * w_a + out_b * w_b, lse


def merge_many(outs: list[jax.Array], lses: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Attention over the union of disjoint key sets from each set's (out (B, T, N, H), lse (B, T, N)): float32
    out = sum_i exp(lse_i - L) out_i, lse L = logsumexp_i lse_i; rows where every lse is -inf: out 0, lse -inf."""
    lses = [x.astype(jnp.float32) for x in lses]
    m = lses[0]
    for x in lses[1:]:
        m = jnp.maximum(m, x)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    ws = [jnp.exp(x - safe) for x in lses]
    total = ws[0]
    for w in ws[1:]:
        total = total + w
    seen = total > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
    out = outs[0].astype(jnp.float32) * (ws[0] * inv)[..., None]
    for o, w in zip(outs[1:], ws[1:]):
        out = out + o.astype(jnp.float32) * (w * inv)[..., None]
    return out, jnp.where(seen, safe + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
