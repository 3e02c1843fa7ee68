"""`pk_jax.sharding.matmul`: a matmul for plain `jax.jit` that lowers to the fused TP GEMMs.

Made with `jax.experimental.custom_partitioning` and a Shardy sharding rule. After propagation the
partitioner calls `_partition` with the shardings it chose; `matmul_decision.decide` picks AG+GEMM,
GEMM+RS, GEMM+AR or a local GEMM, and `matmul_shard.run_shard` is the per-device code, traced with
every mesh axis manual, so the fused ops reach their `pk_tp_gemm` kernels on GPUs.

The backward pass is two more such matmuls (dx = dy @ w^T, dw = x^T @ dy); each takes a "like"
operand (x, resp. w) whose sharding is the result sharding wanted, so the same rule picks e.g.
GEMM+RS for dx of a column-parallel layer and a k-gather + local GEMM for its dw.

Decisions are recorded when XLA partitions (at compile time) in `decisions` (a list of
`(role, MatmulDecision)`, role "forward", "dx" or "dw"), so tests and users can check the lowering.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax._src.sharding_impls import GSPMDSharding
from jax.sharding import NamedSharding, PartitionSpec

from pk_jax.sharding.matmul_decision import MatmulDecision, decide
from pk_jax.sharding.matmul_shard import run_shard

decisions: list[tuple[str, MatmulDecision]] = []  # appended at partition (compile) time; clear freely


def _spec(axes_per_dim) -> PartitionSpec:
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in axes_per_dim))


def _padded(sharding, ndim: int) -> tuple:
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
    else:  # no mesh known at lowering: every operand is gathered and the matmul runs replicated
        _warn_no_mesh()
        spec = ()
    return spec + (None,) * (ndim - len(spec))


@functools.cache
def _warn_no_mesh() -> None:
    warnings.warn("pk_jax.sharding.matmul: the partitioner gave shardings without a mesh, so the matmul runs "
                  "replicated. Place the inputs with NamedShardings or call under jax.set_mesh(mesh).", stacklevel=2)


def _partition(role: str, a_t: bool, b_t: bool, mesh, arg_shapes, result_shape):
    b, a = arg_shapes[0], arg_shapes[1]  # b first: see _make
    wanted = arg_shapes[2] if len(arg_shapes) == 3 else result_shape  # the "like" operand, if any
    # decide() reasons about a (rows..., k) and b (k, n); a stored (k, m) / b stored (n, k) are reversed.
    a_spec = _padded(a.sharding, a.ndim)[::-1] if a_t else _padded(a.sharding, a.ndim)
    b_spec = _padded(b.sharding, 2)[::-1] if b_t else _padded(b.sharding, 2)
    rows = a.shape[1:] if a_t else a.shape[:-1]
    decision = decide(a_spec, b_spec, _padded(wanted.sharding, len(rows) + 1), rows, dict(mesh.shape))
    decisions.append((role, decision))
    if mesh.empty:  # GSPMD shardings without a mesh: everything replicated (decision: local "matmul")
        replicated = GSPMDSharding.get_replicated(a.sharding._device_assignment)
        shard = lambda s: replicated
    else:
        shard = lambda s: NamedSharding(mesh, _spec(s))
    arg_shardings = [shard(decision.b_spec[::-1] if b_t else decision.b_spec),
                     shard(decision.a_spec[::-1] if a_t else decision.a_spec)]
    if len(arg_shapes) == 3:
        arg_shardings.append(wanted.sharding if not mesh.empty else shard(()))

        def lower(w, x, like):
            del like  # only its sharding matters
            return run_shard(decision, x, w, transpose_a=a_t, transpose_b=b_t)
    else:
        def lower(w, x):
            return run_shard(decision, x, w, transpose_a=a_t, transpose_b=b_t)
    return mesh, lower, shard(decision.out_spec), tuple(arg_shardings)


def _make(role: str, with_like: bool, transpose_a: bool = False, transpose_b: bool = False):
    """A custom-partitioned op(a) @ op(b), called as op(b, a[, like]): a (..., k) or, transpose_a, a stored
    (k, m); b (k, n) or, transpose_b, stored (n, k), read in place by the kernels (the backward's dx and dw).
    Shardy resolves conflicting factor shardings in favour of the earlier operand; with b first, a
    column-parallel weight's n sharding wins over a sequence-parallel input's row sharding, so the
    result stays column-sharded (what the next, row-parallel, matmul wants) instead of being resharded
    through an all-to-all."""
    a_dims, rows = ("k m", "m") if transpose_a else ("... k", "...")
    b_dims = "n k" if transpose_b else "k n"
    dims = (((0,) if transpose_a else (-1,)), ((1,) if transpose_b else (0,)))

    def reference(b, a, *like):
        ca, cb = dims[0][0] % a.ndim, dims[1][0]
        out = jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), preferred_element_type=jnp.float32)
        return out.astype(jnp.result_type(a, b))

    op = custom_partitioning(reference)
    rule = f"{b_dims}, {a_dims}" + (f", {rows} n" if with_like else "") + f" -> {rows} n"
    op.def_partition(functools.partial(_partition, role, transpose_a, transpose_b), sharding_rule=rule,
                     reduction_factors=("k",))
    return op


_forward = _make("forward", with_like=False)
_dx = _make("dx", with_like=True, transpose_b=True)                  # dy @ w^T, w read as stored (d, f)
_dw = _make("dw", with_like=True, transpose_a=True)                  # x^T @ dy, x read as stored (T, d)


@jax.custom_vjp
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return _forward(w, x)


def _matmul_fwd(x, w):
    return _forward(w, x), (x, w)


def _matmul_bwd(res, g):
    x, w = res
    g = g.astype(jnp.result_type(x, w))
    dx = _dx(w, g, x)
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dw = _dw(g2, x2, w)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w under plain `jax.jit`, lowered by the shardings XLA's partitioner chose.

    Args:
      x: (..., d) activations, any sharding (e.g. tokens over a data axis and/or the tensor axis).
      w: (d, f) weights (e.g. columns or rows over the tensor axis).

    Returns:
      (..., f) in jnp.result_type(x, w) (float32 accumulation). Sharded as the partitioner chose;
      constrain it (`jax.lax.with_sharding_constraint`) to ask for a reduce-scatter or all-reduce.

    Lowering: AG+GEMM when a token dim of x and the columns of w are sharded on the same axis;
    GEMM+RS when d is sharded and the result is wanted token-sharded on that axis; GEMM+AR when d is
    sharded otherwise; a local GEMM (`pk_jax.matmul`) when nothing needs communication. Inside
    `jax.shard_map` (all axes manual) it is a plain local matmul.
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"pk_jax.sharding.matmul: x must be (..., d) and w (d, f); got x{x.shape}, "
                         f"w{w.shape}. Transpose w if it is (f, d).")
    explicit = jax.sharding.get_abstract_mesh().explicit_axes
    if explicit:
        raise ValueError(f"pk_jax.sharding.matmul: mesh axes {explicit} are Explicit (jax.make_mesh's default); "
                         f"this op follows the partitioner's choices and needs Auto axes: make the mesh with "
                         f"axis_types=(jax.sharding.AxisType.Auto,) * ndim, or wrap the call in "
                         f"jax.sharding.auto_axes")
    if x.ndim == 1:
        return _matmul(x[None], w)[0]
    return _matmul(x, w)
