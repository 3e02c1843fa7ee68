"""dispatch and combine: send each token to its experts' members, bring the weighted expert outputs home.

Two implementations with the same semantics (layout, counts, drops, VJPs), picked at trace time by
pk_jax.moe.fused.use_fused (PK_JAX_MOE_DISPATCH = auto | fused | reference): the fused kernels
(pk_jax/moe/fused.py, kernels/moe_dispatch.cu: counts exchanged and rows pushed / pulled straight between
the members' buffers, default on GPUs), and the reference exchange below (the CPU/XLA path).

Reference exchange: a padded buffer of S rows per destination through pk_jax.all_to_all (device-initiated
on GPUs, jax.lax.all_to_all elsewhere), regrouped by gathers on both sides. jax.lax.ragged_all_to_all
would avoid the padding but XLA:CPU does not implement it (jax 0.11.2: "HLO opcode ragged-all-to-all is
not supported by XLA:CPU"); the fused kernels replace it on GPUs.

dispatch and combine are linear in x and y and each other's transpose, so both have custom VJPs made of
the two exchanges below rather than autodiff through scatters: d(dispatch) = combine with weights 1,
d(combine)/dy = dispatch of the weighted output cotangent.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from pk_jax.collectives import all_to_all
from pk_jax.moe import fused, routing
from pk_jax.moe.routing import RoutingHandle
from pk_jax.sharding import group_size, normalize_axis_name
from pk_jax.sharding.mesh_groups import AxisName


def _swap(buf: jax.Array, axis_name: AxisName, g: int) -> jax.Array:
    """(G * S, H) with block d for member d -> (G * S, H) with block s from member s."""
    return buf if g == 1 else all_to_all(buf, axis_name, 0, 0, tiled=True)


def send_rows(rows: jax.Array, scale: jax.Array | None, h: RoutingHandle) -> jax.Array:
    """Forward exchange: (T, H) token rows, optional (T * K,) per-assignment scale -> (R, H) grouped rows."""
    sz = h.sizes
    assignment = h.send_assignment
    padded = jnp.concatenate([rows, jnp.zeros((1, rows.shape[1]), rows.dtype)])
    buf = padded[jnp.minimum(assignment // sz.top_k, sz.tokens)]  # empty slots hold T * K -> the zero row
    if scale is not None:
        s = jnp.concatenate([scale, jnp.zeros((1,), scale.dtype)])[assignment]
        buf = (buf.astype(jnp.float32) * s[:, None].astype(jnp.float32)).astype(rows.dtype)
    got = _swap(buf, h.axis_name, sz.g)
    got = jnp.concatenate([got, jnp.zeros((1, got.shape[1]), got.dtype)])
    return got[h.recv_source_row]


def return_rows(y: jax.Array, h: RoutingHandle) -> jax.Array:
    """Backward exchange: (R, H) expert rows -> (T * K, H), each assignment's row (zero if it was dropped)."""
    sz = h.sizes
    buf = jnp.zeros((sz.g * sz.send_rows, y.shape[1]), y.dtype).at[h.recv_source_row].set(y, mode="drop")
    got = _swap(buf, h.axis_name, sz.g)
    got = jnp.concatenate([got, jnp.zeros((1, got.shape[1]), got.dtype)])
    return got[h.assignment_slot]


@jax.custom_vjp
def _dispatch_rows(x: jax.Array, h: RoutingHandle) -> jax.Array:
    return send_rows(x, None, h)


def _dispatch_fwd(x, h):
    return send_rows(x, None, h), h


def _dispatch_bwd(h, d_recv):
    back = return_rows(d_recv, h).reshape(h.sizes.tokens, h.sizes.top_k, -1)
    return back.astype(jnp.float32).sum(axis=1).astype(d_recv.dtype), None


_dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


def _weighted_sum(per_choice: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """(T, K, H) rows, (T, K) weights -> (T, H), summed in float32."""
    return jnp.einsum("tkh,tk->th", per_choice.astype(jnp.float32), weights.astype(jnp.float32)).astype(dtype)


@jax.custom_vjp
def _combine_rows(y: jax.Array, weights: jax.Array, h: RoutingHandle) -> jax.Array:
    per_choice = return_rows(y, h).reshape(h.sizes.tokens, h.sizes.top_k, -1)
    return _weighted_sum(per_choice, weights, y.dtype)


def _combine_fwd(y, weights, h):
    per_choice = return_rows(y, h).reshape(h.sizes.tokens, h.sizes.top_k, -1)
    return _weighted_sum(per_choice, weights, y.dtype), (per_choice, weights, h)


def _combine_bwd(res, d_out):
    per_choice, weights, h = res
    dy = send_rows(d_out, weights.reshape(-1), h)
    dw = jnp.einsum("tkh,th->tk", per_choice.astype(jnp.float32), d_out.astype(jnp.float32))
    return dy, dw.astype(weights.dtype), None


_combine_rows.defvjp(_combine_fwd, _combine_bwd)


def _check_routing_args(fn: str, x: jax.Array, topk_ids: jax.Array, num_experts: int, g: int) -> None:
    if x.ndim != 2:
        raise ValueError(f"pk_jax.moe.{fn}: x must be (tokens, hidden), got shape {x.shape}; reshape first")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"pk_jax.moe.{fn}: topk_ids must be (tokens, top_k) with tokens = {x.shape[0]}, "
                         f"got shape {topk_ids.shape}")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"pk_jax.moe.{fn}: topk_ids must be integers, got {topk_ids.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % g:
        raise ValueError(f"pk_jax.moe.{fn}: num_experts={num_experts!r} must be a positive multiple of the "
                         f"group size {g} (experts are split evenly over the axis)")


