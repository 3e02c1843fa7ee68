"""`pk_jax.matmul`: C = A @ B on one GPU with pk_jax's own Hopper GEMM (kernels/gemm_kernel.cuh,
written on the LCSC template that the fused multi-GPU kernels extend).

Semantics are those of `jnp.dot(a, b, preferred_element_type=out_dtype)` for a (..., k) and b (k, n):
bfloat16/float16 inputs, float32 accumulation, output in the input dtype or float32. `transpose_a` /
`transpose_b` take a stored (k, m) / b stored (n, k) and read them in place (the kernel's TMA boxes
and wgmma's transpose bits; no transposes in HBM), as `lax.dot_general` with those contracting dims.
Calls the GPU kernel cannot take (other dtypes, a stored row length or n not a multiple of 8, CPU)
run `lax.dot_general` itself, so results never depend on where the code runs. Reverse-mode
differentiable (the backward GEMMs run on the same kernel with transposed layouts, in the input
dtype with float32 accumulation; forward mode is not defined) and vmappable.
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


def _dims(a_ndim: int, transpose_a: bool, transpose_b: bool) -> tuple:
    """dot_general dimension numbers of op(a) @ op(b): a (..., k) or (k, m), b (k, n) or (n, k)."""
    return ((0 if transpose_a else a_ndim - 1,), (1 if transpose_b else 0,)), ((), ())


def _reference(a: jax.Array, b: jax.Array, out_dtype, transpose_a: bool = False,
               transpose_b: bool = False) -> jax.Array:
    """op(a) @ op(b) with float32 accumulation in out_dtype (the fallback and the semantics). Where
    out_dtype is the input dtype the dot outputs it directly, as jnp.dot does (XLA accumulates 16-bit
    products in float32), so the jaxpr/HLO holds no float32 GEMM for bf16/fp16 GEMMs."""
    in_dtype = jnp.result_type(a, b)
    dims = _dims(a.ndim, transpose_a, transpose_b)
    if jnp.dtype(out_dtype) in (in_dtype, jnp.dtype(jnp.float32)) and jnp.issubdtype(in_dtype, jnp.floating):
        return jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype)
    acc = jnp.promote_types(in_dtype, jnp.float32)
    return jax.lax.dot_general(a, b, dims, preferred_element_type=acc).astype(out_dtype)


def _abstract_eval(a, b, *, out_dtype, tile, transpose_a, transpose_b):
    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    out = a.update(shape=(m, n), dtype=out_dtype)
    if config._check_vma.value:
        varying = frozenset(a.mat.varying) | frozenset(b.mat.varying)
        out = out.update(manual_axis_type=a.mat.update(varying=varying))
    return out


pk_matmul_p.def_abstract_eval(_abstract_eval)
pk_matmul_p.def_impl(functools.partial(dispatch.apply_primitive, pk_matmul_p))


def _bind(a, b, out_dtype, tile, transpose_a=False, transpose_b=False):
    return pk_matmul_p.bind(a, b, out_dtype=out_dtype, tile=tile, transpose_a=transpose_a, transpose_b=transpose_b)


def _batch(args, dims, *, out_dtype, tile, transpose_a, transpose_b):
    a, b = args
    da, db = dims
    if db is None and not transpose_a:  # b is shared: fold the batch into the rows of a, one GEMM
        a = jnp.moveaxis(a, da, 0)
        bsz, m, k = a.shape
        out = _bind(a.reshape(bsz * m, k), b, out_dtype, tile, False, transpose_b)
        return out.reshape(bsz, m, out.shape[1]), 0
    size = a.shape[da] if da is not None else b.shape[db]
    a = batching.bdim_at_front(a, da, size)
    b = batching.bdim_at_front(b, db, size)
    return jax.vmap(lambda x, y: _reference(x, y, out_dtype, transpose_a, transpose_b))(a, b), 0


batching.primitive_batchers[pk_matmul_p] = _batch


def _lax_lowering(ctx, a, b, *, out_dtype, tile, transpose_a, transpose_b):
    return mlir.lower_fun(lambda x, y: _reference(x, y, out_dtype, transpose_a, transpose_b),
                          multiple_results=False)(ctx, a, b)


def _cuda_lowering(ctx, a, b, *, out_dtype, tile, transpose_a, transpose_b):
    return jax.ffi.ffi_lowering("pk_matmul")(ctx, a, b, tile=np.int32(TILES.index(tile) - 1),
                                              compute_sms=np.int32(0), transpose_a=np.int32(transpose_a),
                                              transpose_b=np.int32(transpose_b))


mlir.register_lowering(pk_matmul_p, _lax_lowering)
if _ext.available():
    mlir.register_lowering(pk_matmul_p, _cuda_lowering, platform="cuda")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _matmul_2d(a, b, out_dtype, tile, transpose_a, transpose_b):
    return _bind(a, b, out_dtype, tile, transpose_a, transpose_b)


def _fwd(a, b, out_dtype, tile, transpose_a, transpose_b):
    return _bind(a, b, out_dtype, tile, transpose_a, transpose_b), (a, b)


def _bwd(out_dtype, tile, transpose_a, transpose_b, res, g):
    a, b = res
    g = g.astype(a.dtype)  # the backward GEMMs take the input dtype (fp32 accumulation), like the forward
    # With A = op(a), B = op(b): dA = g Bᵀ, dB = Aᵀ g, each read in place through the layout flags
    # (no transposes in HBM). A stored-transposed operand gets the transposed gradient
    # (da = dAᵀ = B gᵀ, db = dBᵀ = gᵀ A). Through `matmul`, so shapes the kernel cannot take run
    # lax.dot_general.
    if transpose_a:
        da = matmul(b, g, out_dtype=a.dtype, transpose_a=transpose_b, transpose_b=True)
    else:
        da = matmul(g, b, out_dtype=a.dtype, transpose_b=not transpose_b)
    if transpose_b:
        db = matmul(g, a, out_dtype=b.dtype, transpose_a=True, transpose_b=transpose_a)
    else:
        db = matmul(a, g, out_dtype=b.dtype, transpose_a=not transpose_a)
    return da, db


_matmul_2d.defvjp(_fwd, _bwd)


@functools.cache
def _note_fallback(why: str) -> None:
    warnings.warn(f"pk_jax.matmul: {why}; this call runs jnp.dot instead of the pk_jax kernel", stacklevel=3)


def matmul(a: jax.Array, b: jax.Array, *, out_dtype=None, transpose_a: bool = False,
           transpose_b: bool = False, tile: str = "auto") -> jax.Array:
    """C = op(a) @ op(b) with fp32 accumulation: `jnp.dot(a, b, preferred_element_type=out_dtype)`,
    where op transposes a stored-transposed operand in place (no copy).

    Args:
      a: (..., k) array (leading dimensions are folded into the rows of one GEMM), or with
        `transpose_a` a 2-D (k, m) array (e.g. activations (tokens, d) for a weight gradient aᵀ g).
      b: (k, n) array of the same dtype as `a`, or with `transpose_b` (n, k) (e.g. a weight (f, d)
        for an input gradient g bᵀ).
      out_dtype: dtype of C: the input dtype (default) or float32.
      transpose_a: a is stored (k, m); C = aᵀ @ op(b).
      transpose_b: b is stored (n, k); C = op(a) @ bᵀ.
      tile: "auto" (chosen from the shape and the GPU's SM count) or one of "128x256",
        "128x128", "64x128" to force the block tile (benchmarking; "128x256" has no float32 output).

    Returns:
      (..., n) array of `out_dtype` ((m, n) with `transpose_a`).

    The GPU kernel takes bfloat16/float16 inputs whose stored rows (a's and b's last dimension) and n
    are multiples of 8 (TMA rows of 16 bytes); other calls compute the same result with
    lax.dot_general (and say so once).
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    b_form = "(n, k)" if transpose_b else "(k, n)"
    if b.ndim != 2 or a.ndim < 1 or (transpose_a and a.ndim != 2):
        a_form = "2-D (k, m) with transpose_a=True" if transpose_a else "at least 1-D (..., k)"
        raise ValueError(f"pk_jax.matmul: b must be 2-D {b_form} and a {a_form}; got a{a.shape}, b{b.shape}. "
                         f"Reshape the operands, or use jnp.einsum for batched right-hand sides.")
    a_k, b_k = (0 if transpose_a else a.ndim - 1), (1 if transpose_b else 0)
    if a.shape[a_k] != b.shape[b_k]:
        raise ValueError(f"pk_jax.matmul: contraction sizes differ: a{a.shape}[{a_k}] = {a.shape[a_k]} but "
                         f"b{b.shape}[{b_k}] = {b.shape[b_k]} (transpose_a={transpose_a}, transpose_b={transpose_b})")
    if tile not in TILES:
        raise ValueError(f"pk_jax.matmul: tile={tile!r} is not one of {TILES}")
    in_dtype = jnp.result_type(a, b)
    out_dtype = jnp.dtype(in_dtype if out_dtype is None else out_dtype)
    transpose_a, transpose_b = bool(transpose_a), bool(transpose_b)
    n = b.shape[0] if transpose_b else b.shape[1]
    why = None
    if a.dtype != b.dtype or a.dtype not in KERNEL_DTYPES:
        why = f"inputs are {a.dtype} and {b.dtype} (the kernel takes two bfloat16 or two float16 arrays)"
    elif out_dtype not in (a.dtype, jnp.dtype(jnp.float32)):
        why = f"out_dtype={out_dtype} (the kernel writes {a.dtype} or float32)"
    elif a.shape[-1] % 8 or b.shape[1] % 8 or n % 8:
        why = (f"a{a.shape}, b{b.shape} (the kernel needs the stored rows of a and b and n = {n} to be "
               f"multiples of 8)")
    elif tile == "128x256" and out_dtype == jnp.float32:
        raise ValueError("pk_jax.matmul: tile='128x256' has no float32-output kernel; use 'auto' or '128x128'")
    if why is not None:
        if jax.default_backend() == "gpu":
            _note_fallback(why)
        return _reference(a, b, out_dtype, transpose_a, transpose_b)
    if transpose_a:
        return _matmul_2d(a, b, out_dtype, tile, True, transpose_b)
    k, lead = a.shape[-1], a.shape[:-1]
    m = int(np.prod(lead)) if lead else 1
    out = _matmul_2d(a.reshape(m, k), b, out_dtype, tile, False, transpose_b)
    return out.reshape(*lead, n)
