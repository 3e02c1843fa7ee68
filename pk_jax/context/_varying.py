"""Loop-carried values inside shard_map must carry the varying-axes type of what the loop body makes."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
from jax._src import core


def varying_axes(*xs: jax.Array) -> frozenset[Hashable]:
    """Union of the mesh axes over which the xs vary (empty outside shard_map or with check_vma off)."""
    out: frozenset = frozenset()
    for x in xs:
        out |= core.typeof(x).mat.varying
    return out


def full_varying(shape: Sequence[int], value: float, dtype, like: Sequence[jax.Array],
                 axes: Sequence[Hashable] = ()) -> jax.Array:
    """jnp.full typed as varying over the union of `like`'s varying axes and `axes`."""
    x = jnp.full(shape, value, dtype)
    want = varying_axes(*like) | (frozenset(axes) if varying_axes(*like) else frozenset())
    missing = tuple(a for a in sorted(want, key=str) if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
