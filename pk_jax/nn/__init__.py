"""Tensor-parallel layers: plain functions (no flax needed) and, with flax installed
(`pip install pk_jax[flax]`), nnx modules over them. Each works inside `jax.shard_map` and under
plain `jax.jit`; see parallel_linear.py."""

from pk_jax.nn.parallel_linear import column_parallel_linear, parallel_mlp, row_parallel_linear

__all__ = ["column_parallel_linear", "parallel_mlp", "row_parallel_linear"]

try:  # flax is an optional extra
    from pk_jax.nn.flax_modules import ColumnParallelLinear, ParallelMLP, RowParallelLinear
except ImportError:  # pragma: no cover - exercised only without flax
    pass
else:
    __all__ += ["ColumnParallelLinear", "ParallelMLP", "RowParallelLinear"]
