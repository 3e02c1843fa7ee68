"""`pk_jax.attention`: softmax attention on one GPU, shaped like `jax.nn.dot_product_attention`.

q (B, Tq, N, D), k and v (B, Tk, K, D) with K dividing N (GQA / MQA: query head n reads K/V head
n // (N / K)), out (B, Tq, N, D) in q's dtype; with `return_lse` also the float32 log-sum-exp
(B, N, Tq) of each row's scaled scores (natural log), what ring attention merges blocks by.
Causal masks are placed by global positions: query row i sits at q_offset + i, key j at
kv_offset + j, and the row sees the key when q_offset + i >= kv_offset + j (offsets 0: the top-left
aligned mask of jax.nn.dot_product_attention). A row that sees no key gets out = 0 and lse = -inf.

Implementations:
  "pk":       our Hopper kernel (kernels/attention_kernel.cuh: FlashAttention-3's structure on the
              LCSC template), bf16/fp16, D = 64 or 128, any lengths, GQA, offsets, LSE. The whole suite
              at defaults on one H100 (benchmarks/results/2026-12-07-attention-nvidia-h100.json): geomean
              1.03x cuDNN, 0.92-1.15x per row; it still trails on a few rows (the forward at S 1024 at D 128
              and causal at D 64, some fwd+bwd rows), so it is used only when asked for: implementation="pk"
              or the environment variable PK_JAX_ATTENTION=pk. Calls it cannot take run the fallback and say
              why once.
  "fallback": the default while the kernel trails cuDNN on some rows: pk_jax.sdpa.dot_product_attention (cuDNN where
              it takes the call, else XLA) when neither the LSE nor a causal offset is asked for, else an XLA einsum
              path with float32 accumulation (pk_jax/context/block_attention.py).
Backward (`jax.grad`): a custom VJP from the saved LSE; a cotangent of the LSE output is honoured
(delta = rowsum(dO * O) - dLSE, computed by XLA). Where the forward ran our kernel and
the backward is our kernel too (PK_JAX_ATTENTION_BWD=xla turns it off)
(kernels/attention_bwd_kernel.cuh, primitive pk_attention_bwd: dK and dV in registers per key block, dQ added into a float32 buffer by TMA bulk reduce-adds, so dQ's bits may differ between
runs; dK and dV are deterministic); elsewhere (the fallback, CPU) XLA einsums recompute the
probabilities (block_attention_bwd), float32 accumulation, gradients in the input dtypes.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config, core, dispatch
from jax.interpreters import batching, mlir

from pk_jax import _ext, sdpa
from pk_jax._env import choice_setting, int_setting
from pk_jax.context.block_attention import block_attention, block_attention_bwd

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
KERNEL_HEAD_DIMS = (64, 128)
IMPLEMENTATIONS = ("pk", "fallback")
ENV_VAR = "PK_JAX_ATTENTION"
BWD_VAR = "PK_JAX_ATTENTION_BWD"  # "xla": the XLA einsum backward instead of our kernel (see backward_kernel_enabled)
SCHEDULE_VAR = "PK_JAX_ATTENTION_SCHEDULE"  # the kernel's consumer schedule: "in_turn" (default) or "pipelined"
SCHEDULES = ("in_turn", "pipelined")
# The forward kernel's variant (read when a program is lowered; unset: DEFAULT_FWD_VARIANT). "base" is the
# first kernel (session 7), whose consumer schedule $PK_JAX_ATTENTION_SCHEDULE picks. The others, measured against it by
# `python -m pk_jax.bench attention --variants` / `--fwd-variants` (kernels/attention_kernel.cuh):
#   l2order:  tasks in L2 sections (a few heads' query tiles at a time), so CTAs share K/V reads in L2;
#   pingpong: l2order + K/V stages released separately + FA3's warp-scheduler turns between the consumers;
#   fa3:      pingpong + the intra-warpgroup overlap (FA3's D = 128 mainloop);
#   fa3n160:  fa3 with 160-key blocks instead of 128 (as wide as our smem holds two stages beside the O
#             slots): each block's barriers / softmax reductions / O rescale over 25% more MMA work;
#   fa3n176:  fa3 with FA3's D = 128 key block, 176 keys (+37.5%), the room taken from the O slots: the
#             consumers store O to global memory from registers;
#   fa3w3:    (D 64; fa3 at D 128) fa3 with three consumer warpgroups on 192-row query tiles (FA3's D 64 tile), the
#             turns passed around the three, so two warpgroups' GEMMs run under one's softmax.
# base..fa3 give bit-identical outputs (FWD_VARIANTS_SAME_BITS); fa3n160 / fa3n176 accumulate over other key
# blocks, and fa3w3's 192-row tiles visit other (fully masked) key blocks under a causal mask, so their last bits
# differ (they are checked against the float32 reference instead).
# PK_JAX_ATTENTION_FWD_DEBUG=1 (read at each launch) runs pingpong / fa3 / fa3n160 / fa3n176 / fa3w3 (bf16) with
# bounded barrier waits that print and trap instead of hanging.
FWD_VARIANT_VAR = "PK_JAX_ATTENTION_FWD_VARIANT"
FWD_VARIANTS = ("base", "l2order", "pingpong", "fa3", "fa3n160", "fa3n176", "fa3w3")  # index = the handler's `variant`
FWD_VARIANTS_SAME_BITS = ("base", "l2order", "pingpong", "fa3")  # the variants that give base's bits exactly
# One H200 (2026-11-23, bench attention --fwd-variants, D 128, S 4096 / 16384, geomean vs cuDNN): fa3 0.944
# against base 0.864, l2order 0.896, pingpong 0.932; in a later run fa3n160 0.916 against fa3 0.894 (5 of 6
# rows faster, up to +5.6% causal) and fa3n176 0.846. fa3n160 passed the float32-reference tests (bf16).
DEFAULT_FWD_VARIANT = "fa3n160"
# Unless $PK_JAX_ATTENTION_FWD_VARIANT is set, a call whose key length 160-key blocks pad badly takes fa3 (128-key
# blocks) instead (default_fwd_variant). Model: a call costs ceil(Tk / BKV) x (BKV + FWD_BLOCK_FIXED_KEYS) key-times,
# the fixed part (turn barriers, row max / sum shuffles, the O rescale per block) fitted to fa3n160's ~2.5 % lead at
# Tk 4096 (session 11). One H200 (2026-11-27, session 29, same turns): at Tk 1024 fa3 0.87 / 0.90 / 0.87x cuDNN
# (D 128: fwd / causal / GQA) against fa3n160's 0.80 / 0.80 / 0.81, and 0.84 / 0.82 / 0.84x against 0.75 / 0.71 /
# 0.75 at D 64.
FWD_BLOCK_FIXED_KEYS = 31
# fa3w3 (three consumer warpgroups, 192-row tiles) by default at D 64 without a causal mask. One H100 (2026-11-28,
# session 30, bench attention --fwd-variants fa3, same turns, x cuDNN): fwd / GQA 0.92 / 0.94 at S 1024, 0.99 / 1.00
# at S 4096, 1.03 / 1.01 at S 16384, against fa3's 0.84-0.90. Under a causal mask each of its warpgroups stops at its
# own rows' last key block (session 31); one H200 (2026-11-28, same turns, fwd / GQA x cuDNN): 0.899 / 0.932 at
# S 4096 and 0.996 / 1.000 at S 16384 against the default's (fa3n160) 0.83 / 0.82 and 0.88 / 0.89, but 0.798 / 0.791
# at S 1024 against fa3's 0.82 / 0.81. So causal calls take it from FWD_W3_CAUSAL_MIN_KEYS keys.
FWD_W3_CAUSAL_MIN_KEYS = 4096
# The backward kernel's variant (read when a program is lowered, like the forward's; kernels/attention_bwd_kernel.cuh):
#   dqfirst:          dQ issued before dK, its chunk stored while dK's MMAs run;
#   l2order_dqfirst:  dqfirst + FlashAttention-3's task order (key blocks fastest), so the CTAs at work share
#                     one head's Q / dO reads and dQ reduce-adds in L2 instead of ~66 heads' in HBM;
#   w3:               (D 64; l2order_dqfirst at D 128) l2order_dqfirst with three consumer warpgroups on 192-key blocks
#                     (a warpgroup whose keys all lie past Tk idles). Session 30, D 64 fwd+bwd x cuDNN, same turns
#                     (two H100 runs, then one H200 run with the idle skip): causal S 4096 0.924 / 0.929 / 0.897
#                     against the default's 0.87 / 0.88 / 0.87; S 16384 non-causal 0.915 / 0.930 / 0.912 against
#                     0.90 / 0.89 / 0.89 and causal 0.916 / 0.911 / 0.911 against 0.88 / 0.86 / 0.88; but S 1024
#                     0.83-0.99 against 0.90-1.02 and non-causal S 4096 0.85-0.88 against 0.88-0.90. So it is the
#                     default at D 64 for causal calls from Tk 4096 and all calls from Tk 16384 (default_bwd_variant).
# All give base's dK / dV bits (dQ's reduce order varies between runs in every variant). One H200
# (2026-11-23, bench attention --bwd-variants, fwd+bwd vs cuDNN, geomean of 6 rows): base 0.791, dqfirst
# 0.850, l2order_dqfirst 0.898 (0.836-0.936 per row), same dK / dV bits as base in every row.
BWD_VARIANT_VAR = "PK_JAX_ATTENTION_BWD_VARIANT"
BWD_VARIANTS = ("base", "dqfirst", "l2order_dqfirst", "w3")  # index = the bwd handler's `variant` attribute
DEFAULT_BWD_VARIANT = "l2order_dqfirst"
# GQA head split (kernels/attention_bwd_kernel.cuh Globals::head_split): a backward task walks group / split of its kv
# head's query heads, and the split tasks' dK / dV partials are summed in float32 scratch, then cast (see bwd_head_split).
# One H100 (session 43, one build, two turns, fwd+bwd x cuDNN; docs/design-attention.md "the GQA head split"): causal GQA
# 8:1 split 2 / 8 against 1: D 128 S 4096 1.00 / 0.98 against 0.95, S 16384 1.02 / 1.01 against 0.99, D 64 S 4096 0.98 /
# 0.97 against 0.96, S 16384 0.99 / 0.99 against 0.98; non-causal GQA loses (D 128 S 4096 1.00 / 0.98 against 1.04).
# So causal calls take 2 (deterministic: two adds onto zero commute), the rest 1, but for w3 (D 64's variant without a
# mask from Tk 16384): there split 2 ran 0.7 % and 1.6 % faster than 1 at D 64 S 16384 GQA (sessions 43 and 44, H100).
BWD_HEAD_SPLIT_VAR = "PK_JAX_ATTENTION_BWD_HEAD_SPLIT"
BWD_HEAD_SPLIT_CAUSAL = 2
BWD_HEAD_SPLIT_ALWAYS_VARIANTS = ("w3",)  # variants that take BWD_HEAD_SPLIT_CAUSAL's split without a mask too
BWD_HEAD_SPLIT_VARIANTS = ("l2order_dqfirst", "w3")  # the variants built with the split
DQ_CONVERT_VAR = "PK_JAX_ATTENTION_DQ_CONVERT"  # "kernel" (default) or "xla": see dq_convert()
DQ_CONVERTS = ("kernel", "xla")

pk_attention_p = core.Primitive("pk_attention")
pk_attention_p.multiple_results = True
pk_attention_bwd_p = core.Primitive("pk_attention_bwd")
pk_attention_bwd_p.multiple_results = True
LOG2E = 1.4426950408889634
DQ_ROWS = 64  # the backward kernel's query block: dq_acc and lse2 / delta rows are padded to a multiple


def reference(q: jax.Array, k: jax.Array, v: jax.Array, offsets: jax.Array, *, scale: float,
              causal: bool) -> tuple[jax.Array, jax.Array]:
    """XLA einsums, float32 accumulation -> (out (B, Tq, N, D) in q's dtype, lse (B, N, Tq) float32).
    offsets: int32[2] = (q_offset, kv_offset)."""
    out, lse = block_attention(q, k, v, scale=scale, causal=causal, q_offset=offsets[0], kv_offset=offsets[1])
    return out.astype(q.dtype), jnp.swapaxes(lse, 1, 2)


def _abstract_eval(q, k, v, offsets, *, scale, causal, with_lse, reserve_sms=0):
    b, tq, n, _ = q.shape
    out = q.update(shape=q.shape, dtype=q.dtype)
    lse = q.update(shape=(b, n, tq) if with_lse else (1, 1, 1), dtype=jnp.float32)
    if config._check_vma.value:
        varying = frozenset().union(*(x.mat.varying for x in (q, k, v, offsets)))
        out = out.update(manual_axis_type=q.mat.update(varying=varying))
        lse = lse.update(manual_axis_type=q.mat.update(varying=varying))
    return out, lse


pk_attention_p.def_abstract_eval(_abstract_eval)
pk_attention_p.def_impl(functools.partial(dispatch.apply_primitive, pk_attention_p))


def _bind(q, k, v, offsets, scale, causal, with_lse, reserve_sms: int = 0):
    """reserve_sms: SMs the kernel leaves free (ring attention: for the next step's K/V transfer)."""
    return pk_attention_p.bind(q, k, v, offsets, scale=scale, causal=causal, with_lse=with_lse,
                               reserve_sms=int(reserve_sms))


def _lax_lowering(ctx, q, k, v, offsets, *, scale, causal, with_lse, reserve_sms=0):
    def f(q, k, v, offsets):
        out, lse = reference(q, k, v, offsets, scale=scale, causal=causal)
        return out, (lse if with_lse else jnp.zeros((1, 1, 1), jnp.float32))

    return mlir.lower_fun(f, multiple_results=True)(ctx, q, k, v, offsets)


def _schedule() -> str:
    """The consumer schedule the next lowering takes ($PK_JAX_ATTENTION_SCHEDULE, read when a program is
    lowered). "pipelined" overlaps each key block's softmax with the previous block's P V, as
    FlashAttention-3 does; unmeasured, so "in_turn" stays the default."""
    return choice_setting(SCHEDULE_VAR, "in_turn", SCHEDULES, owner="pk_jax.attention")


def default_fwd_variant(tk: int, head_dim: int | None = None, causal: bool = False) -> str:
    """The forward variant a call over tk keys takes by default: fa3w3 at head_dim 64, under a causal mask from
    FWD_W3_CAUSAL_MIN_KEYS keys (measured: the note above it); else DEFAULT_FWD_VARIANT (fa3n160), or fa3 where 128-key
    blocks cover the keys in less modeled time (Tk 1024: 8 blocks of 128 against 7 of 160, the last 60 % padding)."""
    if head_dim == 64 and (not causal or tk >= FWD_W3_CAUSAL_MIN_KEYS):
        return "fa3w3"
    def cost(block_keys: int) -> int:
        return -(-tk // block_keys) * (block_keys + FWD_BLOCK_FIXED_KEYS)
    return "fa3" if DEFAULT_FWD_VARIANT == "fa3n160" and cost(128) < cost(160) else DEFAULT_FWD_VARIANT


def fwd_variant(tk: int | None = None, head_dim: int | None = None, causal: bool = False) -> str:
    """The forward variant the next lowering takes ($PK_JAX_ATTENTION_FWD_VARIANT, read when a program is
    lowered, like the schedule: a jitted function keeps the variant it was compiled with). Unset or empty:
    default_fwd_variant(tk, head_dim, causal) for a call over tk keys, DEFAULT_FWD_VARIANT when tk is not given."""
    default = DEFAULT_FWD_VARIANT if tk is None else default_fwd_variant(tk, head_dim, causal)
    return choice_setting(FWD_VARIANT_VAR, default, FWD_VARIANTS, owner="pk_jax.attention")


def default_bwd_variant(tk: int, head_dim: int, causal: bool) -> str:
    """The backward variant a call over tk keys takes by default: w3 at head_dim 64 where its 192-key blocks waste
    little (causal from Tk 4096, any mask from Tk 16384: the note at BWD_VARIANTS), else DEFAULT_BWD_VARIANT."""
    return "w3" if head_dim == 64 and tk >= (4096 if causal else 16384) else DEFAULT_BWD_VARIANT


def bwd_variant(tk: int | None = None, head_dim: int | None = None, causal: bool = False) -> str:
    """The backward variant the next lowering takes ($PK_JAX_ATTENTION_BWD_VARIANT, read when a program is
    lowered; unset or empty: default_bwd_variant for a call over tk keys, DEFAULT_BWD_VARIANT when tk is not given)."""
    default = DEFAULT_BWD_VARIANT if tk is None else default_bwd_variant(tk, head_dim, causal)
    return choice_setting(BWD_VARIANT_VAR, default, BWD_VARIANTS, owner="pk_jax.attention")


def bwd_head_split(heads: int, kv_heads: int, causal: bool, variant: str = DEFAULT_BWD_VARIANT) -> int:
    """How many backward tasks share one kv head's query heads: $PK_JAX_ATTENTION_BWD_HEAD_SPLIT, read when a program
    is lowered, cut to the largest count dividing both it and heads / kv_heads; unset or empty: BWD_HEAD_SPLIT_CAUSAL
    under a causal mask or in the BWD_HEAD_SPLIT_ALWAYS_VARIANTS (where it divides the group), else 1. Only the
    variants in BWD_HEAD_SPLIT_VARIANTS split (others: 1). Above 1, dK and dV are float32 sums of the tasks' partials:
    with more than two tasks their bits may differ between runs (adds in run-dependent order; two adds onto zero
    commute)."""
    group = heads // kv_heads
    wants_split = causal or variant in BWD_HEAD_SPLIT_ALWAYS_VARIANTS
    default = BWD_HEAD_SPLIT_CAUSAL if wants_split and group % BWD_HEAD_SPLIT_CAUSAL == 0 else 1
    split = int_setting(BWD_HEAD_SPLIT_VAR, default, minimum=1, owner="pk_jax.attention",
                        what="a count of tasks per kv head")
    return math.gcd(split, group) if variant in BWD_HEAD_SPLIT_VARIANTS else 1


def _cuda_lowering(ctx, q, k, v, offsets, *, scale, causal, with_lse, reserve_sms=0):
    k_shape = ctx.avals_in[1].shape
    variant = FWD_VARIANTS.index(fwd_variant(k_shape[1], k_shape[3], bool(causal)))
    return jax.ffi.ffi_lowering("pk_attention")(ctx, q, k, v, offsets, scale=np.float32(scale),
                                                 causal=np.int32(causal), with_lse=np.int32(with_lse),
                                                 pipelined=np.int32(variant == 0 and _schedule() == "pipelined"),
                                                 variant=np.int32(variant), reserve_sms=np.int32(reserve_sms))


mlir.register_lowering(pk_attention_p, _lax_lowering)
if _ext.available():
    mlir.register_lowering(pk_attention_p, _cuda_lowering, platform="cuda")


def _batch(args, dims, *, scale, causal, with_lse, reserve_sms=0):
    """vmap: the mapped axis folds into the batch axis (offsets must be shared), one kernel call."""
    q, k, v, offsets = args
    if dims[3] is not None:
        out, lse = jax.vmap(lambda *a: reference(*a, scale=scale, causal=causal), in_axes=dims)(*args)
        return (out, lse if with_lse else jnp.zeros(out.shape[:1] + (1, 1, 1), jnp.float32)), (0, 0)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    q, k, v = (batching.bdim_at_front(x, d, size) for x, d in zip((q, k, v), dims[:3]))
    fold = lambda x: x.reshape(size * x.shape[1], *x.shape[2:])
    out, lse = _bind(fold(q), fold(k), fold(v), offsets, scale, causal, with_lse, reserve_sms)
    out = out.reshape(size, -1, *out.shape[1:])
    lse = lse.reshape(size, -1, *lse.shape[1:]) if with_lse else jnp.zeros((size, 1, 1, 1), jnp.float32)
    return (out, lse), (0, 0)


batching.primitive_batchers[pk_attention_p] = _batch


def _vary_like(avals, *inputs):
    if not config._check_vma.value:
        return avals
    varying = frozenset().union(*(x.mat.varying for x in inputs))
    return [a.update(manual_axis_type=inputs[0].mat.update(varying=varying)) for a in avals]


def _bwd_abstract_eval(q, k, v, dout, lse, delta, offsets, *, scale, causal, reserve_sms=0, dq_f32=False):
    del dout, lse, delta, scale, causal, reserve_sms
    return _vary_like([q.update(shape=q.shape, dtype=jnp.float32 if dq_f32 else q.dtype), k.update(shape=k.shape, dtype=k.dtype),
                       v.update(shape=v.shape, dtype=v.dtype)], q, k, v, offsets)


def reference_bwd(q, k, v, dout, lse, delta, offsets, *, scale, causal, reserve_sms=0, dq_f32=False):
    """XLA einsums: (dq, dk, dv) in the input dtypes from lse and delta (B, N, Tq) float32, where
    delta = rowsum(dout * out) - d_lse. What pk_attention_bwd computes; its lowering off CUDA. dq_f32: dq stays
    float32 (ring attention adds it over steps: one rounding at the end instead of one per step)."""
    dq, dk, dv = block_attention_bwd(q, k, v, dout, jnp.swapaxes(lse, 1, 2), jnp.swapaxes(delta, 1, 2), scale=scale,
                                     causal=causal, q_offset=offsets[0], kv_offset=offsets[1])
    return dq.astype(jnp.float32 if dq_f32 else q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def dq_from_chunks(acc: jax.Array, tq: int, scale: float) -> jax.Array:
    """The backward kernel's float32 dq_acc (B, N, Tq_pad, D) -> dq (B, Tq, N, D) float32, times scale.
    Each 64-row block of a head holds D / 64 chunks (column boxes) of 64 x 64; inside a chunk float
    ((c * 128 + t) * 4 + j) is accumulator register 4c + j of consumer thread t = 32 wp + 4 lq + lr:
    row 16 wp + 8 (j // 2) + lq, column 8 c + 2 lr + j % 2 (wgmma's accumulator layout)."""
    b, n, tp, d = acc.shape
    x = acc.reshape(b, n, tp // DQ_ROWS, d // 64, 8, 4, 8, 4, 2, 2)  # b n blk box c wp lq lr jh jl
    x = x.transpose(0, 2, 5, 8, 6, 1, 3, 4, 7, 9)                 # b blk (wp jh lq) n (box c lr jl)
    return x.reshape(b, tp, n, d)[:, :tq] * jnp.float32(scale)


def kernel_bwd_inputs(lse: jax.Array, delta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """lse, delta (B, N, Tq) -> the kernel's lse2 = lse * log2(e) and delta, (B, N, Tq_pad): rows past
    Tq and rows that see no key (lse = -inf) get lse2 = +inf (P = 0 exactly), padded delta 0."""
    tq = lse.shape[-1]
    pad = ((0, 0), (0, 0), (0, -tq % DQ_ROWS))
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * jnp.float32(LOG2E))
    return jnp.pad(lse2, pad, constant_values=jnp.inf), jnp.pad(delta.astype(jnp.float32), pad)


def dq_convert() -> str:
    """Who turns the backward kernel's dQ accumulator into dQ: $PK_JAX_ATTENTION_DQ_CONVERT, read when a program
    is lowered. "kernel" (default): a second kernel in the same custom call (coalesced, one pass); "xla":
    dq_from_chunks, XLA's fusion of a 10-D transpose (~0.3 TB/s: 3.8 ms per ring step at 4 GPUs, S 12288), kept
    as the A/B baseline."""
    return choice_setting(DQ_CONVERT_VAR, "kernel", DQ_CONVERTS, owner="pk_jax.attention")


def _kernel_bwd_call(q, k, v, dout, lse, delta, offsets, *, scale, causal, reserve_sms=0, dq_f32=False, dq_into=None,
                     row_start=0, in_place=False):
    """The backward kernel's custom call -> (dq, dk, dv). dq_into: ring attention's float32 dQ state (B, S, N, D); the
    pair's dQ is added into its rows [row_start, row_start + Tq) and the state returned as dq (in place by the dQ
    conversion kernel, pk_attention_bwd_accumulate, unless $PK_JAX_ATTENTION_DQ_CONVERT=xla). in_place (with
    dq_into): q and dout are the state's whole rows (the pair's queries are rows [row_start, row_start + Tq) of
    them, Tq = lse's length), read in place, and the kernel adds dQ into the state itself: no slices of q and dout,
    no zeroed scratch, no conversion pass."""
    b, tq, n, d = q.shape
    lse2, delta = kernel_bwd_inputs(lse, delta)
    in_kernel = dq_convert() == "kernel"
    dq_dtype = jnp.float32 if dq_f32 or dq_into is not None else q.dtype
    scratch = (1,) if in_place else (b, n, lse2.shape[-1], d)  # the kernel's dq_acc (unused in place)
    grads = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
             jax.ShapeDtypeStruct(scratch, jnp.float32))
    variant = bwd_variant(k.shape[1], d, bool(causal))
    attrs = dict(scale=np.float32(scale), causal=np.int32(causal), reserve_sms=np.int32(reserve_sms),
                 variant=np.int32(BWD_VARIANTS.index(variant)))
    if dq_into is not None and (in_kernel or in_place):
        dq, dk, dv, _ = jax.ffi.ffi_call("pk_attention_bwd_accumulate", (jax.ShapeDtypeStruct(dq_into.shape, jnp.float32),
                                                                         *grads), input_output_aliases={7: 0})(
            q, k, v, dout, lse2, delta, offsets, dq_into, row_start=np.int64(row_start),
            tq=np.int64(lse.shape[-1] if in_place else 0), q_row0=np.int64(row_start if in_place else 0),
            direct=np.int32(in_place), **attrs)
        return dq, dk, dv
    split = bwd_head_split(n, k.shape[2], bool(causal), variant)
    dkv_scratch = jax.ShapeDtypeStruct((2, *k.shape) if split > 1 else (1,), jnp.float32)
    dq, dk, dv, dq_acc, _ = jax.ffi.ffi_call("pk_attention_bwd", (jax.ShapeDtypeStruct(q.shape, dq_dtype), *grads,
                                                                  dkv_scratch))(
        q, k, v, dout, lse2, delta, offsets, convert_dq=np.int32(in_kernel), head_split=np.int32(split), **attrs)
    if not in_kernel:
        dq = dq_from_chunks(dq_acc, tq, scale).astype(dq_dtype)
    if dq_into is not None:  # the A/B baseline of the conversion: XLA converts, XLA adds
        from pk_jax.context.block_accumulate import add_rows

        dq = add_rows(dq_into, dq, row_start)
    return dq, dk, dv


pk_attention_bwd_p.def_abstract_eval(_bwd_abstract_eval)
pk_attention_bwd_p.def_impl(functools.partial(dispatch.apply_primitive, pk_attention_bwd_p))
mlir.register_lowering(pk_attention_bwd_p, mlir.lower_fun(reference_bwd, multiple_results=True))
if _ext.available():
    mlir.register_lowering(pk_attention_bwd_p, mlir.lower_fun(_kernel_bwd_call, multiple_results=True),
                           platform="cuda")


def _batch_bwd(args, dims, *, scale, causal, reserve_sms=0, dq_f32=False):
    """vmap: the mapped axis folds into the batch axis (offsets must be shared), one kernel call."""
    if dims[6] is not None:
        outs = jax.vmap(lambda *a: reference_bwd(*a, scale=scale, causal=causal, dq_f32=dq_f32), in_axes=dims)(*args)
        return outs, (0, 0, 0)
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    front = [batching.bdim_at_front(x, d, size) for x, d in zip(args[:6], dims[:6])]
    fold = lambda x: x.reshape(size * x.shape[1], *x.shape[2:])
    outs = pk_attention_bwd_p.bind(*(fold(x) for x in front), args[6], scale=scale, causal=causal,
                                   reserve_sms=reserve_sms, dq_f32=dq_f32)
    return [o.reshape(size, -1, *o.shape[1:]) for o in outs], (0, 0, 0)


batching.primitive_batchers[pk_attention_bwd_p] = _batch_bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _kernel_attention(q, k, v, offsets, scale, causal, reserve_sms=0):
    """(out, lse) by our kernels, forward and backward; reserve_sms: SMs both leave free (for a transfer running
    beside them on another stream, as Ulysses' asynchronous exchanges)."""
    return tuple(_bind(q, k, v, offsets, scale, causal, True, reserve_sms))


def _kernel_fwd(q, k, v, offsets, scale, causal, reserve_sms=0):
    out, lse = _bind(q, k, v, offsets, scale, causal, True, reserve_sms)
    return (out, lse), (q, k, v, offsets, out, lse)


def _delta(out, d_out, d_lse):
    """(B, N, Tq) float32: rowsum(d_out * out) - d_lse. d lse_i / d s_ij = p_ij, so the LSE's cotangent
    enters as -d_lse in delta (ds = p (dp - delta))."""
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # (B, Tq, N)
    return jnp.swapaxes(delta, 1, 2) - d_lse


def backward_kernel_enabled() -> bool:
    """Whether a kernel forward's VJP (and ring attention's block pairs) bind the backward kernel: yes
    unless PK_JAX_ATTENTION_BWD=xla. It passed its 29 GPU tests on H200 (2026-11-23, session 9: odd
    lengths, GQA, offsets, causal, dK/dV bits repeat) after the session-8 hang (a setmaxnreg split larger
    than the CTA's register pool) was fixed. PK_JAX_ATTENTION_BWD_DEBUG=1 launches a variant whose barrier
    waits time out (PK_JAX_ATTENTION_BWD_TIMEOUT_MS, default 2000), print the barrier and every role's
    progress, and trap: a hang becomes an error."""
    return os.environ.get(BWD_VAR, "kernel") != "xla"


def _kernel_bwd(scale, causal, reserve_sms, res, cts):
    """The forward ran our kernel: the backward kernel when enabled (its primitive lowers to XLA off
    CUDA), else the XLA einsums."""
    if not backward_kernel_enabled():
        return _xla_bwd(scale, causal, res, cts)
    q, k, v, offsets, out, lse = res
    d_out, d_lse = cts
    d_out = d_out.astype(q.dtype)
    dq, dk, dv = pk_attention_bwd_p.bind(q, k, v, d_out, lse, _delta(out, d_out, d_lse), offsets, scale=scale,
                                         causal=causal, reserve_sms=int(reserve_sms))
    return dq, dk, dv, None


def _xla_bwd(scale, causal, res, cts):
    """The fallback's backward: XLA einsums, any dtype and head dim."""
    q, k, v, offsets, out, lse = res
    d_out, d_lse = cts
    d_out = d_out.astype(q.dtype)
    dq, dk, dv = reference_bwd(q, k, v, d_out, lse, _delta(out, d_out, d_lse), offsets, scale=scale, causal=causal)
    return dq, dk, dv, None


_kernel_attention.defvjp(_kernel_fwd, _kernel_bwd)


@functools.cache
def _note_fallback(why: str) -> None:
    warnings.warn(f"pk_jax.attention: {why}; this call runs the fallback (jax.nn.dot_product_attention or "
                  f"XLA einsums) instead of the pk_jax kernel", stacklevel=3)


def _offset_array(q_offset, kv_offset) -> jax.Array:
    for name, x in (("q_offset", q_offset), ("kv_offset", kv_offset)):
        if jnp.ndim(x) != 0 or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(f"pk_jax.attention: {name} must be an integer scalar (a Python int or a 0-d int "
                             f"array), got {x!r}")
    return jnp.stack([jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32)])


def _kernel_refusal(q: jax.Array, k: jax.Array, scale: float) -> str | None:
    """Why the kernel cannot take this call, or None."""
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype} (the kernel takes bfloat16 or float16)"
    if q.shape[-1] not in KERNEL_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (the kernel takes {KERNEL_HEAD_DIMS})"
    if q.shape[1] == 0 or k.shape[1] == 0 or q.shape[0] == 0:
        return "an empty batch or sequence"
    if not scale > 0:
        return f"scale={scale} (the kernel takes a positive scale)"
    return None


def _check(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"pk_jax.attention: q, k, v must be 4-D (batch, seq, heads, head_dim); got q{q.shape}, "
                         f"k{k.shape}, v{v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"pk_jax.attention: k{k.shape} and v{v.shape} must have the same shape")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"pk_jax.attention: k{k.shape} must have q{q.shape}'s batch and head_dim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"pk_jax.attention: the K/V heads ({k.shape[2]}) must divide the query heads ({q.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"pk_jax.attention: q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False, scale: float | None = None,
              return_lse: bool = False, q_offset: int | jax.Array = 0, kv_offset: int | jax.Array = 0,
              implementation: str | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """softmax(scale * q kᵀ + causal mask) v, as `jax.nn.dot_product_attention(q, k, v, scale=scale,
    is_causal=causal)`, with global causal offsets and the LSE.

    Args:
      q: (B, Tq, N, D) bfloat16 / float16 (other floating dtypes run the fallback).
      k, v: (B, Tk, K, D) of q's dtype, K dividing N (GQA / MQA).
      causal: mask keys after the query's position (placed by the offsets).
      scale: score scale, default 1 / sqrt(D).
      return_lse: also return the float32 log-sum-exp (B, N, Tq) of each row (-inf where a row sees
        no key).
      q_offset, kv_offset: global positions of query row 0 and key 0 (Python ints or 0-d int32
        arrays, e.g. traced in a ring step); only the causal mask reads them.
      implementation: "pk" (our kernel), "fallback", or None: $PK_JAX_ATTENTION if set, else
        "fallback" (the kernel still trails cuDNN on a few rows; see the module doc).

    Returns:
      out (B, Tq, N, D) in q's dtype, or (out, lse) with return_lse.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _check(q, k, v)
    impl = implementation if implementation is not None else os.environ.get(ENV_VAR, "fallback")
    if impl not in IMPLEMENTATIONS:
        source = "implementation" if implementation is not None else f"${ENV_VAR}"
        raise ValueError(f"pk_jax.attention: {source}={impl!r} is not one of {IMPLEMENTATIONS}")
    scale = float(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    offsets = _offset_array(q_offset, kv_offset)
    causal = bool(causal)
    if impl == "pk":
        why = _kernel_refusal(q, k, scale)
        if why is None:
            out, lse = _kernel_attention(q, k, v, offsets, scale, causal, 0)
            return (out, lse) if return_lse else out
        if jax.default_backend() == "gpu":
            _note_fallback(why)
    return _fallback(q, k, v, offsets, scale, causal, return_lse, q_offset, kv_offset)


def _fallback(q, k, v, offsets, scale, causal, return_lse, q_offset, kv_offset):
    """jax.nn.dot_product_attention where it has these semantics (no LSE, no causal offset), else the
    differentiable XLA einsum path with the same custom VJP as the kernel's."""
    if k.shape[1] == 0:  # no keys: every row sees nothing
        out = jnp.zeros(q.shape, q.dtype)
        lse = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
        return (out, lse) if return_lse else out
    aligned = not causal or (isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset)
    if not return_lse and aligned:
        return sdpa.dot_product_attention(q, k, v, scale=scale, is_causal=causal)
    out, lse = _reference_attention(q, k, v, offsets, scale, causal)
    return (out, lse) if return_lse else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _reference_attention(q, k, v, offsets, scale, causal):
    return reference(q, k, v, offsets, scale=scale, causal=causal)


def _reference_fwd(q, k, v, offsets, scale, causal):
    out, lse = reference(q, k, v, offsets, scale=scale, causal=causal)
    return (out, lse), (q, k, v, offsets, out, lse)


_reference_attention.defvjp(_reference_fwd, _xla_bwd)
