"""flax (nnx) modules over `pk_jax.nn.parallel_linear` (`pip install pk_jax[flax]`).

Parameters carry their sharding as `out_sharding` metadata (w: (None, tp) for column, (tp, None) for
row-parallel), so a model built under `jax.set_mesh(mesh)` is sharded as it is created (flax's eager
sharding), or `nnx.get_partition_spec(nnx.state(model))` gives the specs to place or to pass as
shard_map in_specs. Under plain `jax.jit` the modules see global parameters; inside `jax.shard_map`
the local blocks. `dtype` is the compute dtype (e.g. bfloat16 with float32 `param_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from pk_jax.nn.parallel_linear import column_parallel_linear, row_parallel_linear
from pk_jax.sharding.mesh_groups import AxisName

_default_init = nnx.initializers.lecun_normal()


def _cast(a: jax.Array | None, dtype) -> jax.Array | None:
    return a if a is None or dtype is None else a.astype(dtype)


class _ParallelLinear(nnx.Module):
    """Shared parameters of the column- and row-parallel layers (`split`: 1 = columns, 0 = rows)."""

    def __init__(self, in_features: int, out_features: int, split: int, *, axis_name: AxisName, use_bias: bool,
                 dtype, param_dtype, kernel_init, data_axis: AxisName | None, mesh: Mesh | None, rngs: nnx.Rngs):
        kernel_spec = (None, axis_name) if split == 1 else (axis_name, None)
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype),
                                out_sharding=kernel_spec)
        bias_spec = (axis_name,) if split == 1 else (None,)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype), out_sharding=bias_spec) if use_bias else None
        self.axis_name, self.dtype, self.data_axis, self.mesh = axis_name, dtype, data_axis, mesh

    def _operands(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        bias = None if self.bias is None else self.bias[...]
        return _cast(x, self.dtype), _cast(self.kernel[...], self.dtype), _cast(bias, self.dtype)


class ColumnParallelLinear(_ParallelLinear):
    """y = x @ kernel + bias, kernel (in, out) split on columns over `axis_name`.

    x (..., s, in) -> (..., s, out) split on the last dim. `sequence_parallel`: x's sequence dim is
    split over `axis_name` and gathered inside the GEMM (AG+GEMM)."""

    def __init__(self, in_features: int, out_features: int, *, axis_name: AxisName = "tensor",
                 sequence_parallel: bool = False, use_bias: bool = True, dtype=None, param_dtype=jnp.float32,
                 kernel_init=_default_init, data_axis: AxisName | None = None, mesh: Mesh | None = None,
                 rngs: nnx.Rngs):
        super().__init__(in_features, out_features, 1, axis_name=axis_name, use_bias=use_bias, dtype=dtype,
                         param_dtype=param_dtype, kernel_init=kernel_init, data_axis=data_axis, mesh=mesh, rngs=rngs)
        self.sequence_parallel = sequence_parallel

    def __call__(self, x: jax.Array) -> jax.Array:
        x, w, b = self._operands(x)
        return column_parallel_linear(x, w, b, axis_name=self.axis_name, sequence_parallel=self.sequence_parallel,
                                      data_axis=self.data_axis, mesh=self.mesh)


class RowParallelLinear(_ParallelLinear):
    """y = x @ kernel + bias, kernel (in, out) split on rows over `axis_name` (x's last dim split too).

    reduce="all": GEMM+AR, y replicated over `axis_name`; "scatter": GEMM+RS, y's sequence dim split
    over `axis_name` (sequence parallelism)."""

    def __init__(self, in_features: int, out_features: int, *, axis_name: AxisName = "tensor", reduce: str = "all",
                 use_bias: bool = True, dtype=None, param_dtype=jnp.float32, kernel_init=_default_init,
                 data_axis: AxisName | None = None, mesh: Mesh | None = None, rngs: nnx.Rngs):
        super().__init__(in_features, out_features, 0, axis_name=axis_name, use_bias=use_bias, dtype=dtype,
                         param_dtype=param_dtype, kernel_init=kernel_init, data_axis=data_axis, mesh=mesh, rngs=rngs)
        self.reduce = reduce

    def __call__(self, x: jax.Array) -> jax.Array:
        x, w, b = self._operands(x)
        return row_parallel_linear(x, w, b, axis_name=self.axis_name, reduce=self.reduce, data_axis=self.data_axis,
                                   mesh=self.mesh)


class ParallelMLP(nnx.Module):
    """Megatron MLP: ColumnParallelLinear(d -> hidden), activation, RowParallelLinear(hidden -> d).

    x (..., s, d) -> (..., s, d). With `sequence_parallel`, input and output are split on the
    sequence dim (AG+GEMM, then GEMM+RS); otherwise replicated over `axis_name` (GEMM, GEMM+AR)."""

    def __init__(self, features: int, hidden: int, *, axis_name: AxisName = "tensor", sequence_parallel: bool = False,
                 activation=jax.nn.gelu, use_bias: bool = True, dtype=None, param_dtype=jnp.float32,
                 data_axis: AxisName | None = None, mesh: Mesh | None = None, rngs: nnx.Rngs):
        kw = dict(axis_name=axis_name, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, data_axis=data_axis,
                  mesh=mesh, rngs=rngs)
        self.up = ColumnParallelLinear(features, hidden, sequence_parallel=sequence_parallel, **kw)
        self.down = RowParallelLinear(hidden, features, reduce="scatter" if sequence_parallel else "all", **kw)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.activation(self.up(x)))
