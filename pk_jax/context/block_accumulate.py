"""One ring step's attention block written or merged into the ring's float32 state in place, forward and backward.

    acc, lse = accumulate(q, k, v, offsets, acc, lse, row_start=r, merge=m, scale=s, causal=c)

q (B, Tq, N, D) are rows [r, r + Tq) of the state: acc (B, S, N, D) float32 and lse (B, N, S) float32 (the
attention kernel's layout). merge=False writes those rows (attention of q against k, v and its LSE); merge=True
combines them with what the rows hold (online softmax, as online_softmax.merge). On GPUs this is the attention
kernel with its float32 accumulating epilogue (`pk_attention_accumulate`, acc and lse aliased: no copy of the
state, no merge pass, no dynamic-update-slice, no conversion of the block); elsewhere the same thing in XLA.

Why: on 4x H100 the ring's causal zigzag forward spent ~1.9 ms of 7.6 in XLA glue around 4.8 ms of attention
kernels (the step-0 concatenation, merges, dynamic-update-slices, a copy of the whole state per lax.cond step),
issue 26's "partial outputs merged with the LSE in-kernel". Used by ring attention's forward (every layout) when
$PK_JAX_RING_MERGE=kernel (default "dq": the forward's merges by XLA).

    dq, dk, dv = accumulate_bwd(q, k, v, do, lse, delta, offsets, dq, row_start=r, scale=s, causal=c)

The backward's counterpart: a block pair's dK, dV, and its dQ added into rows [r, r + Tq) of the ring's float32
dQ state (B, S, N, D) by the dQ conversion kernel in place (`pk_attention_bwd_accumulate`); on 4x H100 the add,
its dynamic-update-slice and a copy of the state took ~0.6 ms per visiting step of the causal backward. Used by
every ring backward pair whose rows are known at trace time, with $PK_JAX_RING_MERGE=dq (the default) or kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config, core, dispatch
from jax.interpreters import batching, mlir

from pk_jax import _ext
from pk_jax._env import choice_setting
from pk_jax.context.block_attention import block_attention
from pk_jax.context.online_softmax import merge as merge_blocks

ACC_VAR = "PK_JAX_RING_MERGE"
ACC_MODES = ("xla", "dq", "kernel", "dq-direct")

pk_attention_accumulate_p = core.Primitive("pk_attention_accumulate")
pk_attention_accumulate_p.multiple_results = True
pk_attention_bwd_accumulate_p = core.Primitive("pk_attention_bwd_accumulate")
pk_attention_bwd_accumulate_p.multiple_results = True


def merge_in_kernel() -> str:
    """Where ring attention folds each block's result into its state: $PK_JAX_RING_MERGE, read when traced.
    "dq" (default): the backward's dQ added into its float32 state by the backward's dQ conversion in place, the
    forward's blocks merged by XLA; "xla": the block's output, then XLA's merge / add and dynamic-update-slice,
    forward and backward; "kernel": the attention kernels merge into the float32 states in place, the forward too
    (accumulate / accumulate_bwd). On 2x H100 (2026-11-26, S 12288) the forward's in-kernel merge was 0.3-2.9 ms
    slower than XLA's while the backward's saved 0.5-1.6 ms; on 4x H200 (2026-11-26, copy engines) "dq" was faster
    than "xla" in every ring row at S 12288 (fwd+bwd 37.87 vs 39.39 ms, causal zigzag 25.83 vs 26.45).
    "dq-direct" (opt-in, built in session 21, not yet run on a GPU): as "dq", but the backward kernel reads the
    pair's q and dO rows in place and adds its dQ into the state itself (accumulate_bwd's in_place): on 2x H100 at
    S 24576 the slices, the scratch's zeroing and the conversion took ~1.6 ms per causal zigzag fwd+bwd."""
    return choice_setting(ACC_VAR, "dq", ACC_MODES, owner="pk_jax.ring_attention")


def accumulate(q, k, v, offsets, acc, lse, *, row_start: int, merge: bool, scale: float, causal: bool,
               reserve_sms: int = 0) -> tuple[jax.Array, jax.Array]:
    """(acc, lse) with rows [row_start, row_start + Tq) written (merge False) or merged with q's attention over
    k, v (module docstring). offsets: int32[2] (q_offset, kv_offset) of the causal mask; reserve_sms: SMs the
    kernel leaves free for a transfer beside it."""
    b, tq, n, d = q.shape
    if acc.shape[0] != b or acc.shape[2:] != (n, d) or acc.dtype != jnp.float32:
        raise ValueError(f"pk_jax ring accumulate: acc {acc.shape} {acc.dtype} must be float32 (B, S, N, D) for q {q.shape}")
    if lse.shape != (b, n, acc.shape[1]) or lse.dtype != jnp.float32:
        raise ValueError(f"pk_jax ring accumulate: lse {lse.shape} must be float32 {(b, n, acc.shape[1])}")
    if not 0 <= row_start <= acc.shape[1] - tq:
        raise ValueError(f"pk_jax ring accumulate: rows [{row_start}, {row_start + tq}) outside the state's {acc.shape[1]}")
    return tuple(pk_attention_accumulate_p.bind(q, k, v, offsets, acc, lse, row_start=int(row_start),
                                                merge=bool(merge), scale=float(scale), causal=bool(causal),
                                                reserve_sms=int(reserve_sms)))


