"""Ring attention: the sequence sharded over a mesh axis, K/V shards passed around the ring.

Inside `jax.shard_map`, every member keeps its query shard and its running (output, lse); the K/V
shards travel one hop per step (member r -> r+1), and each step attends the local queries to the
visiting K/V (our attention kernel for bf16/f16 at head_dim 64/128, else the XLA `block_attention`)
and merges by log-sum-exp. Only the local shard plus the visiting and the arriving K/V block are alive
at any time.

The backward is a second ring (custom VJP, not autodiff of the forward loop, which would keep every
step's K/V): dK/dV accumulators travel around the ring back to the block's owner, dQ stays local, and
each pair recomputes its probabilities from the saved final lse.

Two transports ($PK_JAX_RING_TRANSPORT, read when traced; pk_jax/context/ring_shift.py):
  "pk" (default): our asynchronous ring shift, started before a step's attention and finished after it,
       running on a few SMs the attention leaves free (pk_jax/context/ring_overlap.py has the schedules:
       G-1 K/V hops forward, G-1 accumulator hops backward, all under compute). On CPU and wherever the
       kernel cannot serve it, the same schedule with lax.ppermute.
  "xla": the steps in a lax.scan with lax.ppermute between them (G hops each way; XLA does not run the
       permute under our kernel, measured on 2x H200: 2026-11-23).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pk_jax._env import int_setting
from pk_jax.context import cudnn_block, ring_overlap
from pk_jax.context._varying import full_varying
from pk_jax.context.block_accumulate import accumulate, accumulate_bwd, merge_in_kernel
from pk_jax.context.block_attention import block_attention, block_attention_bwd
from pk_jax.context.lse_parts import LseParts
from pk_jax.context.online_softmax import merge
from pk_jax.context.ring_schedule import (BlockPair, Layout, own_pairs_split, step_pairs, zigzag_visiting_cond,
                                          zigzag_whole_chunks)
from pk_jax.context.ring_shift import shift_sms, transport
from pk_jax.context.row_sum import RowSum, deferred_sums
from pk_jax.sharding import group_size, normalize_axis_name
from pk_jax.sharding.mesh_groups import AxisName


def check_attention_args(fn: str, q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """Shapes as jax.nn.dot_product_attention: q (B, T, N, H); k, v (B, T, K, H), K dividing N."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"pk_jax.{fn}: {name} must be (batch, seq, heads, head_dim); got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"pk_jax.{fn}: {name} has dtype {x.dtype}; use a floating dtype (bf16, f16, f32)")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"pk_jax.{fn}: k {k.shape} {k.dtype} and v {v.shape} {v.dtype} must match")
    if q.dtype != k.dtype:
        raise TypeError(f"pk_jax.{fn}: q is {q.dtype} but k/v are {k.dtype}; cast them to one dtype")
    if (q.shape[0], q.shape[1], q.shape[3]) != (k.shape[0], k.shape[1], k.shape[3]):
        raise ValueError(f"pk_jax.{fn}: q {q.shape} and k {k.shape} must agree in batch, local sequence "
                         f"length and head_dim (self-attention over one sharded sequence)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"pk_jax.{fn}: k/v heads ({k.shape[2]}) must divide q heads ({q.shape[2]}) (GQA)")


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: AxisName, *, causal: bool = False,
                   layout: Layout = "zigzag", scale: float | None = None) -> jax.Array:
    """Attention over a sequence sharded along `axis_name`, like jax.nn.dot_product_attention of the whole.

    Call inside `jax.shard_map` with the sequence axis of q, k, v sharded over `axis_name` (G members).

    Args:
      q: (B, T, N, H) this member's queries, T = S / G.
      k, v: (B, T, K, H), K dividing N (GQA: query head n uses K/V head n // (N / K)).
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
      causal: mask key positions after the query's global position.
      layout: how the global sequence is spread. "contiguous": member r holds positions
        [r T, (r+1) T). "zigzag": the sequence is cut into 2G chunks and member r holds chunks r and
        2G-1-r (T must be even), which balances causal work; pk_jax.sharding.to_zigzag puts a global
        array in that order before sharding, from_zigzag undoes it. Without `causal` the layouts
        give the same result row for row.
      scale: score scale, default 1/sqrt(H).

    Returns:
      (B, T, N, H) in q's dtype: this member's rows of the attention output.
    """
    check_attention_args("ring_attention", q, k, v)
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"pk_jax.ring_attention: layout={layout!r}; use 'zigzag' or 'contiguous'")
    if causal and layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"pk_jax.ring_attention: layout='zigzag' needs an even local sequence length "
                         f"(two chunks per member); got {q.shape[1]}. Pad the sequence to a multiple of 2G "
                         f"or use layout='contiguous'.")
    group_size(axis_name)  # raises a NameError naming the axis outside shard_map
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _ring_attention(q, k, v, normalize_axis_name(axis_name), bool(causal), layout, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ring_attention(q, k, v, axes, causal, layout, scale):
    return _forward(q, k, v, axes, causal, layout, scale)[0]


def _ring_steps(axes: tuple, g: int, carry, kv, compute: Callable, send_after: Callable | None = None):
    """Runs `compute(step, kv, carry) -> carry` for steps 0..G-1 while the K/V pytree `kv` moves one hop
    per step. Each step issues the next block's ppermute before its compute (so XLA can overlap them);
    steps 1..G-1 run in one lax.scan, so at most the current and the arriving block are alive (the last
    step's transfer is not needed; keeping the steps uniform keeps the program small). `send_after`, if
    given, moves part of the carry one hop after each step's compute (the backward's dK/dV)."""
    send = lambda x: lax.ppermute(x, axes, [(i, (i + 1) % g) for i in range(g)])

    def one(step, kv, carry):
        nxt = send(kv) if g > 1 else kv
        carry = compute(step, kv, carry)
        if send_after is not None and g > 1:
            carry = send_after(carry, send)
        return nxt, carry

    kv, carry = one(0, kv, carry)
    if g > 1:
        (kv, carry), _ = lax.scan(lambda c, step: (one(step, *c), None), (kv, carry),
                                  jnp.arange(1, g, dtype=jnp.int32))
    return carry


def _slice(x: jax.Array, start, length: int) -> jax.Array:
    return x if (isinstance(start, int) and start == 0 and length == x.shape[1]) else \
        lax.dynamic_slice_in_dim(x, start, length, axis=1)


def _update(x: jax.Array, part: jax.Array, start) -> jax.Array:
    return part if part.shape == x.shape else lax.dynamic_update_slice_in_dim(x, part, start, axis=1)


def _when(active, fn: Callable, state):
    """fn(state) for a pair that is always computed; otherwise only on members where it is unmasked."""
    return fn(state) if active is True else lax.cond(active, fn, lambda s: s, state)


RESERVE_SMS_VAR = "PK_JAX_RING_RESERVE_SMS"


def reserve_sms() -> int:
    """SMs the ring's attention kernels leave free for the block transfers running beside them:
    $PK_JAX_RING_RESERVE_SMS, read when the ring is traced. Default: with the "pk" transport the ring
    shift's SMs (ring_shift.shift_sms: 0 for the copy engines, the default, which take none; the kernel's CTA
    count, $PK_JAX_RING_SHIFT_CTAS = 8, with $PK_JAX_RING_SHIFT_ENGINE=sm or in multi-process jobs); with "xla" 0
    (on 2x H200, 2026-11-23, S 12288, leaving 8 SMs free did not hide XLA's permute: forward 20.87 vs 20.42 ms,
    fwd+bwd 76.3 vs 71.9; XLA does not run it under our kernel)."""
    default = shift_sms() if transport() == "pk" else 0
    return int_setting(RESERVE_SMS_VAR, default, minimum=0, owner="pk_jax.ring_attention", what="a count of SMs")


def _reserve(shift_in_flight: bool) -> int:
    """SMs a block's kernel leaves free: reserve_sms() while a ring shift may run beside it (or with the "xla"
    transport, whose permutes are XLA's), else none (the forward's last step, a backward step with nothing in
    flight): no transfer needs them then."""
    return reserve_sms() if shift_in_flight or transport() == "xla" else 0


def _offsets(q_offset, kv_offset) -> jax.Array:
    """The attention kernels' int32[2] (q_offset, kv_offset) operand: global positions of a block's first query
    and key (traced or not), read by the kernel from device memory."""
    return jnp.stack([jnp.asarray(q_offset, jnp.int32), jnp.asarray(kv_offset, jnp.int32)])


def _block_forward(q, k, v, scale: float, causal: bool, q_offset, kv_offset, reserve: int, visible: str | None = None):
    """One block pair's attention and its LSE: (out (B, Tq, N, H) float32, lse (B, Tq, N) float32). cuDNN where
    it takes the pair (the default; $PK_JAX_RING_LOCAL=pk: never; cudnn_block.takes, `visible`: BlockPair.visible),
    else our attention kernel where it takes the call (bf16/f16, head_dim 64/128; the offsets are traced, read by
    the kernel from device memory; where no kernel is built its primitive lowers to the XLA block path),
    else the XLA block path. The kernel's output stays in q's dtype (each block rounds once before the
    float32 merge, as in FlashAttention's ring implementations): a block written without a merge is not
    converted, and the merge reads it as it is."""
    from pk_jax.attention import _bind, _kernel_refusal  # pk_jax.attention imports this package

    if cudnn_block.takes(q, k, causal, visible):
        return cudnn_block.forward(q, k, v, scale=scale, causal=causal, visible=visible)
    if _kernel_refusal(q, k, scale) is not None:
        return block_attention(q, k, v, scale=scale, causal=causal, q_offset=q_offset, kv_offset=kv_offset)
    offsets = _offsets(q_offset, kv_offset)
    out, lse = _bind(q, k, v, offsets, scale, causal, True, reserve)
    return out, jnp.swapaxes(lse, 1, 2)


def _block_backward(q, k, v, do, lse, delta, scale: float, causal: bool, q_offset, kv_offset, reserve: int,
                    out=None, visible: str | None = None):
    """One block pair's (dq, dk, dv) from the final lse and delta (B, Tq, N): cuDNN's backward fed the
    final `out` and lse where it takes the pair (cudnn_block; the default), else our backward kernel where the
    forward kernel takes the call and the backward kernel is on (pk_jax.attention.backward_kernel_enabled; its
    primitive lowers to the XLA block path off CUDA), else the XLA block path (which holds a (Tq_chunk, Tk)
    float32 score block per head in memory). The parts stay in the dtype they come in (dq: q's from cuDNN, float32
    from our kernel and the XLA path; dk, dv: k's from the kernels, float32 from the XLA path): a pair's part is
    widened to float32 where it is added to something, inside that add, instead of by a pass of its own (0.2 ms per
    array and step at 4 GPUs, S 12288), and a fresh part can leave for the next member as it is (exactly)."""
    from pk_jax.attention import _kernel_refusal, backward_kernel_enabled, pk_attention_bwd_p

    if out is not None and cudnn_block.takes(q, k, causal, visible, backward=True):
        return cudnn_block.backward(q, k, v, out, do, lse, scale=scale, causal=causal, visible=visible)
    if _kernel_refusal(q, k, scale) is not None or not backward_kernel_enabled():
        return block_attention_bwd(q, k, v, do, lse, delta, scale=scale, causal=causal, q_offset=q_offset,
                                   kv_offset=kv_offset)
    offsets = _offsets(q_offset, kv_offset)
    return pk_attention_bwd_p.bind(q, k, v, do, jnp.swapaxes(lse, 1, 2), jnp.swapaxes(delta, 1, 2), offsets,
                                   scale=scale, causal=causal, reserve_sms=reserve, dq_f32=True)


def _forward(q, k, v, axes, causal, layout, scale):
    from pk_jax.attention import _kernel_refusal  # pk_jax.attention imports this package

    g = group_size(axes)
    rank = lax.axis_index(axes)
    sums_deferred = deferred_sums()  # read (and checked) whatever the transport
    out = full_varying(q.shape, 0.0, jnp.float32, like=(q, k, v), axes=axes)
    lse = full_varying(q.shape[:3], -jnp.inf, jnp.float32, like=(q, k, v), axes=axes)

    f32 = lambda state: tuple(x.astype(jnp.float32) for x in state)

    def block(p: BlockPair, q, kv, masked: bool, reserve: int):
        """Pair p's (out, lse) from the member's q and the block kv (_block_forward on their slices)."""
        return _block_forward(_slice(q, p.q_start, p.q_len), _slice(kv[0], p.kv_start, p.kv_len),
                              _slice(kv[1], p.kv_start, p.kv_len), scale, masked, p.q_offset, p.kv_offset, reserve,
                              p.visible)

    def pair_fwd(p: BlockPair, kv, state, q, fresh: bool, reserve: int):
        """fresh: no earlier pair wrote these query rows (known at trace time), so the block's result is
        written as is instead of merged with the initial (0, -inf): one float32 pass saved per pair; a fresh
        block covering every query row stays in the kernel's dtype until a merge reads it."""
        def run(state):
            out, lse = state
            o_b, l_b = block(p, q, kv, causal, reserve)
            if fresh and p.q_len == q.shape[1]:
                return o_b, l_b
            if not fresh:
                o_b, l_b = merge(_slice(out, p.q_start, p.q_len), _slice(lse, p.q_start, p.q_len), o_b, l_b)
            return _update(out, o_b.astype(out.dtype), p.q_start), _update(lse, l_b, p.q_start)
        return _when(p.active, run, state)

    def zigzag_causal(step, kv, state, q, reserve: int):
        """Zigzag, causal, on whole chunks (ring_schedule.zigzag_whole_chunks): step 0 two calls, each query row
        written once (no merge); later steps one unmasked T x C block, picked by lax.cond."""
        own, (low, high) = zigzag_whole_chunks(g=g, t_local=q.shape[1], rank=rank)
        if isinstance(step, int) and step == 0:
            (o0, l0), (o1, l1) = (block(p, q, kv, True, reserve) for p in own)
            return jnp.concatenate([o0, o1], axis=1), jnp.concatenate([l0, l1], axis=1)

        def merged(p):
            def run(state):
                out, lse = f32(state)
                o_b, l_b = merge(_slice(out, p.q_start, p.q_len), _slice(lse, p.q_start, p.q_len),
                                 *block(p, q, kv, False, reserve))
                return _update(out, o_b, p.q_start), _update(lse, l_b, p.q_start)
            return run
        return zigzag_visiting_cond(g=g, rank=rank, step=step, low=merged(low), high=merged(high), operand=state)

    def compute(step, kv, state, q=q):
        first = isinstance(step, int) and step == 0
        reserve = _reserve(not (isinstance(step, int) and step == g - 1))  # the last step sends nothing
        if causal and layout == "zigzag":
            state = zigzag_causal(step, kv, state, q, reserve)
        else:
            written: list[tuple[int, int]] = []  # step 0's static query ranges written so far
            for p in step_pairs(layout=layout, causal=causal, g=g, t_local=q.shape[1], rank=rank, step=step):
                fresh = (first and p.active is True and isinstance(p.q_start, int)
                         and all(p.q_start + p.q_len <= a or b <= p.q_start for a, b in written))
                if isinstance(p.q_start, int):
                    written.append((p.q_start, p.q_start + p.q_len))
                if not fresh:
                    state = f32(state)
                state = pair_fwd(p, kv, state, q, fresh, reserve)
        # The "xla" transport's lax.scan carries float32; the unrolled "pk" steps take any dtype.
        return f32(state) if transport() == "xla" else state

    def deferred_compute(step, kv, parts: LseParts, q=q) -> LseParts:
        """compute with $PK_JAX_RING_SUMS=deferred: each block's (out, lse) kept as a part (lse_parts), merged
        once at the end. A pair that runs under a lax.cond on some members (contiguous causal) is merged into
        the state as it comes; zigzag causal's visiting pair (low or high) leaves its cond over every local row
        (out 0, lse -inf where it has none) in the dtype the block was written in."""
        reserve = _reserve(not (isinstance(step, int) and step == g - 1))  # the last step sends nothing
        if causal and layout == "zigzag":
            own, (low, high) = zigzag_whole_chunks(g=g, t_local=q.shape[1], rank=rank)
            if isinstance(step, int) and step == 0:
                for p in own:
                    parts = parts.add(*block(p, q, kv, True, reserve), p.q_start)
                return parts
            def whole_rows(p):
                def run(_):  # the block over every local row: out 0, lse -inf on the rows it does not cover
                    o, l = block(p, q, kv, False, reserve)
                    rows = ((0, 0), (p.q_start, q.shape[1] - p.q_start - p.q_len))
                    return jnp.pad(o, rows + ((0, 0),) * 2), jnp.pad(l, rows + ((0, 0),), constant_values=-jnp.inf)
                return run
            return parts.add(*zigzag_visiting_cond(g=g, rank=rank, step=step, low=whole_rows(low),
                                                   high=whole_rows(high), operand=()), 0)
        for p in step_pairs(layout=layout, causal=causal, g=g, t_local=q.shape[1], rank=rank, step=step):
            if p.active is True and isinstance(p.q_start, int):
                parts = parts.add(*block(p, q, kv, causal, reserve), p.q_start)
            else:  # merged now, under its lax.cond
                state = parts.result() if parts.parts or parts.base is not None else (out, lse)
                parts = LseParts(pair_fwd(p, kv, state, q, False, reserve), (), (), q.shape)
        return parts

    if transport() == "xla":
        out, lse = _ring_steps(axes, g, (out, lse), (k, v), compute)
    elif (merge_in_kernel() == "kernel" and _kernel_refusal(q, k, scale) is None
          and not cudnn_block.takes(q, k, False, "all")):  # the accumulating forward is our kernel's
        return _forward_accumulated(q, k, v, axes, g, rank, causal, layout, scale)
    elif sums_deferred:
        out, lse = ring_overlap.forward_steps(axes, g, LseParts.empty(q.shape), (k, v), q, deferred_compute).result()
    else:
        out, lse = ring_overlap.forward_steps(axes, g, (out, lse), (k, v), q, compute)
    return out.astype(q.dtype), lse


def _forward_accumulated(q, k, v, axes, g: int, rank, causal: bool, layout: str, scale: float):
    """The forward with every block folded into one float32 state by the attention kernel in place
    (block_accumulate; PK_JAX_RING_MERGE=kernel): the pairs of the "pk" transport's forward (zigzag causal: whole
    chunks, ring_schedule.zigzag_whole_chunks; else step_pairs, whose query rows are always whole here), no
    concatenation, merge pass or dynamic-update-slice between the kernels. A step-0 pair writes its rows (each
    is written once there), later pairs merge. The state's LSE stays in the kernel's (B, N, T) layout to the end."""
    b, t, n, _ = q.shape
    acc = full_varying(q.shape, 0.0, jnp.float32, like=(q, k, v), axes=axes)
    lse = full_varying((b, n, t), -jnp.inf, jnp.float32, like=(q, k, v), axes=axes)
    whole_chunks = causal and layout == "zigzag"

    def block(p: BlockPair, q, kv, state, merge: bool, causal: bool, reserve: int):
        return accumulate(_slice(q, p.q_start, p.q_len), _slice(kv[0], p.kv_start, p.kv_len),
                          _slice(kv[1], p.kv_start, p.kv_len), _offsets(p.q_offset, p.kv_offset), *state,
                          row_start=p.q_start, merge=merge, scale=scale, causal=causal, reserve_sms=reserve)

    def compute(step: int, kv, state, q_local):
        reserve = _reserve(step < g - 1)  # the last step sends nothing
        if whole_chunks:
            own, (low, high) = zigzag_whole_chunks(g=g, t_local=t, rank=rank)
            if step == 0:
                for p in own:  # each query row written once
                    state = block(p, q_local, kv, state, False, True, reserve)
                return state
            return zigzag_visiting_cond(g=g, rank=rank, step=step, operand=state,
                                        low=lambda s: block(low, q_local, kv, s, True, False, reserve),
                                        high=lambda s: block(high, q_local, kv, s, True, False, reserve))
        for p in step_pairs(layout=layout, causal=causal, g=g, t_local=t, rank=rank, step=step):
            fresh = step == 0 and p.active is True  # step 0's one pair covers every row
            state = _when(p.active, lambda s, p=p, fresh=fresh: block(p, q_local, kv, s, not fresh, causal, reserve),
                          state)
        return state

    acc, lse = ring_overlap.forward_steps(axes, g, (acc, lse), (k, v), q, compute)
    return acc.astype(q.dtype), jnp.swapaxes(lse, 1, 2)


def _fwd_rule(q, k, v, axes, causal, layout, scale):
    out, lse = _forward(q, k, v, axes, causal, layout, scale)
    return out, (q, k, v, out, lse)


def _bwd_rule(axes, causal, layout, scale, res, d_out):
    from pk_jax.attention import _kernel_refusal, backward_kernel_enabled  # pk_jax.attention imports this package

    q, k, v, out, lse = res
    g = group_size(axes)
    rank = lax.axis_index(axes)
    do = d_out.astype(q.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # (B, T, N)
    like = (q, k, v, do)
    dq = full_varying(q.shape, 0.0, jnp.float32, like=like, axes=axes)
    dkv = (full_varying(k.shape, 0.0, jnp.float32, like=like, axes=axes),) * 2  # the "xla" transport's accumulators

    zero_kv = lambda dtype=jnp.float32: full_varying(k.shape, 0.0, dtype, like=like, axes=axes)
    zero_q = lambda: full_varying(q.shape, 0.0, jnp.float32, like=like, axes=axes)
    # $PK_JAX_RING_SUMS=deferred ("pk" transport): dQ and the owner's dK/dV kept as RowSum parts, summed in one
    # pass where an array is needed (a lax.cond operand, a hop, an in-kernel add, the end) instead of one float32
    # pass per pair.
    deferred = deferred_sums() and transport() == "pk"
    if deferred:
        dq = RowSum.of(dq)
    as_array = lambda x: x.array() if isinstance(x, RowSum) else x  # float32 where it is a RowSum
    # PK_JAX_RING_MERGE=kernel or dq: each pair's dQ added into the float32 state by the backward's dQ conversion
    # kernel (block_accumulate.accumulate_bwd) where our backward kernel takes the pair ("pk" transport only);
    # dq-direct: by the backward kernel itself, which also reads the pair's q and dO rows in place.
    dq_in_kernel = (merge_in_kernel() in ("kernel", "dq", "dq-direct") and transport() == "pk"
                    and _kernel_refusal(q, k, scale) is None and backward_kernel_enabled())
    in_place = dq_in_kernel and merge_in_kernel() == "dq-direct"
    # The pairs on cuDNN (cudnn_block) read the final output; without them it stays out of the steps' inputs.
    out_for_pairs = out if cudnn_block.takes(q, k, False, "all", backward=True) else None

    def pair_bwd(p: BlockPair, kv, state, local, reserve: int):
        q, do, lse, delta, out = local

        def add_kv(acc, part):
            """acc + part at the pair's key rows, in float32; acc None: a fresh (zero) accumulator, so the part
            is taken as is, in its own dtype: whole if it covers every key row, else written into zeros of
            that dtype (exact either way; no zeros read back). Deferred sums: a RowSum (static key rows)."""
            if isinstance(acc, RowSum) or (acc is None and deferred and isinstance(p.kv_start, int)):
                return (acc or RowSum.empty(k.shape)).add(part, p.kv_start)
            if acc is None:
                if isinstance(p.kv_start, int) and p.kv_start == 0 and p.kv_len == k.shape[1]:
                    return part
                return _update(zero_kv(part.dtype), part, p.kv_start)
            acc = acc.astype(jnp.float32)
            return _update(acc, _slice(acc, p.kv_start, p.kv_len) + part.astype(jnp.float32), p.kv_start)

        def run(state):
            dq, (dk, dv) = state
            sl_q = lambda x: _slice(x, p.q_start, p.q_len)
            sl_kv = lambda x: _slice(x, p.kv_start, p.kv_len)
            on_cudnn = cudnn_block.takes(q, kv[0], causal, p.visible, rows=p.q_len, backward=True)
            if dq_in_kernel and isinstance(p.q_start, int) and not on_cudnn:  # the dQ conversion adds in place
                offsets = _offsets(p.q_offset, p.kv_offset)
                base = (dq.base if dq.base is not None else zero_q()) if isinstance(dq, RowSum) else dq
                q_p, do_p = (q, do) if in_place else (sl_q(q), sl_q(do))
                base, dk_b, dv_b = accumulate_bwd(q_p, sl_kv(kv[0]), sl_kv(kv[1]), do_p, sl_q(lse), sl_q(delta),
                                                  offsets, base, row_start=p.q_start, scale=scale, causal=causal,
                                                  reserve_sms=reserve, in_place=in_place)
                dq = dataclasses.replace(dq, base=base) if isinstance(dq, RowSum) else base  # parts stay pending
                return dq, (add_kv(dk, dk_b), add_kv(dv, dv_b))
            dq_b, dk_b, dv_b = _block_backward(sl_q(q), sl_kv(kv[0]), sl_kv(kv[1]), sl_q(do), sl_q(lse),
                                               sl_q(delta), scale, causal, p.q_offset, p.kv_offset, reserve,
                                               None if out is None else sl_q(out), p.visible)
            if isinstance(dq, RowSum):
                return dq.add(dq_b, p.q_start), (add_kv(dk, dk_b), add_kv(dv, dv_b))
            return _update(dq, sl_q(dq) + dq_b, p.q_start), (add_kv(dk, dk_b), add_kv(dv, dv_b))
        if p.active is not True:  # lax.cond needs arrays on both sides, of run's (float32) dtype
            dq, (dk, dv) = state
            state = (as_array(dq), tuple(zero_kv() if a is None else as_array(a).astype(jnp.float32) for a in (dk, dv)))
            dq, dkv_ = _when(p.active, run, state)
            return (RowSum.of(dq) if deferred else dq), dkv_
        return _when(p.active, run, state)

    def run(pairs, kv, state, local=(q, do, lse, delta, out_for_pairs), in_flight: bool | None = None):
        """The pairs' gradients added into state; in_flight: a ring shift may run beside them (SMs left free);
        None: whenever there is a ring (G > 1)."""
        reserve = _reserve(g > 1 if in_flight is None else in_flight)
        for p in pairs:
            state = pair_bwd(p, kv, state, local, reserve)
        dq, (dk, dv) = state
        return dq, tuple(zero_kv() if a is None else a for a in (dk, dv))  # a step without pairs

    def contribution(c):
        """A visiting step's (dk, dv) as the arrays that leave for the next member: a RowSum in the dtype that
        keeps it exact (a single pair's part: the kernel's)."""
        return tuple(x.total(x.exact_dtype()) if isinstance(x, RowSum) else x for x in c)

    def in_cond(fn):
        """fn for a lax.cond branch: dq in and out as a float32 array, dK/dV as arrays."""
        def branch(dq):
            dq, c = fn(dq)
            return as_array(dq), contribution(c)
        return branch

    pairs_at = lambda step: step_pairs(layout=layout, causal=causal, g=g, t_local=q.shape[1], rank=rank, step=step)
    if transport() == "xla":
        # dK/dV of the visiting block travel with it; after G hops each accumulator is back at its owner.
        send_dkv = lambda state, send: (state[0], send(state[1]))
        dq, (dk, dv) = _ring_steps(axes, g, (dq, dkv), (k, v), lambda step, kv, st: run(pairs_at(step), kv, st),
                                   send_after=send_dkv)
    else:
        first, last = own_pairs_split(layout=layout, causal=causal, g=g, t_local=q.shape[1], rank=rank)
        # Shifts beside a visiting step: the next K/V block (s < G-1), the previous step's accumulator (s >= 2).
        busy = lambda step: step < g - 1 or step >= 2

        def visiting_pairs(step, kv, dq, local):
            if not (causal and layout == "zigzag"):
                dq, c = run(pairs_at(step), kv, (dq, (None, None)), local, busy(step))
                return dq, contribution(c)
            _, (low, high) = zigzag_whole_chunks(g=g, t_local=q.shape[1], rank=rank)
            # On cuDNN, the pair's dQ leaves the cond as a part.
            if deferred and cudnn_block.takes(q, kv[0], causal, "all", backward=True):
                return visiting_part(step, kv, dq, local, low, high)
            dq, c = zigzag_visiting_cond(
                g=g, rank=rank, step=step, operand=as_array(dq),
                low=in_cond(lambda dq: run([low], kv, (dq, (None, None)), local, busy(step))),
                high=in_cond(lambda dq: run([high], kv, (dq, (None, None)), local, busy(step))))
            return (RowSum.of(dq) if deferred else dq), c

        def visiting_part(step, kv, dq, local, low, high):
            """Deferred sums, zigzag causal, the pair on cuDNN: the step's one pair (low or high, lax.cond) returns
            its dQ over every local row (zeros where it has none) in q's dtype (cuDNN's, exact), added to dq as a
            part: no float32 pass inside the cond, and none to flush dq before it. (Pairs on our kernel keep the
            cond over dq: their dQ is added in place by the kernel.)"""
            def branch(pair):
                def fn(_):
                    dq_part, c = run([pair], kv, (RowSum.empty(q.shape), (None, None)), local, busy(step))
                    return dq_part.total(q.dtype), contribution(c)
                return fn
            dq_part, c = zigzag_visiting_cond(g=g, rank=rank, step=step, operand=(), low=branch(low), high=branch(high))
            return dq.add(dq_part, 0), c

        dq, (dk, dv) = ring_overlap.backward_steps(
            axes, g, dq, (k, v), (q, do, lse, delta, out_for_pairs),
            own_first=lambda kv, dq, local: run(first, kv, (dq, (None, None)), local),
            own_last=lambda kv, dq, own, local: run(last, kv, (dq, own), local),
            visiting=visiting_pairs,
            final_dtype=k.dtype)
    result = lambda x, dtype: x.total(dtype) if isinstance(x, RowSum) else x.astype(dtype)
    return result(dq, q.dtype), result(dk, k.dtype), result(dv, v.dtype)


_ring_attention.defvjp(_fwd_rule, _bwd_rule)
