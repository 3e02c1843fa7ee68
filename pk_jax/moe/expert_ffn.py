"""The experts' SwiGLU FFN on an MoE layer's received rows (moe_mlp's middle), touching only the rows in use.

expert_ffn(recv, counts, w_gate, w_up, w_down) = grouped(silu(grouped(recv, w_gate)) * grouped(recv, w_up), w_down)
over contiguous groups of rows (counts per local expert), as one custom VJP. An expert-parallel layer sizes recv
for the worst case (the default bound at G members is G times the average, so at G 4 about 3/4 of the rows are
never used); composed from grouped_matmul and jax.nn, every pass would write or read those rows too: the GEMMs
store zeros there, XLA's SwiGLU and its backward run over every row, and the input gradient of recv is the sum
of two (R, H) products, one more XLA pass over 3 (R, H) buffers. Here, on a GPU:
- the grouped GEMMs leave the rows past sum(counts) unwritten (kernel variant `notail`);
- SwiGLU and its backward run on the rows in use only (kernels/swiglu_rows.cu, counts read on the device);
- d recv = d_gate @ w_gateᵀ + d_up @ w_upᵀ is one grouped GEMM over both products (pk_grouped_matmul_sum: the
  second product's k-blocks follow the first's in one accumulator, one rounding).
So rows past sum(counts) of the result (and of d recv) are unspecified on a GPU: moe_mlp's combine and the
dispatch's transpose read only the rows that arrived. Every other platform (and calls the kernels do not take)
runs the reference paths with zeros there. The same float32 accumulation and one rounding per output either way.
PK_JAX_MOE_EXPERT_FFN=compose (trace time) makes moe_mlp compose grouped_matmul and jax.nn instead (A/B).
"""

from __future__ import annotations

import functools
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core, dispatch
from jax.interpreters import batching, mlir

from pk_jax import _ext

gm = importlib.import_module("pk_jax.moe.grouped_matmul")  # the module (pk_jax.moe.grouped_matmul is the function)

NO_TAIL = 16  # the grouped kernel's variant bit `notail` (grouped_gemm_kernel.cuh)
MODE_ENV = "PK_JAX_MOE_EXPERT_FFN"


def composed() -> bool:
    """Whether moe_mlp should compose grouped_matmul and jax.nn instead (PK_JAX_MOE_EXPERT_FFN=compose)."""
    mode = os.environ.get(MODE_ENV, "").strip().lower()
    if mode not in ("", "rows", "compose"):
        raise ValueError(f"{MODE_ENV}={mode!r}: expected 'rows' (the default) or 'compose'")
    return mode == "compose"


# (a, b, a2, b2, group_sizes) -> grouped(a, b) + grouped(a2, b2) in one accumulator (mode 0: w (E, k, n); mode 1:
# w (E, n, k) read transposed), one rounding to a's dtype.
grouped_sum_p = core.Primitive("pk_grouped_matmul_sum")


def _sum_reference(a, b, a2, b2, group_sizes, *, mode, variant=0):
    # One product over the concatenated contraction: the kernel's float32 accumulation and single rounding.
    k_axis = 2 if mode == gm.INPUT_GRAD else 1
    return gm._reference(jnp.concatenate([a, a2], axis=1), jnp.concatenate([b, b2], axis=k_axis), group_sizes,
                         mode=mode)


def _sum_abstract(a, b, a2, b2, group_sizes, *, mode, variant=0):
    n = b.shape[1] if mode == gm.INPUT_GRAD else b.shape[2]
    return gm.varying_like(a.update(shape=(a.shape[0], n), dtype=a.dtype), a, b, a2, b2, group_sizes)


def _sum_cuda(ctx, a, b, a2, b2, group_sizes, *, mode, variant=0):
    return jax.ffi.ffi_lowering("pk_grouped_matmul_sum")(ctx, a, b, a2, b2, group_sizes, mode=np.int32(mode),
                                                          tile=np.int32(-1), variant=np.int32(variant))


# (gate, up, group_sizes) -> silu(gate) * up on the rows in use; backward: (gate, up, d_hidden, group_sizes) ->
# (d_gate, d_up). float32 arithmetic, one rounding per output.
swiglu_p = core.Primitive("pk_swiglu_rows")
swiglu_bwd_p = core.Primitive("pk_swiglu_rows_bwd")
swiglu_bwd_p.multiple_results = True


def _swiglu_reference(gate, up, group_sizes):
    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)


def _swiglu_bwd_reference(gate, up, d_hidden, group_sizes):
    g, u, d = (t.astype(jnp.float32) for t in (gate, up, d_hidden))
    s = jax.nn.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).astype(gate.dtype), (d * g * s).astype(gate.dtype)


def _swiglu_abstract(gate, up, group_sizes):
    return gm.varying_like(gate.update(dtype=gate.dtype), gate, up, group_sizes)


def _swiglu_bwd_abstract(gate, up, d_hidden, group_sizes):
    out = gm.varying_like(gate.update(dtype=gate.dtype), gate, up, d_hidden, group_sizes)
    return out, out


def _register(p, abstract, reference, cuda_lowering):
    p.def_abstract_eval(abstract)
    p.def_impl(functools.partial(dispatch.apply_primitive, p))
    multiple = p.multiple_results

    def batch(args, dims, **params):
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)]
        out = jax.vmap(functools.partial(reference, **params))(*args)
        return out, ((0,) * len(out) if multiple else 0)

    batching.primitive_batchers[p] = batch
    mlir.register_lowering(p, lambda ctx, *args, **params: mlir.lower_fun(
        functools.partial(reference, **params), multiple_results=multiple)(ctx, *args))
    if _ext.available():
        mlir.register_lowering(p, cuda_lowering, platform="cuda")