def _abstract(q, k, v, offsets, acc, lse, **_):
    outs = [acc.update(shape=acc.shape, dtype=acc.dtype), lse.update(shape=lse.shape, dtype=lse.dtype)]
    if config._check_vma.value:
        varying = frozenset().union(*(x.mat.varying for x in (q, k, v, offsets, acc, lse)))
        outs = [o.update(manual_axis_type=acc.mat.update(varying=varying)) for o in outs]
    return outs


pk_attention_accumulate_p.def_abstract_eval(_abstract)
pk_attention_accumulate_p.def_impl(functools.partial(dispatch.apply_primitive, pk_attention_accumulate_p))


def reference(q, k, v, offsets, acc, lse, *, row_start: int, merge: bool, scale: float, causal: bool, reserve_sms=0):
    """The XLA composition with the kernel's semantics (float32 block output, never rounded to q's dtype)."""
    tq = q.shape[1]
    out, blk = block_attention(q, k, v, scale=scale, causal=causal, q_offset=offsets[0], kv_offset=offsets[1])
    if merge:
        old = lax.dynamic_slice_in_dim(acc, row_start, tq, axis=1)
        old_lse = jnp.swapaxes(lax.dynamic_slice_in_dim(lse, row_start, tq, axis=2), 1, 2)
        old = jnp.where(jnp.isneginf(old_lse)[..., None], 0.0, old)  # a row holding nothing: its O is never read
        out, blk = merge_blocks(old, old_lse, out, blk)
    acc = lax.dynamic_update_slice_in_dim(acc, out.astype(jnp.float32), row_start, axis=1)
    return acc, lax.dynamic_update_slice_in_dim(lse, jnp.swapaxes(blk, 1, 2), row_start, axis=2)


def _lax_lowering(ctx, *args, row_start, merge, scale, causal, reserve_sms):
    f = functools.partial(reference, row_start=row_start, merge=merge, scale=scale, causal=causal)
    return mlir.lower_fun(lambda *a: list(f(*a)), multiple_results=True)(ctx, *args)


def _cuda_lowering(ctx, *args, row_start, merge, scale, causal, reserve_sms):
    from pk_jax.attention import FWD_VARIANTS, fwd_variant

    return jax.ffi.ffi_lowering("pk_attention_accumulate", operand_output_aliases={4: 0, 5: 1})(
        ctx, *args, scale=np.float32(scale), causal=np.int32(causal), mode=np.int32(2 if merge else 1),
        row_start=np.int64(row_start), reserve_sms=np.int32(reserve_sms),
        variant=np.int32(FWD_VARIANTS.index(fwd_variant(ctx.avals_in[1].shape[1], ctx.avals_in[1].shape[3],
                                                        bool(causal)))))  # args: q, k, v, ...


def _folding_batcher(primitive, reference_fn, n_out: int):
    """vmap: the mapped axis folds into every operand's batch axis (axis 0) and one call runs; a mapped `offsets`
    (operand 6 of the backward, 3 of the forward) runs the XLA composition under vmap instead."""
    offsets_at = 3 if primitive is pk_attention_accumulate_p else 6

    def batch(args, dims, **params):
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        if dims[offsets_at] is not None:
            outs = jax.vmap(lambda *a: reference_fn(*a, **params), in_axes=dims)(*args)
            return list(outs), (0,) * n_out
        front = [a if i == offsets_at else batching.bdim_at_front(a, d, size)
                 for i, (a, d) in enumerate(zip(args, dims))]
        fold = lambda x: x.reshape(size * x.shape[1], *x.shape[2:])
        outs = primitive.bind(*(a if i == offsets_at else fold(a) for i, a in enumerate(front)), **params)
        return [o.reshape(size, -1, *o.shape[1:]) for o in outs], (0,) * n_out

    return batch


mlir.register_lowering(pk_attention_accumulate_p, _lax_lowering)
if _ext.available():
    mlir.register_lowering(pk_attention_accumulate_p, _cuda_lowering, platform="cuda")


