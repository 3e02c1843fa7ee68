"""Ring attention's steps with the block transfers overlapped with the compute (the "pk" transport).

Each transfer is an asynchronous ring shift (pk_jax/context/ring_shift.py): started before the compute it
should hide under, finished after it. The steps are unrolled in Python (G <= 8): every step's buffers are
then plain values whose live ranges XLA's buffer assignment sees directly (a lax.scan carry would make
XLA copy the arriving block into the loop's fixed buffer, one block copy per step).

Forward (G - 1 transfers, the last step sends nothing):
    step s:  kv_s = done(shift s-1)      [after step s-1's compute]
             start(shift s: kv_s -> next member)          (s < G-1)
             compute(s, kv_s)            [reads kv_s through the shift's token]

Backward: dQ stays local; the owner keeps its own (step-0) dK/dV; a visiting block's contribution is
computed into a fresh buffer, added to the accumulator that arrived for that block (so the arrival is
needed only after the step's compute), and the sum leaves for the next member at once. The accumulator
of the block held at step s travels to the member that holds it at step s+1; after step G-1 it is one
hop from its owner: G-1 hops, each under compute:
    step 0:     start(kv) ; own pairs, first part
    step s>=1:  kv_s = done(kv shift) ; start(kv_s) (s < G-1) ; c = visiting pairs(kv_s)
                acc = done(acc shift) + c (s >= 2; s = 1: acc = c) ; start(acc -> next member)
    end:        own pairs, last part (under the final hop) ; dK/dV = own + done(acc shift)
The accumulators travel in float32, except the first hop, which carries one pair's contribution as the
attention kernel wrote it (the input dtype: exact), and the final hop into the owner, which carries the input
dtype: the owner returns dK/dV in that dtype, so the visitors' sum is rounded once more (at most one more ulp
of the result) for half the bytes on the one hop. Contributions are widened to float32 inside the adds that
take them. Live at most: the local shard, two K/V blocks (held and
arriving), and the float32 dK/dV of the owner, the fresh contribution, the accumulator leaving and the one
arriving.

$PK_JAX_RING_ACC_DTYPE=input (read when traced; default float32; the "pk" transport only) sends every hop in the input dtype, as
TransformerEngine's context-parallel backward does: half the accumulator bytes (4 GPUs, S 12288, B16 N16 D128:
403 instead of 805 MB per hop, beside the 403 MB K/V block) for one rounding per hop (G - 1 instead of 1). On 4x H100
(2026-11-26, S 12288) it did not change fwd+bwd (52.9 vs 53.5 ms non-causal, 41.6 vs 41.6 causal zigzag).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp

from pk_jax._env import choice_setting
from pk_jax.context.ring_shift import after_token, shift_done, shift_start
from pk_jax.context.row_sum import RowSum

KV = tuple[jax.Array, jax.Array]
ACC_DTYPE_VAR = "PK_JAX_RING_ACC_DTYPE"


def acc_in_input_dtype() -> bool:
    """$PK_JAX_RING_ACC_DTYPE: "float32" (default) or "input" (every dK/dV hop in the input dtype), read when traced."""
    return choice_setting(ACC_DTYPE_VAR, "float32", ("float32", "input"), owner="pk_jax.ring_attention") == "input"


def _step_inputs(kv, local, *tokens):
    """The step's K/V and local inputs, read through one barrier with the shifts' tokens: the step's
    compute (everything derived from `local` too, such as query slices) cannot be hoisted above the
    shifts it should overlap, nor above the arrival of its K/V block. Without `local` in the barrier,
    XLA computes every step's query slices up front and keeps them all alive (seen on CPU)."""
    return after_token((kv, local), *tokens)


def _send_on(kv: KV, local, axes: tuple[Hashable, ...], send: bool, tokens: list):
    """Starts kv's shift to the next member (when `send`) and reads (kv, local) through `tokens` and that
    shift's token: (kv, local, pending) with pending = (ys, token, kv sent) for shift_done, or None."""
    pending = None
    if send:
        ys, token = shift_start(kv, axes)
        tokens = [*tokens, token]
    kv, local = _step_inputs(kv, local, *tokens)
    if send:
        pending = (ys, token, kv)
    return kv, local, pending


