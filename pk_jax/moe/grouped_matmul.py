"""grouped_matmul: one matmul per expert over contiguous ragged groups of rows, like jax.lax.ragged_dot.

Reference paths (the fused Hopper grouped GEMM will replace them on GPUs):
- CPU: jax.lax.ragged_dot (XLA:CPU runs it in jax 0.11.2).
- elsewhere: ragged_dot lowers to a dense computation on GPUs (every row times every expert's matrix: E
  times the FLOPs and an (E, m, n) temporary), which does not fit at MoE sizes. Instead a scan over
  (row tile, group) pairs, as MegaBlocks schedules its grouped GEMM: rows are cut into tiles of `tile_rows`,
  and each pair multiplies one tile (rows outside the group masked) by that group's matrix. A tile meets
  at most the groups that start inside it, so there are at most ceil(m / tile) + E - 1 pairs: the work is
  m_used * k * n plus at most (E - 1) tiles' worth (pairs past the rows in use skip their GEMM), and the memory one tile and one expert matrix at a time.
The VJP is two grouped GEMMs on the same paths: dx = grouped(dy, w^T), dw[e] = x_e^T dy_e; an operand
replicated over an axis the rows are sharded over gets its gradient summed by pk_jax.all_reduce.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pk_jax.collectives import gradient_sum
from pk_jax.context._varying import full_varying, varying_axes

TILE_ROWS = 128


def _check(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"pk_jax.grouped_matmul: x must be (m, k) and w (E, k, n) with the same k, got "
                         f"x {x.shape}, w {w.shape}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"pk_jax.grouped_matmul: group_sizes must be integers of shape (E,) = ({w.shape[0]},), "
                         f"got {group_sizes.dtype} {group_sizes.shape}")


def _pairs(group_sizes: jax.Array, m: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, int]:
    """(tile index, group) of every (row tile, group) pair that holds rows, groups' starts and ends, and the
    static pair count bound (inactive pairs point at group 0 with an empty row range)."""
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    cum_sizes = jnp.cumsum(sizes)
    ends, starts = jnp.minimum(cum_sizes, m), jnp.minimum(cum_sizes - sizes, m)
    nonempty = ends > starts
    per_group = jnp.where(nonempty, (ends - 1) // tile - starts // tile + 1, 0)
    bound = -(-m // tile) + e - 1
    cum = jnp.cumsum(per_group)
    p = jnp.arange(bound, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, p, side="right"), e - 1).astype(jnp.int32)
    active = p < cum[-1]
    tile_index = jnp.where(active, starts[group] // tile + p - (cum[group] - per_group[group]), 0)
    starts = jnp.where(active, starts[group], 0)
    ends = jnp.where(active, ends[group], 0)
    return tile_index, group, starts, ends, bound


def _tile_rows(tile: int, m: int) -> int:
    return max(1, min(tile, m))


def _scan_pairs(x: jax.Array, group_sizes: jax.Array, tile: int, init: jax.Array, add) -> jax.Array:
    """Folds `add(acc, t, group, x_tile)` over the (row tile t, group) pairs, x_tile being x's rows of tile t
    masked to the group's rows; pairs past the real rows (the static bound assumes every row is used) skip."""
    m = x.shape[0]
    xp = jnp.pad(x, ((0, -(-m // tile) * tile - m), (0, 0)))
    tiles, groups, starts, ends, _ = _pairs(group_sizes, m, tile)

    def step(acc, pair):
        t, grp, lo, hi = pair

        def contribute(a):
            rows = t * tile + jnp.arange(tile)
            mask = ((rows >= lo) & (rows < hi))[:, None]
            return add(a, t, grp, jnp.where(mask, jax.lax.dynamic_slice_in_dim(xp, t * tile, tile), 0))

        return jax.lax.cond(hi > lo, contribute, lambda a: a, acc), None

    acc, _ = jax.lax.scan(step, init, (tiles, groups, starts, ends))
    return acc


def grouped_matmul_tiled(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile_rows: int = TILE_ROWS,
                         out_dtype=None) -> jax.Array:
    """(m, k) x (E, k, n) -> (m, n) by the (row tile, group) scan; rows past sum(group_sizes) are zero."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    m, n = x.shape[0], w.shape[2]
    tile = _tile_rows(tile_rows, m)

    def add(out, t, grp, xt):
        part = jnp.dot(xt, w[grp], preferred_element_type=jnp.float32)
        cur = jax.lax.dynamic_slice_in_dim(out, t * tile, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, cur + part, t * tile, 0)

    init = full_varying((-(-m // tile) * tile, n), 0, jnp.float32, (x, w, group_sizes))
    return _scan_pairs(x, group_sizes, tile, init, add)[:m].astype(out_dtype or x.dtype)


def grouped_weight_grad_tiled(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *,
                              tile_rows: int = TILE_ROWS, out_dtype=None) -> jax.Array:
    """(m, k), (m, n) -> (E, k, n): dw[e] = x_e^T dy_e over group e's rows, by the same pair scan."""
    x, dy = jnp.asarray(x), jnp.asarray(dy)
    m, k, n, e = x.shape[0], x.shape[1], dy.shape[1], group_sizes.shape[0]
    tile = _tile_rows(tile_rows, m)
    dyp = jnp.pad(dy, ((0, -(-m // tile) * tile - m), (0, 0)))

    def add(dw, t, grp, xt):
        part = jnp.dot(xt.T, jax.lax.dynamic_slice_in_dim(dyp, t * tile, tile), preferred_element_type=jnp.float32)
        return dw.at[grp].add(part)

    init = full_varying((e, k, n), 0, jnp.float32, (x, dy, group_sizes))
    return _scan_pairs(x, group_sizes, tile, init, add).astype(out_dtype or x.dtype)


def _forward(x, w, group_sizes, tile_rows):
    gs = group_sizes.astype(jnp.int32)
    on_cpu = lambda: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)
    tiled = lambda: grouped_matmul_tiled(x, w, gs, tile_rows=tile_rows)
    return jax.lax.platform_dependent(cpu=on_cpu, default=tiled)


def _weight_grad(x, dy, group_sizes, w_dtype, tile_rows):
    gs = group_sizes.astype(jnp.int32)

    def on_cpu():
        zero_w = full_varying((gs.shape[0], x.shape[1], dy.shape[1]), 0, jnp.float32, (x, dy, gs))
        _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x.astype(jnp.float32), w, gs), zero_w)
        return vjp(dy.astype(jnp.float32))[0].astype(w_dtype)

    tiled = lambda: grouped_weight_grad_tiled(x, dy, gs, tile_rows=tile_rows, out_dtype=w_dtype)
    return jax.lax.platform_dependent(cpu=on_cpu, default=tiled)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, group_sizes, tile_rows):
    return _forward(x, w, group_sizes, tile_rows)


def _grouped_fwd(x, w, group_sizes, tile_rows):
    return _forward(x, w, group_sizes, tile_rows), (x, w, group_sizes)


def _grouped_bwd(tile_rows, res, dy):
    x, w, group_sizes = res
    dx = _forward(dy, jnp.swapaxes(w, 1, 2), group_sizes, tile_rows).astype(x.dtype)
    dw = _weight_grad(x, dy, group_sizes, w.dtype, tile_rows)
    return _unvary_like(dx, x), _unvary_like(dw, w), None


def _unvary_like(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """Inside shard_map, an operand invariant over an axis that the cotangent varies over (e.g. weights
    replicated over the token axis) was implicitly broadcast: its cotangent is the sum over that axis
    (collectives.gradient_sum: pk_jax.all_reduce, float32 accumulation in rank order, one rounding)."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(primal), key=str))
    return gradient_sum(grad, extra, "grouped_matmul")


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile_rows: int = TILE_ROWS) -> jax.Array:
    """Multiplies contiguous groups of rows of x by their group's matrix, like `jax.lax.ragged_dot`.

    Args:
      x: (m, k); rows [sum(group_sizes[:e]), sum(group_sizes[:e+1])) form group e.
      w: (E, k, n), one matrix per group.
      group_sizes: (E,) int rows per group; sum <= m (rows past the sum give zero rows; a sum above m is
        cut at m).
      tile_rows: the row tile of the non-CPU reference scan (see the module docstring).

    Returns:
      (m, n) in x's dtype, accumulated in float32. Differentiable in x and w (grouped-GEMM VJP).
    """
    _check(x, w, group_sizes)
    return _grouped(x, w, group_sizes, tile_rows)
