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