_register(grouped_sum_p, _sum_abstract, _sum_reference, _sum_cuda)
_register(swiglu_p, _swiglu_abstract, _swiglu_reference, jax.ffi.ffi_lowering("pk_swiglu_rows"))
_register(swiglu_bwd_p, _swiglu_bwd_abstract, _swiglu_bwd_reference, jax.ffi.ffi_lowering("pk_swiglu_rows_bwd"))


def _input_grad_sum(d_gate, w_gate, d_up, w_up, gs, x_dtype, use_kernel, variant):
    d_gate, d_up = d_gate.astype(x_dtype), d_up.astype(x_dtype)
    return gm._with_kernel(
        lambda: _sum_reference(d_gate, w_gate, d_up, w_up, gs, mode=gm.INPUT_GRAD).astype(x_dtype),
        lambda: grouped_sum_p.bind(d_gate, w_gate, d_up, w_up, gs, mode=gm.INPUT_GRAD, variant=variant), use_kernel)


def _swiglu(gate, up, gs, use_kernel):
    return gm._with_kernel(lambda: _swiglu_reference(gate, up, gs), lambda: swiglu_p.bind(gate, up, gs), use_kernel)


def _swiglu_bwd(gate, up, d_hidden, gs, use_kernel):
    d_hidden = d_hidden.astype(gate.dtype)
    return gm._with_kernel(lambda: _swiglu_bwd_reference(gate, up, d_hidden, gs),
                           lambda: tuple(swiglu_bwd_p.bind(gate, up, d_hidden, gs)), use_kernel)


def _ffn_forward(recv, w_gate, w_up, w_down, gs, use_kernel, variant):
    tr = gm.TILE_ROWS
    gate = gm._forward(recv, w_gate, gs, tr, use_kernel, variant)
    up = gm._forward(recv, w_up, gs, tr, use_kernel, variant)
    hidden = _swiglu(gate, up, gs, use_kernel)
    return gm._forward(hidden, w_down, gs, tr, use_kernel, variant), (gate, up, hidden)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ffn(recv, w_gate, w_up, w_down, gs, use_kernel, variant):
    return _ffn_forward(recv, w_gate, w_up, w_down, gs, use_kernel, variant)[0]


def _ffn_fwd(recv, w_gate, w_up, w_down, gs, use_kernel, variant):
    y, (gate, up, hidden) = _ffn_forward(recv, w_gate, w_up, w_down, gs, use_kernel, variant)
    return y, (recv, w_gate, w_up, w_down, gs, gate, up, hidden)


def _ffn_bwd(use_kernel, variant, res, dy):
    recv, w_gate, w_up, w_down, gs, gate, up, hidden = res
    tr = gm.TILE_ROWS
    d_hidden = gm._input_grad(dy, w_down, gs, hidden.dtype, tr, use_kernel, variant)
    dw_down = gm._weight_grad(hidden, dy, gs, w_down.dtype, tr, use_kernel, variant)
    d_gate, d_up = _swiglu_bwd(gate, up, d_hidden, gs, use_kernel)
    d_recv = _input_grad_sum(d_gate, w_gate, d_up, w_up, gs, recv.dtype, use_kernel, variant)
    dw_gate = gm._weight_grad(recv, d_gate, gs, w_gate.dtype, tr, use_kernel, variant)
    dw_up = gm._weight_grad(recv, d_up, gs, w_up.dtype, tr, use_kernel, variant)
    grads = (d_recv, dw_gate, dw_up, dw_down)
    return tuple(gm._unvary_like(g, p) for g, p in zip(grads, (recv, w_gate, w_up, w_down))) + (None,)


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


def runs_kernels(recv, w_gate, w_down) -> bool:
    """Whether expert_ffn's passes run the GPU kernels (on a CUDA device) for rows like recv's (only its dtype and
    row length count): then it reads no row of recv, nor of its cotangent, past sum(counts)."""
    hidden = jax.ShapeDtypeStruct((1, w_down.shape[1]), recv.dtype)
    return _ext.available() and gm._kernel_unsupported(recv, w_gate) is None and \
        gm._kernel_unsupported(hidden, w_down) is None


def expert_ffn(recv: jax.Array, counts: jax.Array, w_gate: jax.Array, w_up: jax.Array,
               w_down: jax.Array) -> jax.Array:
    """SwiGLU experts over contiguous groups of rows: silu(x_e W_gate[e]) * (x_e W_up[e]) W_down[e].

    Args:
      recv: (R, H) rows grouped by expert (group e: rows [sum(counts[:e]), sum(counts[:e+1]))).
      counts: (L,) int rows per expert; sum <= R.
      w_gate, w_up: (L, H, F); w_down: (L, F, H); recv's dtype.

    Returns:
      (R, H) in recv's dtype. Rows past sum(counts) are unspecified where the kernels run (module docstring):
      read only the rows in use. Differentiable in recv and the three weights; d recv's rows past sum(counts)
      are unspecified likewise.
    """
    gs = counts.astype(jnp.int32)
    variant = gm._variant() | NO_TAIL
    return _ffn(recv, w_gate, w_up, w_down, gs, runs_kernels(recv, w_gate, w_down), variant)