def dispatch(x: jax.Array, topk_ids: jax.Array, axis_name: AxisName, *, num_experts: int,
             capacity: int | None = None, recv_rows: int | None = None, zero_tail: bool = True
             ) -> tuple[jax.Array, jax.Array, RoutingHandle]:
    """Sends every token to the members holding its top-k experts, grouped by local expert there.

    Call inside `jax.shard_map` with tokens and experts sharded over `axis_name` (G members). Expert e lives
    on member e // L as its local expert e % L, L = num_experts / G.

    Args:
      x: (T, H) this member's tokens.
      topk_ids: (T, K) int, each token's experts in [0, num_experts); ids outside that range are undefined.
        T * K at most 2^24 (the expert counts cross members as float32 through pk_jax.all_to_all).
      axis_name: the expert-parallel mesh axis (or tuple of axes).
      num_experts: E, a multiple of G.
      capacity: None (default): nothing drops. An int C: this member sends at most C rows to each expert
        (GShard / Switch capacity of a local batch; pk_jax.moe.expert_capacity(T, K, E, factor) computes
        ceil(factor * T * K / E)); the assignments dropped are, per expert, the last in priority order:
        choice rank first (every token's first choice before any second choice), then token position.
      recv_rows: R, the static number of output rows. Default: G * min(T * K, L * C) (G * T * K without
        capacity), the worst case, so nothing drops. A smaller bound saves memory; rows arriving past it
        drop from the end of the output order (last local expert, last source, last position) and
        handle.received - sum(counts) says how many did.
      zero_tail: True (default): recv's rows after sum(counts) are zeros, as is the gradient combine returns for
        y there. False: both are unspecified where the fused kernels run (they leave those rows unwritten:
        at G members the default bound is G times the average, so most of the buffer), for consumers that read
        only the rows in use, as pk_jax.grouped_matmul's forward and gradients do (and moe_mlp).

    Returns:
      (recv, counts, handle): recv (R, H) in x's dtype, the received rows grouped by local expert (expert 0's
      rows first, contiguous, no padding between experts; within an expert by source member, then token,
      then choice), zero rows after sum(counts) (see zero_tail); counts (L,) int32 rows per local expert (the
      group_sizes of pk_jax.grouped_matmul); handle, for pk_jax.moe.combine. Dropped assignments arrive nowhere
      and add zero in combine.
    """
    g = group_size(axis_name)
    _check_routing_args("dispatch", x, topk_ids, num_experts, g)
    if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"pk_jax.moe.dispatch: capacity={capacity!r} must be None or an int >= 0")
    if recv_rows is not None and (not isinstance(recv_rows, int) or recv_rows < 1):
        raise ValueError(f"pk_jax.moe.dispatch: recv_rows={recv_rows!r} must be None or an int >= 1")
    sizes = routing.routing_sizes(g, num_experts, x.shape[0], topk_ids.shape[1], capacity, recv_rows,
                                  bool(zero_tail))
    if fused.use_fused(sizes, x.shape[1], x.dtype):
        axes = normalize_axis_name(axis_name)
        lp = routing.plan_local(topk_ids, sizes)
        recv, recv_counts, send_row = fused.dispatch_rows(x, lp.key, lp.pos, axes, sizes)
        recv_source_row, expert_counts, received = routing.plan_receive(recv_counts, sizes)
        h = RoutingHandle(lp.send_assignment, lp.assignment_slot, recv_source_row, expert_counts, received, lp.sent,
                          send_row, axis_name, sizes)
        return recv, expert_counts, h
    h = routing.plan(topk_ids, axis_name, sizes)
    return _dispatch_rows(x, h), h.expert_counts, h


def combine(y: jax.Array, topk_weights: jax.Array, handle: RoutingHandle) -> jax.Array:
    """Brings expert outputs home and sums each token's choices by weight: the transpose of dispatch.

    Args:
      y: (R, H') the experts' output rows, in dispatch's output order (H' may differ from dispatch's H).
      topk_weights: (T, K) each choice's weight (as topk_ids of dispatch).
      handle: dispatch's routing handle.

    Returns:
      (T, H') in y's dtype: out[t] = sum_k topk_weights[t, k] * y[row of (t, k)], accumulated in float32;
      dropped choices add zero.
    """
    sz = handle.sizes
    if y.ndim != 2 or y.shape[0] != sz.recv_rows:
        raise ValueError(f"pk_jax.moe.combine: y must be (recv_rows, hidden) with recv_rows = {sz.recv_rows} "
                         f"(dispatch's output rows), got shape {y.shape}")
    if topk_weights.shape != (sz.tokens, sz.top_k):
        raise ValueError(f"pk_jax.moe.combine: topk_weights must be (tokens, top_k) = {(sz.tokens, sz.top_k)}, "
                         f"got shape {topk_weights.shape}")
    if handle.send_row is not None and jnp.dtype(y.dtype) in fused.DTYPES and y.shape[1] > 0:
        return fused.combine_rows(y, topk_weights, handle.send_row, handle.received,
                                  normalize_axis_name(handle.axis_name), sz)
    return _combine_rows(y, topk_weights, handle)