def forward_steps(axes: tuple[Hashable, ...], g: int, carry, kv: KV, local, compute: Callable):
    """Runs compute(step, kv, carry, local) -> carry for steps 0..G-1 while `kv` moves one member per
    step; `local` (a pytree: the member's own inputs, e.g. q) is handed to every step."""
    pending = None
    for step in range(g):
        if pending is not None:
            ys, token, sent = pending
            kv = shift_done(ys, token, keep_alive=sent, after=carry)
        kv_step, local_step, pending = _send_on(kv, local, axes, step < g - 1, [])
        carry = compute(step, kv_step, carry, local_step)
    return carry


def backward_steps(axes: tuple[Hashable, ...], g: int, dq: jax.Array, kv: KV, local, *, own_first: Callable,
                   own_last: Callable, visiting: Callable, final_dtype) -> tuple[jax.Array, KV]:
    """The overlapped backward ring. `local`: the member's own inputs (a pytree: q, dO, lse, delta and, for pairs
    on cuDNN, the output), handed to every callback. Callbacks (dq float32; dk/dv float32 or a fresh part in its
    own dtype, which sums widen):
      own_first(kv, dq, local) -> (dq, own):   the first part of step 0's pairs; own = (dk, dv) of the local block
      own_last(kv, dq, own, local) -> (dq, own): the rest of step 0's pairs, added into own
      visiting(step, kv, dq, local) -> (dq, c): step s >= 1's pairs on the visiting block; c = its (dk, dv)
    Returns (dq, (dk, dv)) float32 (at G 1 dk/dv may keep the part's dtype), dk/dv of the local block summed
    over every member's queries; dq and own may be row_sum.RowSum (deferred sums), the arrival then added as a
    part."""
    if g == 1:
        dq, own = own_first(kv, dq, local)
        return own_last(kv, dq, own, local)
    own_kv = kv
    acc_input_dtype = acc_in_input_dtype()  # read (and checked) once, also where no hop uses it (G 2)
    kv, local_step, kv_pending = _send_on(kv, local, axes, True, [])
    dq, own = own_first(kv, dq, local_step)
    acc_pending = None  # (ys, token, sent) of the accumulator in flight
    acc = None
    for step in range(1, g):
        ys, token, sent = kv_pending
        kv = shift_done(ys, token, keep_alive=sent, after=(dq, own, acc))
        tokens = [] if acc_pending is None else [acc_pending[1]]  # the accumulator's start before this compute
        kv, local_step, kv_pending = _send_on(kv, local, axes, step < g - 1, tokens)
        dq, c = visiting(step, kv, dq, local_step)
        if acc_pending is not None:
            ys, token, sent = acc_pending
            arrived = shift_done(ys, token, keep_alive=sent, after=(dq, c))
            c = tuple(a.astype(jnp.float32) + b.astype(jnp.float32) for a, b in zip(arrived, c))
        # Step 1's c is one pair's part, sent in its own dtype (the kernel's: exact, half the bytes of float32).
        acc = c if step < g - 1 and not acc_input_dtype else tuple(x.astype(final_dtype) for x in c)
        acc_ys, acc_token = shift_start(acc, axes)
        acc_pending = (acc_ys, acc_token, acc)
    ys, token, sent = acc_pending
    own_kv, local_step = _step_inputs(own_kv, local, token)
    dq, own = own_last(own_kv, dq, own, local_step)
    # Only dq orders the wait after own_last's kernel (its dK/dV come from the same call): own's sum is then not
    # written out before the wait but fused with the final add (and the caller's conversion), one pass instead of
    # three (2 GPUs, S 12288 causal: ~0.5 ms per array).
    arrived = shift_done(ys, token, keep_alive=sent, after=dq)
    plus = lambda o, a: o.add(a, 0) if isinstance(o, RowSum) else o.astype(jnp.float32) + a.astype(jnp.float32)
    return dq, tuple(plus(o, a) for o, a in zip(own, arrived))
