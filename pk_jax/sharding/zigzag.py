"""The zigzag sequence layout for causal context parallelism (as ring-flash-attention and Megatron CP).

The global sequence is cut into 2G equal chunks; the zigzag order lists chunk r followed by chunk
2G-1-r for r = 0..G-1, so sharding it contiguously G ways gives member r chunks r and 2G-1-r: one
early and one late chunk each, which evens out causal attention work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np


def zigzag_chunk_order(groups: int) -> np.ndarray:
    """Global chunk index at each zigzag position: [0, 2G-1, 1, 2G-2, ..., G-1, G]."""
    if not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"pk_jax.sharding: groups={groups!r} must be a positive int (the shard count G)")
    r = np.arange(groups)
    return np.stack([r, 2 * groups - 1 - r], axis=1).reshape(-1)


def _split_axis(x: jax.Array, groups: int, axis: int, fn: str, outer: tuple[int, int]) -> tuple[jax.Array, int]:
    """Reshapes `axis` (length divisible by 2 * groups) into outer + (chunk,); returns it and the axis."""
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"pk_jax.sharding.{fn}: axis={axis} is out of range for rank {x.ndim}")
    axis %= x.ndim
    n = x.shape[axis]
    if n % (2 * groups):
        raise ValueError(f"pk_jax.sharding.{fn}: x.shape[{axis}]={n} must be divisible by 2 * groups = "
                         f"{2 * groups}; pad the sequence to a multiple of {2 * groups}")
    return x.reshape(x.shape[:axis] + outer + (n // (2 * groups),) + x.shape[axis + 1:]), axis


# Both directions are a reshape, a reversal of the late half's chunks and a transpose (no gather): chunk
# r sits at zigzag position 2r and chunk 2G-1-r, i.e. the late half reversed, at position 2r+1.
def to_zigzag(x: jax.Array, groups: int, axis: int = 1) -> jax.Array:
    """Global sequence order -> zigzag order along `axis` (its length divisible by 2 * groups)."""
    y, a = _split_axis(x, groups, axis, "to_zigzag", (2, groups))        # (..., half, G, C, ...)
    early, late = lax.index_in_dim(y, 0, a, keepdims=False), lax.index_in_dim(y, 1, a, keepdims=False)
    return jnp.stack([early, jnp.flip(late, axis=a)], axis=a + 1).reshape(jnp.shape(x))


def from_zigzag(x: jax.Array, groups: int, axis: int = 1) -> jax.Array:
    """Zigzag order -> global sequence order along `axis`; the inverse of to_zigzag."""
    y, a = _split_axis(x, groups, axis, "from_zigzag", (groups, 2))      # (..., G, piece, C, ...)
    early, late = lax.index_in_dim(y, 0, a + 1, keepdims=False), lax.index_in_dim(y, 1, a + 1, keepdims=False)
    return jnp.stack([early, jnp.flip(late, axis=a)], axis=a).reshape(jnp.shape(x))
