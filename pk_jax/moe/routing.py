"""The routing layout of expert parallelism: where each (token, choice) assignment goes and comes back.

Experts are sharded over a mesh axis of G members, L = E / G consecutive experts each (expert e lives on
member e // L as its local expert e % L). Each member holds T tokens with K choices each (T * K
assignments, assignment a = t * K + k). The layout is computed inside the op with jnp: a stable sort of
the assignments by expert (which is by (destination, local expert), position order within an expert),
per-destination offsets by cumsum, and one all-to-all of the (G, L) counts so that every member knows
what it will receive (through pk_jax.all_to_all like the rows, never an XLA collective, which ranks sharing
a GPU cannot run; as float32, exact because a count is at most T * K <= MAX_ASSIGNMENTS = 2^24). Senders
use a padded buffer of S rows per destination (the reference exchange); receivers regroup what arrives
into R rows, expert-major, source-major within an expert. The fused path (pk_jax/moe/fused.py) shares the
sender-local half (plan_local: capacity, each assignment's position within its expert) and the receiver's
(plan_receive, from the counts its kernel exchanged), and records each assignment's destination row
(RoutingHandle.send_row) instead of using the padded buffer.

Dropping (both deterministic, both documented on pk_jax.moe.dispatch):
- capacity C: each member sends at most C rows to each expert, as in GShard / Switch (the capacity of a
  group, here a member's local batch, per expert). Priority: choice rank first, then token position: every
  token's first choice before any second choice, earlier tokens before later ones. The rest drop.
- recv_rows R below the worst case: the rows past R in the receiver's output order (last local experts,
  last sources, last positions) drop.
A dropped assignment receives nothing and contributes zero to combine (the token keeps its residual).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pk_jax.collectives import all_to_all
from pk_jax.sharding.mesh_groups import AxisName

# pk_jax.all_to_all moves floating-point payloads only, so the counts cross as float32, whose 24-bit
# significand holds every integer up to 2^24 exactly. A count is at most T * K (every assignment of a member
# to one expert), so routing_sizes refuses T * K above this and the int32 -> float32 -> int32 trip is exact.
MAX_ASSIGNMENTS = 1 << 24


@dataclasses.dataclass(frozen=True)
class RoutingSizes:
    """Static sizes of one routing: G members, E experts (L per member), T tokens, K choices, S padded send
    rows per destination, R output rows per member, C capacity per (member, expert) or None."""
    g: int
    num_experts: int
    tokens: int
    top_k: int
    send_rows: int
    recv_rows: int
    capacity: int | None
    zero_tail: bool = True  # rows of recv (and of combine's d y) past those received: zeros, else unspecified

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.g


def routing_sizes(g: int, num_experts: int, tokens: int, top_k: int, capacity: int | None,
                  recv_rows: int | None, zero_tail: bool = True) -> RoutingSizes:
    """The static sizes, defaults included: S = T * K without capacity (every assignment to one member),
    min(T * K, L * C) with it; R = G * S unless the caller bounds it."""
    if tokens * top_k > MAX_ASSIGNMENTS:
        raise ValueError(f"pk_jax.moe.dispatch: tokens * top_k = {tokens} * {top_k} = {tokens * top_k} exceeds "
                         f"{MAX_ASSIGNMENTS} (2^24) per member: the expert counts cross members as float32, exact "
                         f"only up to 2^24; split the tokens into smaller calls")
    local = num_experts // g
    send = tokens * top_k if capacity is None else min(tokens * top_k, local * capacity)
    return RoutingSizes(g, num_experts, tokens, top_k, send, g * send if recv_rows is None else recv_rows, capacity,
                        zero_tail)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoutingHandle:
    """What combine (and the backward of dispatch) needs to send rows back. Returned by pk_jax.moe.dispatch.

    Arrays (per member):
      send_assignment: (G * S,) the assignment a = t * K + k in each send slot (dest-major), T * K if empty.
      assignment_slot: (T * K,) each assignment's send slot, G * S if dropped by capacity.
      recv_source_row: (R,) for each output row, its row in the received (G * S) buffer, G * S if empty.
      expert_counts: (L,) rows per local expert in the output (after any recv_rows overflow).
      received: () rows that arrived before the recv_rows bound; received - sum(expert_counts) dropped here.
      sent: () assignments this member sent (T * K minus its capacity drops).
      send_row: (T * K,) the fused path's layout (pk_jax.moe.fused): each assignment's destination member d
        and row i there as d * R + i, -1 if dropped (capacity or the recv_rows bound); None on the reference
        path, whose exchange uses the slots above.
    """
    send_assignment: jax.Array
    assignment_slot: jax.Array
    recv_source_row: jax.Array
    expert_counts: jax.Array
    received: jax.Array
    sent: jax.Array
    send_row: jax.Array | None
    axis_name: AxisName = dataclasses.field(metadata=dict(static=True))
    sizes: RoutingSizes = dataclasses.field(metadata=dict(static=True))


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def capacity_keep(expert: jax.Array, num_experts: int, tokens: int, top_k: int, capacity: int) -> jax.Array:
    """(T * K,) bool: which assignments fit their expert's capacity, GShard priority (choice rank, then token).

    expert: (T * K,) expert of assignment a = t * K + k.
    """
    a = jnp.arange(tokens * top_k, dtype=jnp.int32)
    priority = (a % top_k) * tokens + a // top_k
    # Sort by (expert, priority); an assignment's rank among its expert's is its index minus the expert's start.
    order = jnp.lexsort((priority, expert))
    counts = jnp.zeros(num_experts, jnp.int32).at[expert].add(1)
    rank_sorted = jnp.arange(tokens * top_k, dtype=jnp.int32) - _exclusive_cumsum(counts)[expert[order]]
    rank = jnp.zeros(tokens * top_k, jnp.int32).at[order].set(rank_sorted)
    return rank < capacity


_RANK_MAX_N = 1 << 16  # above: argsort (the blocked counting below grows as n^2 / block)
_RANK_MAX_CELLS = 1 << 21  # n x keys: few experts, where XLA's sort was measured slow (larger: its radix sort)


def stable_sort_by_key(key: jax.Array, num_keys: int) -> tuple[jax.Array, jax.Array]:
    """(order, sorted_index) of a stable sort of key (n,) int32 with values in [0, num_keys): order[i] is the
    assignment at sorted position i, sorted_index its inverse.

    Why not argsort alone: on 2x H100 (2026-11-26) XLA's sort of 8,192 keys took 39 us of a 221 us dispatch
    (E 8, top-2). For few keys (n <= 2^16, n x keys <= 2^21) the position is counted instead: within blocks of
    up to 256 by comparing every pair, across blocks by each block's counts per key (a few fused reductions, no
    sort): on 2x H100 that dispatch then spanned 178.5 us, ~11 us of it before the kernel. Larger cases keep the
    argsort."""
    n = key.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    if n > _RANK_MAX_N or n * (num_keys + 1) > _RANK_MAX_CELLS or n == 0:
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
        return order, jnp.zeros(n, jnp.int32).at[order].set(index)
    block = max(128, (-(-n // 256) + 127) // 128 * 128)  # at most 256 blocks
    nb = -(-n // block)
    kb = jnp.pad(key, (0, nb * block - n), constant_values=num_keys).reshape(nb, block)  # pads: a key after all
    j = jnp.arange(block)
    earlier = j[None, :] < j[:, None]  # [a, b]: b before a
    within = jnp.sum((kb[:, :, None] == kb[:, None, :]) & earlier, axis=2, dtype=jnp.int32)  # (nb, block)
    keys = jnp.arange(num_keys + 1, dtype=key.dtype)
    per_block = jnp.sum(kb[:, :, None] == keys, axis=1, dtype=jnp.int32)  # (nb, K + 1)
    before = jnp.arange(nb)[None, :] < jnp.arange(nb)[:, None]  # [i, m]: block m before block i
    block_start = jnp.sum(jnp.where(before[:, :, None], per_block[None], 0), axis=1, dtype=jnp.int32)  # (nb, K+1)
    key_start = _exclusive_cumsum(per_block.sum(axis=0))  # (K + 1,)
    blk = index // block
    sorted_index = key_start[key] + block_start[blk, key] + within.reshape(-1)[:n]
    return jnp.zeros(n, jnp.int32).at[sorted_index].set(index), sorted_index


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """The sender's half of the routing layout (no communication): per assignment its key (global expert, or
    E if capacity dropped it) and position among this member's kept rows of that expert (position order),
    the padded send layout of the reference exchange, this member's kept rows per global expert, how many it
    sends, and the assignments sorted by (key, pos) (expert e's kept ones at [exclusive cumsum of counts][e]:
    the rows DispatchMatmul's comm CTAs push expert by expert, pk_jax/moe/overlap.py)."""
    key: jax.Array
    pos: jax.Array
    send_assignment: jax.Array
    assignment_slot: jax.Array
    counts: jax.Array
    sent: jax.Array
    order: jax.Array


def plan_local(topk_ids: jax.Array, sizes: RoutingSizes) -> LocalPlan:
    """The sender-local layout of this member's assignments (shared by the reference and the fused path)."""
    g, e, t, k, s = sizes.g, sizes.num_experts, sizes.tokens, sizes.top_k, sizes.send_rows
    local = sizes.local_experts
    n = t * k
    expert = topk_ids.reshape(n).astype(jnp.int32)
    keep = (jnp.ones(n, bool) if sizes.capacity is None
            else capacity_keep(expert, e, t, k, sizes.capacity))
    key = jnp.where(keep, expert, e)  # dropped assignments sort last
    order, sorted_index = stable_sort_by_key(key, e + 1)  # by (dest, local expert), position within
    counts = jnp.zeros(e + 1, jnp.int32).at[key].add(1)[:e]  # kept rows per global expert
    per_dest = counts.reshape(g, local).sum(axis=1)
    dest_start = _exclusive_cumsum(per_dest)
    sorted_key = key[order]
    sorted_dest = jnp.minimum(sorted_key // local, g - 1)
    index = jnp.arange(n, dtype=jnp.int32)
    slot_in_dest = index - dest_start[sorted_dest]
    sorted_slot = jnp.where(sorted_key < e, sorted_dest * s + slot_in_dest, g * s)
    assignment_slot = sorted_slot[sorted_index]
    send_assignment = jnp.full(g * s + 1, n, jnp.int32).at[sorted_slot].set(order)[:g * s]
    # Position among this member's kept rows of the same expert (the fused kernels' offset within a block).
    expert_start = jnp.concatenate([_exclusive_cumsum(counts), jnp.zeros(1, jnp.int32)])
    pos = sorted_index - expert_start[key]
    return LocalPlan(key, pos, send_assignment, assignment_slot, counts, keep.sum(dtype=jnp.int32), order)


def plan_receive(recv_counts: jax.Array, sizes: RoutingSizes) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The receiver's half, from recv_counts (G, L) = rows of each local expert from each source:
    (recv_source_row, expert_counts, received) of RoutingHandle."""
    g, s, r = sizes.g, sizes.send_rows, sizes.recv_rows
    local = sizes.local_experts
    src_expert_start = _exclusive_cumsum(recv_counts, axis=1)  # offset of (source, expert) in that source's rows
    by_expert = recv_counts.T.reshape(local * g)  # output order: expert-major, source-major within
    bounds = jnp.cumsum(by_expert)
    received = bounds[-1]
    rows = jnp.arange(r, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(bounds, rows, side="right"), local * g - 1).astype(jnp.int32)
    expert_of_row, source_of_row = seg // g, seg % g
    within = rows - (bounds[seg] - by_expert[seg])
    src_row = source_of_row * s + src_expert_start[source_of_row, expert_of_row] + within
    recv_source_row = jnp.where(rows < received, src_row, g * s)

    expert_totals = recv_counts.sum(axis=0)
    expert_counts = jnp.clip(r - _exclusive_cumsum(expert_totals), 0, expert_totals)
    return recv_source_row, expert_counts, received


def plan(topk_ids: jax.Array, axis_name: AxisName, sizes: RoutingSizes) -> RoutingHandle:
    """Computes the routing layout of this member's assignments (inside shard_map over `axis_name`): the
    reference path, whose counts cross by pk_jax.all_to_all."""
    g, local = sizes.g, sizes.local_experts
    lp = plan_local(topk_ids, sizes)
    # Every member learns how many rows of each of its local experts each source sends. pk_jax.all_to_all,
    # not jax.lax's (NCCL refuses ranks sharing a GPU); as float32, exact since counts <= T * K <= 2^24.
    recv_counts = lp.counts.reshape(g, local)
    if g > 1:
        sent = recv_counts.astype(jnp.float32)
        recv_counts = all_to_all(sent, axis_name, 0, 0, tiled=True).astype(jnp.int32)  # (source, local expert)
    recv_source_row, expert_counts, received = plan_receive(recv_counts, sizes)
    return RoutingHandle(lp.send_assignment, lp.assignment_slot, recv_source_row, expert_counts, received,
                         lp.sent, None, axis_name, sizes)


def worst_case_recv_rows(g: int, tokens: int, top_k: int) -> int:
    """Rows a member may receive with no dropping: G * T * K (every member's every choice to it)."""
    return g * tokens * top_k


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """GShard / Switch capacity per (member, expert): ceil(factor * T * K / E)."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))
