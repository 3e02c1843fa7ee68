"""The per-shard code of a sharded matmul: what one device runs for a `MatmulDecision`.

It runs where custom_partitioning's partition callback traces it, a context in which every mesh axis
is manual (like inside `jax.shard_map`), so the fused pk_jax ops find their group by axis name and
lower to the `pk_tp_gemm` custom call on GPUs (the composition on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import config, core
from jax._src.lax.parallel import pvary

import pk_jax
from pk_jax.sharding.matmul_decision import Axes, MatmulDecision


def _name(axes: Axes):
    return axes[0] if len(axes) == 1 else axes


def _rows_first(a: jax.Array, row_dim: int) -> tuple[jax.Array, tuple[int, ...]]:
    """a (rows..., k) -> (prod(rows), k) with row dim `row_dim` outermost, and that order's shape."""
    a = jnp.moveaxis(a, row_dim, 0)
    return a.reshape(-1, a.shape[-1]), a.shape[:-1]


def _rows_back(y: jax.Array, rows: tuple[int, ...], row_dim: int) -> jax.Array:
    """Inverse of `_rows_first` for the (R, n) product whose first row dim now has rows[0] * R / prod(rows)."""
    lead = y.shape[0] // max(1, _prod(rows[1:]))
    return jnp.moveaxis(y.reshape(lead, *rows[1:], y.shape[-1]), 0, row_dim)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _same_varying_axes(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map with check_vma, lets a and b vary over the same axes, as jnp.dot does
    implicitly (x replicated over tp times columns split over tp: x's cotangent is summed over tp)."""
    if not config._check_vma.value:
        return a, b
    va, vb = core.typeof(a).mat.varying, core.typeof(b).mat.varying
    return pvary(a, tuple(sorted(vb - va, key=str))), pvary(b, tuple(sorted(va - vb, key=str)))


def run_shard(decision: MatmulDecision, a: jax.Array, b: jax.Array, *, transpose_a: bool = False,
              transpose_b: bool = False) -> jax.Array:
    """a (rows..., k_local) @ b (k_local, n_local) on one shard, with the decision's collective.
    transpose_a: a is stored (k_local, m_local); transpose_b: b is stored (n_local, k_local). The GEMMs
    read them in place, except the fused ops' x, which has no transposed form: its local shard is
    transposed first.

    Returns the local block of the result, sharded as `decision.out_spec`."""
    if decision.gather_a_k:
        a = pk_jax.all_gather(a, _name(decision.gather_a_k), axis=0 if transpose_a else a.ndim - 1, tiled=True)
    if decision.gather_b_k:
        b = pk_jax.all_gather(b, _name(decision.gather_b_k), axis=1 if transpose_b else 0, tiled=True)
    group = _name(decision.group)
    if decision.op == "matmul":
        a, b = _same_varying_axes(a, b)
        return pk_jax.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    if transpose_a:
        a = a.T
    if decision.op == "matmul_all_reduce":
        y = pk_jax.matmul_all_reduce(a.reshape(-1, a.shape[-1]), b, group, transpose_w=transpose_b)
        return y.reshape(*a.shape[:-1], y.shape[-1])
    a2, rows = _rows_first(a, decision.row_dim)
    if decision.op == "all_gather_matmul":
        y = pk_jax.all_gather_matmul(a2, b, group, transpose_w=transpose_b)
    else:
        y = pk_jax.matmul_reduce_scatter(a2, b, group, transpose_w=transpose_b)
    return _rows_back(y, rows, decision.row_dim)
