"""Tensor-parallel dense layers as plain functions (no flax needed), Megatron style.

Each works in two contexts, found from the mesh in scope:
- inside `jax.shard_map` with `axis_name` manual: arrays are local shards and the layer calls the
  fused ops directly (`all_gather_matmul`, `matmul_reduce_scatter`, `matmul_all_reduce`);
- under plain `jax.jit` (global arrays, shardings from NamedShardings): the layer calls
  `pk_jax.sharding.matmul` and constrains its output, so the partitioner lowers to the same fused
  ops. The mesh is `mesh=` or the one set by `jax.set_mesh`.

Shapes (G = size of `axis_name`; "global" under jit, local shards inside shard_map):
  column_parallel_linear: x (..., s, d) -> (..., s, f); w (d, f) with f split over G.
  row_parallel_linear:    x (..., s, f) with f split over G -> (..., s, d); w (f, d) split on rows.
With sequence parallelism the sequence dim `s` (the second last; the token dim of a 2-D x) of the
column layer's input and of the row layer's output (reduce="scatter") is split over G.
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pk_jax.sharding.jit_matmul import matmul as jit_matmul
from pk_jax.sharding.matmul_decision import MatmulDecision
from pk_jax.sharding.matmul_shard import run_shard
from pk_jax.sharding.mesh_groups import AxisName, normalize_axis_name

REDUCTIONS = ("all", "scatter")


def _in_shard_map(axes: tuple[Hashable, ...]) -> bool:
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return all(a in manual for a in axes)


def _shard_op(op: str, axes: tuple[Hashable, ...], x: jax.Array, w: jax.Array) -> jax.Array:
    """The per-shard fused op (the row dim is the sequence dim, x.ndim - 2)."""
    decision = MatmulDecision(op, axes if op != "matmul" else (), x.ndim - 2, (), (), (), (), ())
    return run_shard(decision, x, w)


def _constrain(y: jax.Array, mesh: Mesh | None, seq: tuple, last: tuple, data_axis) -> jax.Array:
    """Under jit: y's sharding = (data_axis on dim 0, `seq` on the sequence dim, `last` on the last)."""
    if mesh is None and jax.sharding.get_abstract_mesh().empty:
        raise ValueError("pk_jax.nn: under plain jax.jit the layer needs a mesh: pass mesh= or call it "
                         "inside `with jax.set_mesh(mesh):`")
    dims: list = [None] * y.ndim
    lead = normalize_axis_name(data_axis) if data_axis is not None else ()
    if y.ndim == 2:
        dims[0] = lead + seq
    else:
        dims[0], dims[-2] = lead, seq
    spec = PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in dims[:-1]),
                         None if not last else last[0] if len(last) == 1 else last)
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec) if mesh is not None else spec)


def _add_bias(y: jax.Array, b: jax.Array | None) -> jax.Array:
    return y if b is None else y + b.astype(y.dtype)


def column_parallel_linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, axis_name: AxisName,
                           sequence_parallel: bool = False, data_axis: AxisName | None = None,
                           mesh: Mesh | None = None) -> jax.Array:
    """x @ w + b with w's columns (and b) split over `axis_name`; output columns stay split.

    Args:
      x: (..., s, d); with `sequence_parallel` its sequence dim is split over `axis_name` and is
        gathered inside the GEMM (AG+GEMM); otherwise x is replicated over `axis_name`.
      w: (d, f) (inside shard_map: the local (d, f / G) block). b: (f,) or None.
      axis_name: the tensor-parallel mesh axis (or tuple of axes).
      data_axis: under jit, the mesh axis that splits x's first dim (data parallelism), if any.
      mesh: under jit, the mesh (default: the one set by `jax.set_mesh`).

    Returns:
      (..., s, f) with f split over `axis_name` (local (..., s, f / G) inside shard_map).
    """
    axes = normalize_axis_name(axis_name)
    if _in_shard_map(axes):
        y = _shard_op("all_gather_matmul" if sequence_parallel else "matmul", axes, x, w)
    else:
        y = _constrain(jit_matmul(x, w), mesh, (), axes, data_axis)
    return _add_bias(y, b)


def row_parallel_linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, axis_name: AxisName,
                        reduce: str = "all", data_axis: AxisName | None = None,
                        mesh: Mesh | None = None) -> jax.Array:
    """x @ w + b with the contraction split over `axis_name`, the partial sums reduced in the GEMM.

    Args:
      x: (..., s, f) with f split over `axis_name` (the column-parallel layer's output).
      w: (f, d) (inside shard_map: the local (f / G, d) block). b: (d,) or None.
      reduce: "all" (GEMM+AR: the output replicated over `axis_name`) or "scatter" (GEMM+RS: the
        output's sequence dim split over `axis_name`, for sequence parallelism).
      axis_name, data_axis, mesh: as in `column_parallel_linear`.

    Returns:
      (..., s, d); with reduce="scatter" the sequence dim split over `axis_name` (local s / G).
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"pk_jax.nn.row_parallel_linear: reduce={reduce!r}; use 'all' (all-reduce) or "
                         f"'scatter' (reduce-scatter over the sequence dim, for sequence parallelism)")
    axes = normalize_axis_name(axis_name)
    if _in_shard_map(axes):
        y = _shard_op("matmul_reduce_scatter" if reduce == "scatter" else "matmul_all_reduce", axes, x, w)
    else:
        y = _constrain(jit_matmul(x, w), mesh, axes if reduce == "scatter" else (), (), data_axis)
    return _add_bias(y, b)


def parallel_mlp(x: jax.Array, w_in: jax.Array, w_out: jax.Array, b_in: jax.Array | None = None,
                 b_out: jax.Array | None = None, *, axis_name: AxisName, sequence_parallel: bool = False,
                 activation=jax.nn.gelu, data_axis: AxisName | None = None, mesh: Mesh | None = None) -> jax.Array:
    """activation(x @ w_in + b_in) @ w_out + b_out: column-parallel, then row-parallel.

    x: (..., s, d) (sequence dim split over `axis_name` with `sequence_parallel`); w_in (d, f),
    w_out (f, d). Returns (..., s, d), sequence-split with `sequence_parallel` (GEMM+RS), else
    replicated over `axis_name` (GEMM+AR)."""
    kw = dict(axis_name=axis_name, data_axis=data_axis, mesh=mesh)
    h = activation(column_parallel_linear(x, w_in, b_in, sequence_parallel=sequence_parallel, **kw))
    return row_parallel_linear(h.astype(x.dtype), w_out, b_out, reduce="scatter" if sequence_parallel else "all", **kw)