def accumulate_bwd(q, k, v, do, lse, delta, offsets, dq, *, row_start: int, scale: float, causal: bool,
                   reserve_sms: int = 0, in_place: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) of one block pair: dk, dv (B, Tk, Nkv, D) in k's dtype, and dq, the float32 state (B, S, N, D)
    with the pair's dQ added into rows [row_start, row_start + Tq). lse, delta: (B, Tq, N) float32 (the final LSE
    and rowsum(dO * O)), as ring attention keeps them. q, do: (B, Tq, N, D), the pair's queries; in_place: the
    state's whole rows (B, S, N, D) instead, the pair's being [row_start, row_start + Tq), read where they are, and
    dQ added into the state by the backward kernel itself ($PK_JAX_RING_MERGE=dq-direct: no slices of q and dO, no
    zeroed dQ scratch, no conversion pass)."""
    b, tq, n = lse.shape
    d = q.shape[3]
    if dq.shape[0] != b or dq.shape[2:] != (n, d) or dq.dtype != jnp.float32:
        raise ValueError(f"pk_jax ring accumulate_bwd: dq {dq.shape} {dq.dtype} must be float32 (B, S, N, D) for q {q.shape}")
    rows = dq.shape[1] if in_place else tq
    if q.shape != (b, rows, n, d) or do.shape != q.shape:
        raise ValueError(f"pk_jax ring accumulate_bwd: q {q.shape} and do {do.shape} must be {(b, rows, n, d)} (the "
                         f"{'state' if in_place else 'pair'}'s rows)")
    if not 0 <= row_start <= dq.shape[1] - tq:
        raise ValueError(f"pk_jax ring accumulate_bwd: rows [{row_start}, {row_start + tq}) outside the state's {dq.shape[1]}")
    return tuple(pk_attention_bwd_accumulate_p.bind(q, k, v, do, jnp.swapaxes(lse, 1, 2), jnp.swapaxes(delta, 1, 2),
                                                    offsets, dq, row_start=int(row_start), scale=float(scale),
                                                    causal=bool(causal), reserve_sms=int(reserve_sms),
                                                    in_place=bool(in_place)))


def _abstract_bwd(q, k, v, do, lse, delta, offsets, dq, **_):
    outs = [dq.update(shape=dq.shape, dtype=dq.dtype), k.update(shape=k.shape, dtype=k.dtype),
            v.update(shape=v.shape, dtype=v.dtype)]
    if config._check_vma.value:
        varying = frozenset().union(*(x.mat.varying for x in (q, k, v, do, lse, delta, offsets, dq)))
        outs = [o.update(manual_axis_type=o.mat.update(varying=varying)) for o in outs]
    return outs


pk_attention_bwd_accumulate_p.def_abstract_eval(_abstract_bwd)
pk_attention_bwd_accumulate_p.def_impl(functools.partial(dispatch.apply_primitive, pk_attention_bwd_accumulate_p))


def add_rows(dq, part, row_start: int):
    """dq (B, S, N, D) with `part` (B, Tq, N, D) added into rows [row_start, row_start + Tq)."""
    tq = part.shape[1]
    return lax.dynamic_update_slice_in_dim(dq, lax.dynamic_slice_in_dim(dq, row_start, tq, axis=1) + part, row_start,
                                           axis=1)


def reference_bwd(q, k, v, do, lse, delta, offsets, dq, *, row_start: int, scale: float, causal: bool, reserve_sms=0,
                  in_place=False):
    """The XLA composition (lse, delta in the kernel's (B, N, Tq) layout): the pair's gradients, dQ added in."""
    from pk_jax.attention import reference_bwd as pair_reference

    if in_place:  # q, do hold the state's rows: the pair's are [row_start, row_start + Tq)
        q, do = (lax.slice_in_dim(x, row_start, row_start + lse.shape[-1], axis=1) for x in (q, do))
    dq_b, dk, dv = pair_reference(q, k, v, do, lse, delta, offsets, scale=scale, causal=causal, dq_f32=True)
    return add_rows(dq, dq_b, row_start), dk, dv


def _kernel_bwd(q, k, v, do, lse, delta, offsets, dq, *, row_start: int, scale: float, causal: bool, reserve_sms=0,
                in_place=False):
    from pk_jax.attention import _kernel_bwd_call

    return _kernel_bwd_call(q, k, v, do, lse, delta, offsets, scale=scale, causal=causal, reserve_sms=reserve_sms,
                            dq_into=dq, row_start=row_start, in_place=in_place)


mlir.register_lowering(pk_attention_bwd_accumulate_p, mlir.lower_fun(reference_bwd, multiple_results=True))
if _ext.available():
    mlir.register_lowering(pk_attention_bwd_accumulate_p, mlir.lower_fun(_kernel_bwd, multiple_results=True),
                           platform="cuda")

batching.primitive_batchers[pk_attention_accumulate_p] = _folding_batcher(pk_attention_accumulate_p, reference, 2)
batching.primitive_batchers[pk_attention_bwd_accumulate_p] = _folding_batcher(pk_attention_bwd_accumulate_p,
                                                                              reference_bwd, 3)
