"""`pk_jax.matmul`: C = A @ B on one GPU with pk_jax's own Hopper GEMM (kernels/gemm_kernel.cuh,
written on the LCSC template that the fused multi-GPU kernels extend).

Semantics are those of `jnp.dot(a, b, preferred_element_type=out_dtype)` for a (..., k) and b (k, n):
bfloat16/float16 inputs, float32 accumulation, output in the input dtype or float32. Calls the GPU
kernel cannot take (other dtypes, k or n not a multiple of 8, CPU) run `jnp.dot` itself, so results
never depend on where the code runs. Reverse-mode differentiable (the backward GEMMs run on the same
kernel, in the input dtype with float32 accumulation; forward mode is not defined) and vmappable.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config, core, dispatch
from jax.interpreters import batching, mlir

from pk_jax import _ext

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
TILES = ("auto", "128x256", "128x128", "64x128")  # block tiles of the kernel (rows x columns of C)

pk_matmul_p = core.Primitive("pk_matmul")


def _reference(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def _abstract_eval(a, b, *, out_dtype, tile):
    out = a.update(shape=(a.shape[0], b.shape[1]), dtype=out_dtype)
    if config._check_vma.value:
        varying = frozenset(a.mat.varying) | frozenset(b.mat.varying)
        out = out.update(manual_axis_type=a.mat.update(varying=varying))
    return out


pk_matmul_p.def_abstract_eval(_abstract_eval)
pk_matmul_p.def_impl(functools.partial(dispatch.apply_primitive, pk_matmul_p))


def _bind(a, b, out_dtype, tile):
    return pk_matmul_p.bind(a, b, out_dtype=out_dtype, tile=tile)


def _batch(args, dims, *, out_dtype, tile):
    a, b = args
    da, db = dims
    if db is None:  # b is shared: fold the batch into the rows of a, one GEMM
        a = jnp.moveaxis(a, da, 0)
        bsz, m, k = a.shape
        out = _bind(a.reshape(bsz * m, k), b, out_dtype, tile)
        return out.reshape(bsz, m, b.shape[1]), 0
    a = batching.bdim_at_front(a, da, b.shape[db])
    b = jnp.moveaxis(b, db, 0)
    return jax.vmap(lambda x, y: _reference(x, y, out_dtype))(a, b), 0


batching.primitive_batchers[pk_matmul_p] = _batch


def _lax_lowering(ctx, a, b, *, out_dtype, tile):
    return mlir.lower_fun(lambda x, y: _reference(x, y, out_dtype), multiple_results=False)(ctx, a, b)


def _cuda_lowering(ctx, a, b, *, out_dtype, tile):
    return jax.ffi.ffi_lowering("pk_matmul")(ctx, a, b, tile=np.int32(TILES.index(tile) - 1),
                                              compute_sms=np.int32(0))


mlir.register_lowering(pk_matmul_p, _lax_lowering)
if _ext.available():
    mlir.register_lowering(pk_matmul_p, _cuda_lowering, platform="cuda")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_2d(a, b, out_dtype, tile):
    return _bind(a, b, out_dtype, tile)


def _fwd(a, b, out_dtype, tile):
    return _bind(a, b, out_dtype, tile), (a, b)


def _bwd(out_dtype, tile, res, g):
    a, b = res
    g = g.astype(a.dtype)  # the backward GEMMs take the input dtype (fp32 accumulation), like the forward
    # dA = g @ B^T and dB = A^T @ g through `matmul`, so shapes the kernel cannot take (dB contracts
    # over M, which need not be a multiple of 8) run jnp.dot. The transposes are copies XLA makes.
    return matmul(g, b.T, out_dtype=a.dtype), matmul(a.T, g, out_dtype=b.dtype)


_matmul_2d.defvjp(_fwd, _bwd)


@functools.cache
def _note_fallback(why: str) -> None:
    warnings.warn(f"pk_jax.matmul: {why}; this call runs jnp.dot instead of the pk_jax kernel", stacklevel=3)


def matmul(a: jax.Array, b: jax.Array, *, out_dtype=None, tile: str = "auto") -> jax.Array:
    """C = a @ b with fp32 accumulation: `jnp.dot(a, b, preferred_element_type=out_dtype)`.

    Args:
      a: (..., k) array; leading dimensions are folded into the rows of one GEMM.
      b: (k, n) array of the same dtype as `a`.
      out_dtype: dtype of C: the input dtype (default) or float32.
      tile: "auto" (chosen from the shape and the GPU's SM count) or one of "128x256",
        "128x128", "64x128" to force the block tile (benchmarking; "128x256" has no float32 output).

    Returns:
      (..., n) array of `out_dtype`.

    The GPU kernel takes bfloat16/float16 inputs with k and n multiples of 8; other calls compute
    the same result with jnp.dot (and say so once).
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim < 1 or b.ndim != 2:
        raise ValueError(f"pk_jax.matmul: b must be 2-D (k, n) and a at least 1-D (..., k); got a{a.shape}, "
                         f"b{b.shape}. Reshape b, or use jnp.einsum for batched right-hand sides.")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"pk_jax.matmul: contraction sizes differ: a{a.shape}[-1] = {a.shape[-1]} but "
                         f"b{b.shape}[0] = {b.shape[0]}")
    if tile not in TILES:
        raise ValueError(f"pk_jax.matmul: tile={tile!r} is not one of {TILES}")
    in_dtype = jnp.result_type(a, b)
    out_dtype = jnp.dtype(in_dtype if out_dtype is None else out_dtype)
    k, n = b.shape
    lead = a.shape[:-1]
    why = None
    if a.dtype != b.dtype or a.dtype not in KERNEL_DTYPES:
        why = f"inputs are {a.dtype} and {b.dtype} (the kernel takes two bfloat16 or two float16 arrays)"
    elif out_dtype not in (a.dtype, jnp.dtype(jnp.float32)):
        why = f"out_dtype={out_dtype} (the kernel writes {a.dtype} or float32)"
    elif k % 8 or n % 8:
        why = f"k={k}, n={n} (the kernel needs both to be multiples of 8)"
    elif tile == "128x256" and out_dtype == jnp.float32:
        raise ValueError("pk_jax.matmul: tile='128x256' has no float32-output kernel; use 'auto' or '128x128'")
    if why is not None:
        if jax.default_backend() == "gpu":
            _note_fallback(why)
        return jnp.dot(a, b, preferred_element_type=jnp.promote_types(in_dtype, jnp.float32)).astype(out_dtype)
    m = int(np.prod(lead)) if lead else 1
    out = _matmul_2d(a.reshape(m, k), b, out_dtype, tile)
    return out.reshape(*lead, n)
