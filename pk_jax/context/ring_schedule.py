"""Which (query block, key/value block) pairs a ring member computes at each step, and where they sit.

At step s member r holds the K/V shard of member src = (r - s) mod G. Its own shard and the visiting
one are cut into the pieces of the layout (contiguous: one piece of T positions; zigzag: two chunks
of C = T/2, global chunks r and 2G-1-r of the 2G chunks), and a pair is emitted for every piece pair
that is not fully masked:

- non-causal: one pair, everything against everything.
- contiguous, causal: step 0 the diagonal block; later steps the whole block when src < r, nothing
  when src > r (decided at run time: `active`). Unbalanced by design (member G-1 does G blocks).
- zigzag, causal: step 0: (q0, k0) and (q1, k1) on the diagonal, (q1, k0) full, (q0, k1) skipped at
  trace time (chunk 2G-1-r always follows chunk r). Step s >= 1: (q1, k0) always (chunk src < G <=
  2G-1-r), (q0, k1) never, and exactly one of (q0, k0) (when src < r) or (q1, k1) (when src > r): the
  same piece index h on both sides, picked at run time. Every member computes two C x C blocks per
  step: balanced, and no member branches.

Slice starts, global offsets and `active` may be traced values (they depend on the member's index);
everything else is static. Masks are applied from the global offsets, so a pair's result is right
whatever its position; the schedule only decides what is skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

Layout = Literal["zigzag", "contiguous"]
Index = int | jax.Array


@dataclasses.dataclass(frozen=True)
class BlockPair:
    q_start: Index      # first local query row of the pair
    q_len: int
    kv_start: Index     # first row of the visiting K/V shard
    kv_len: int
    q_offset: Index     # global position of query row q_start
    kv_offset: Index    # global position of key row kv_start
    active: bool | jax.Array = True   # False/traced: the pair is fully masked on some members
    # Under a causal mask, what the pair sees (static, for kernels that take no offsets, pk_jax/context/
    # cudnn_block.py): "all" every key, for every query, wherever the pair is active; "diagonal": q_offset ==
    # kv_offset (row i sees keys 0..i); "bottom_right": q_offset + q_len == kv_offset + kv_len with kv_len > q_len
    # (the keys before the last q_len all visible, the last q_len diagonal); "shifted": any other cut of the mask.
    # Without a causal mask: "all".
    visible: str = "all"


def zigzag_offset(member: Index, piece: Index, g: int, chunk: int) -> Index:
    """Global position of piece 0 (chunk `member`) or piece 1 (chunk 2G-1-member) of a member."""
    return jnp.where(piece == 0, member * chunk, (2 * g - 1 - member) * chunk)


def step_pairs(*, layout: Layout, causal: bool, g: int, t_local: int, rank: jax.Array, step: Index) -> list[BlockPair]:
    """The pairs member `rank` computes at ring step `step` (a Python int 0 for the first step)."""
    first = isinstance(step, int) and step == 0
    src = (rank - step) % g
    if not causal:
        return [BlockPair(0, t_local, 0, t_local, 0, 0)]
    if layout == "contiguous":
        if first:
            return [BlockPair(0, t_local, 0, t_local, rank * t_local, rank * t_local, visible="diagonal")]
        return [BlockPair(0, t_local, 0, t_local, rank * t_local, src * t_local, active=src < rank)]
    c = t_local // 2
    off = lambda member, piece: zigzag_offset(member, piece, g, c)
    if first:
        return [BlockPair(0, c, 0, c, off(rank, 0), off(rank, 0), visible="diagonal"),
                BlockPair(c, c, 0, c, off(rank, 1), off(rank, 0)),
                BlockPair(c, c, c, c, off(rank, 1), off(rank, 1), visible="diagonal")]
    h = jnp.where(src < rank, 0, 1)
    return [BlockPair(c, c, 0, c, off(rank, 1), off(src, 0)),
            BlockPair(h * c, c, h * c, c, off(rank, h), off(src, h))]


def zigzag_whole_chunks(*, g: int, t_local: int, rank: jax.Array) -> tuple[tuple[BlockPair, BlockPair],
                                                                               tuple[BlockPair, BlockPair]]:
    """Zigzag causal on whole chunks (fewer calls, slice copies and merges than step_pairs' C x C blocks), as
    ring attention's "pk" transport runs it: (own, visiting).

    own (step 0, the member's shard): (q0, K/V) and (q1, K/V), K/V whole. Chunk 2G-1-r's keys follow chunk r's
    queries, so for q0 they are fully masked (the kernel skips them); for q1 chunk r's keys are placed right
    before chunk 2G-1-r (kv_offset = its position - C): unmasked, and chunk 2G-1-r masked causally. Each query
    row is covered once.
    visiting (step s >= 1, the shard of src): (low, high), exactly one applies: src < r: every query sees all of
    chunk src and nothing of chunk 2G-1-src (low = (q, k0)); src > r: only q1 sees keys, both chunks entirely
    (high = (q1, K/V)). Either is one T x C block: balanced. Their offsets (q = 2C, kv = 0) make every key
    visible to every query, so they are right with or without the causal mask."""
    c = t_local // 2
    at = lambda member, piece: zigzag_offset(member, piece, g, c)
    own = (BlockPair(0, c, 0, 2 * c, at(rank, 0), at(rank, 0), visible="diagonal"),
           BlockPair(c, c, 0, 2 * c, at(rank, 1), at(rank, 1) - c, visible="bottom_right"))
    visiting = (BlockPair(0, 2 * c, 0, c, 2 * c, 0), BlockPair(c, c, 0, 2 * c, 2 * c, 0))
    return own, visiting


def zigzag_visiting_cond(*, g: int, rank: jax.Array, step: int, low: Callable, high: Callable, operand):
    """A visiting step's whole-chunk pair (zigzag_whole_chunks), picked at run time: low(operand) where the visiting
    shard's owner (rank - step) mod G precedes this member, else high(operand) (lax.cond)."""
    return lax.cond((rank - step) % g < rank, low, high, operand)


def own_pairs_split(*, layout: Layout, causal: bool, g: int, t_local: int, rank: jax.Array) -> tuple[list[BlockPair],
                                                                                                      list[BlockPair]]:
    """Step 0's pairs in two parts (first, last) for the overlapped backward (pk_jax/context/ring_overlap.py):
    `first` runs while the K/V block leaves for the next member, `last` after the final dK/dV accumulator
    left for its owner, so that hop runs under local work too. Zigzag causal (whole chunks,
    zigzag_whole_chunks): first q1 against the whole shard (1.5 C x C of work), last q0 (0.5 C x C). Otherwise
    the one pair is cut into two halves of query rows (when the length is even; else all of it goes first)."""
    if causal and layout == "zigzag":
        (q0, q1), _ = zigzag_whole_chunks(g=g, t_local=t_local, rank=rank)
        return [q1], [q0]
    pairs = step_pairs(layout=layout, causal=causal, g=g, t_local=t_local, rank=rank, step=0)
    if len(pairs) != 1 or t_local % 2:
        return pairs, []
    p, half = pairs[0], t_local // 2
    top = dataclasses.replace(p, q_len=half)
    bottom = dataclasses.replace(p, q_start=p.q_start + half, q_len=half, q_offset=p.q_offset + half,
                                 visible={"all": "all", "diagonal": "bottom_right"}.get(p.visible, "shifted"))
    return [top], [bottom]
