"""The backward pass of the fused TP GEMMs (pk_jax/tp_gemm.py), on fused kernels and in the input dtype.

Megatron-style sequence-parallel pairing: the gradient of one fused op is the other fused op.

  all_gather_matmul      y = AG(x) w      dx = RS(dy w^T)           matmul_reduce_scatter(dy, w, transpose_w)
                                          dw = AG(x)^T dy           matmul(gathered_x, dy, transpose_a)
  matmul_reduce_scatter  y = RS(h w)      (dh, AG(dy)) = AG(dy) w^T all_gather_matmul(dy, w, transpose_w,
                                                                                      return_gathered)
                                          dw = h^T AG(dy)           matmul(h, AG(dy), transpose_a)
  matmul_all_reduce      y = AR(h w)      dh = dy w^T, dw = h^T dy  matmul (twice, transpose_b / transpose_a)

Transposed operands are read in place (the layout flags), never copied. A forward with transpose_w
(w stored (n, k)) flips them: dx = RS(dy w), dw = dy^T AG(x) (stored (n, k) like w), and so on.

Every GEMM takes the operands' dtype (bf16/fp16 in, float32 accumulation inside, output in the input
dtype), as jnp.dot's VJP does. The GEMMs of the composition's own VJP (the previous backward) ran in
float32: its `dot(..., preferred_element_type=f32).astype(bf16)` made the VJP cast the cotangent and
operands to float32. Each backward op picks its own autotuned schedule; RS/AR `deterministic` carries over.

AG's dw needs the gathered x: the forward kernel writes it anyway (its second output) and it is kept
as the residual by default (TpSpec.save_gathered; False gathers x again in the backward).

Under `check_vma=True` a cotangent has its primal's varying axes: where the computed one varies over
more (a weight replicated over the group, used by every member), it is summed over those axes, as
jax's own transpose of the implicit pvary does.
"""

from __future__ import annotations

import jax
from jax._src import config, core
from jax._src.lax.parallel import insert_collective_pvary


def _vma(x) -> frozenset:
    """The mesh axes x varies over (empty unless shard_map checks vma)."""
    return frozenset(core.typeof(x).mat.varying) if config._check_vma.value else frozenset()


def _like_primal(ct: jax.Array, primal_vma: frozenset) -> jax.Array:
    """`ct` with the primal's varying axes: summed over the axes the primal does not vary over (its
    contributions from every member; through pk_jax.all_reduce, which ranks sharing a GPU can run),
    broadcast (pvary) over those it lacks."""
    from pk_jax import collectives

    ct = collectives.gradient_sum(ct, tuple(sorted(_vma(ct) - primal_vma, key=str)), "fused TP GEMM backward")
    missing = primal_vma - _vma(ct)
    if missing:
        ct = insert_collective_pvary(tuple(sorted(missing, key=str)), ct)
    return ct


def _name(spec):
    return spec.axis_name if len(spec.axis_name) > 1 else spec.axis_name[0]


def _weight_grad(spec, a: jax.Array, dy: jax.Array) -> jax.Array:
    """d op(w) for the product a op(w) = y: a^T dy (k, n), or for w stored (n, k) dy^T a."""
    from pk_jax.matmul import matmul

    return matmul(dy, a, transpose_a=True) if spec.transpose_w else matmul(a, dy, transpose_a=True)


def fused_fwd(x, w, spec):
    """custom_vjp forward: the fused op and the residuals of its backward."""
    from pk_jax.tp_gemm import pk_tp_gemm_p

    xv = insert_collective_pvary(spec.axis_name, x)
    out, aux = pk_tp_gemm_p.bind(xv, w, spec=spec)
    if x.dtype != w.dtype:  # mixed dtypes: the composition's VJP (it promotes, as jnp.dot does)
        return (out, aux), (x, w)
    if spec.op == "all_gather_matmul":
        # x[:0] carries x's type (vma) at no cost; the gathered x (or x itself, re-gathered later) for dw.
        return (out, aux), (x[:0], w, aux if spec.save_gathered else x)
    return (out, aux), (x, w)


def fused_bwd(spec, res, cts):
    """custom_vjp backward: (dx, dw) by the fused ops of the pairing above."""
    if res[0].dtype != res[1].dtype:
        return _composition_bwd(spec, res, cts)
    if spec.op == "all_gather_matmul":
        return _all_gather_matmul_bwd(spec, *res, *cts)
    dy = cts[0]  # RS/AR: the second output (partial product or empty) is scratch, its cotangent unused
    h, w = res
    if spec.op == "matmul_reduce_scatter":
        return _matmul_reduce_scatter_bwd(spec, h, w, dy)
    return _matmul_all_reduce_bwd(spec, h, w, dy)


def _all_gather_matmul_bwd(spec, x0, w, kept, dy, d_gathered):
    from pk_jax import collectives
    from pk_jax.tp_gemm import matmul_reduce_scatter

    name = _name(spec)
    # dx = RS(dy op(w)^T): w stored (k, n) is read transposed; stored (n, k) it is op(w)^T already.
    dx = matmul_reduce_scatter(dy, w, name, deterministic=spec.deterministic, transpose_w=not spec.transpose_w)
    gathered = kept if spec.save_gathered else collectives.all_gather(kept, name, axis=0, tiled=True)
    dw = _weight_grad(spec, gathered, dy)
    if spec.return_gathered:  # the caller saw the gathered x: its cotangent (zeros if unused) adds in
        dx = dx + collectives.reduce_scatter(d_gathered, name, scatter_dimension=0, tiled=True)
    return _like_primal(dx, _vma(x0)), _like_primal(dw, _vma(w))


def _matmul_reduce_scatter_bwd(spec, h, w, dy):
    from pk_jax.tp_gemm import all_gather_matmul

    dh, dy_gathered = all_gather_matmul(dy, w, _name(spec), return_gathered=True, transpose_w=not spec.transpose_w,
                                        deterministic=spec.deterministic)
    dw = _weight_grad(spec, h, dy_gathered)
    return _like_primal(dh, _vma(h)), _like_primal(dw, _vma(w))


def _matmul_all_reduce_bwd(spec, h, w, dy):
    from pk_jax import collectives
    from pk_jax.matmul import matmul

    # The transpose of psum: under vma typing a pvary (every member gets dy; no communication), without
    # it jax's psum transpose is a psum, kept here so results match the composition's gradient.
    if config._check_vma.value:
        dy = insert_collective_pvary(spec.axis_name, dy)
    else:
        dy = collectives.all_reduce(dy, _name(spec))
    dh = matmul(dy, w, transpose_b=not spec.transpose_w)
    return _like_primal(dh, _vma(h)), _like_primal(_weight_grad(spec, h, dy), _vma(w))


def _composition_bwd(spec, res, cts):
    """Mixed input dtypes: the VJP of the jax.lax composition, which the forward ran too (the kernel takes
    one dtype; the product is in the promoted dtype)."""
    x, w = res
    if spec.op == "all_gather_matmul":
        _, vjp = jax.vjp(spec.lax_apply, x, w)
        return vjp(cts)
    _, vjp = jax.vjp(lambda a, b: spec.lax_apply(a, b)[0], x, w)
    return vjp(cts[0])

