"""An all-to-all that runs on the side stream while XLA's stream computes (Ulysses' exchanges, issue 26 item 3).

Built from ring shifts at distances 1..G-1 (pk_jax/context/ring_shift.py; kernels/ring_shift.cu pushes buffer i to
member rank + dists[i]): member r sends its block for member r + d as buffer d and receives member r - d's block
for r. One shift launch carries up to MAX_BUFFERS blocks, so G - 1 blocks take ceil((G - 1) / 4) launches, queued
in order on the device's side stream. Like the ring's transfers:

    handle = all_to_all_start(x, axes, split_axis, concat_axis)
    ...compute that reads its inputs through after_token(..., *handle.tokens)...
    y = all_to_all_done(handle, after=result_of_that_compute)

y equals pk_jax.all_to_all(x, axes, split_axis, concat_axis, tiled=True). all_to_all_done waits for everything
issued on the side stream before it (ring_shift.shift_done), so a pipeline calls the done of step i before it
starts step i + 1's exchange. Not differentiable by itself: its user (ulysses) defines the VJP. Elsewhere (CPU, a
group the kernel cannot serve) the shifts lower to lax.ppermute, same values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from pk_jax.context.ring_shift import MAX_BUFFERS, shift_done, shift_start
from pk_jax.sharding import group_size

Axes = tuple[Hashable, ...]


@dataclasses.dataclass(frozen=True)
class Pending:
    """An all-to-all in flight over `axes`: this member's own block, and per launch (ys, token, the sent blocks,
    dists)."""
    own: jax.Array
    launches: tuple[tuple[tuple[jax.Array, ...], jax.Array, tuple[jax.Array, ...], tuple[int, ...]], ...]
    axes: Axes
    g: int
    concat_axis: int

    @property
    def tokens(self) -> tuple[jax.Array, ...]:
        return tuple(token for _, token, _, _ in self.launches)


def _block(x: jax.Array, index, g: int, axis: int) -> jax.Array:
    size = x.shape[axis] // g
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def all_to_all_start(x: jax.Array, axes: Axes, split_axis: int, concat_axis: int, *,
                     ctas: int | None = None) -> Pending:
    """Starts the tiled all-to-all of x over `axes` (x.shape[split_axis] divisible by G) on the side stream."""
    axes = tuple(axes)
    g = group_size(axes)
    for name, a in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        if not -x.ndim <= a < x.ndim:
            raise ValueError(f"pk_jax async all_to_all: {name}={a} is outside the {x.ndim} dimensions of x")
    split_axis, concat_axis = split_axis % x.ndim, concat_axis % x.ndim
    if x.shape[split_axis] % g:
        raise ValueError(f"pk_jax async all_to_all: dimension {split_axis} of {x.shape} is not divisible by G = {g}")
    rank = lax.axis_index(axes)
    own = _block(x, rank, g, split_axis)
    dists = list(range(1, g))
    launches = []
    for first in range(0, len(dists), MAX_BUFFERS):
        ds = tuple(dists[first:first + MAX_BUFFERS])
        sent = tuple(_block(x, (rank + d) % g, g, split_axis) for d in ds)
        ys, token = shift_start(sent, axes, ctas=ctas, dists=ds)
        launches.append((tuple(ys), token, sent, ds))
    return Pending(own, tuple(launches), axes, g, concat_axis)


def all_to_all_done(p: Pending, *, after=()) -> jax.Array:
    """The all-to-all's result: the G received blocks in source order along concat_axis. `after`: results that
    must be computed before the wait (the compute the exchange ran under)."""
    if p.g == 1:
        return p.own
    by_dist = [p.own] + [None] * (p.g - 1)
    for ys, token, sent, ds in p.launches:
        for d, y in zip(ds, shift_done(ys, token, keep_alive=sent, after=after)):
            by_dist[d] = y
    rank = lax.axis_index(p.axes)
    # Source s's block arrived at distance (rank - s) mod G.
    blocks = jnp.take(jnp.stack(by_dist), (rank - jnp.arange(p.g)) % p.g, axis=0)
    blocks = jnp.moveaxis(blocks, 0, p.concat_axis)
    shape = list(p.own.shape)
    shape[p.concat_axis] *= p.g
    return blocks.reshape(shape)
