"""When collectives take the small-message path, decided at trace time.

The small path (kernels/small_collectives.cu, docs/design-small-collectives.md) writes straight into
registered areas of each receiver's control block: no per-call handshakes. Two protocols:
- LL lines (all_reduce one-/two-shot, all_gather, reduce_scatter): 8-byte lines of 4 payload bytes + the
  op's epoch as flag. One cross-GPU trip per phase, no fence, but 2x the bytes on NVLink.
- chunk flags (all_reduce "small_chunked"): plain 16-byte stores, then per chunk one fence (its stores
  acknowledged, ~1 round trip) and one release flag. Full-rate bytes for one extra trip: it wins where the
  bytes dominate, the LL lines where the trip does.
- pipelined chunk flags (all_reduce "small_pipelined", kernels/small_pipelined.cu): the same areas and
  flags, each CTA's share cut into rounds: the data warps push round i while a signal warp fences and
  flags round i - 1 and the sums of round i - lag run (pk_jax/_pipelined_schedule.py). At its default
  of one round it is the chunk flags' two-shot (reduce-scatter + all-gather) from G = 3: auto / "small"
  take it there in the one-shot chunk flags' place (PK_JAX_AR_PIPELINED: "auto" default, "1" first at any
  G, "0" never).
- LL128 lines (all_reduce "small_ll128", kernels/small_ll128.cu): the LL all_reduce with 128-byte lines of 120
  payload bytes + a flag word, stored and loaded by whole warps: no fence, 1.07x the bytes on the wire, one
  trip (one-shot) or two (two-shot). It relies on a warp's 128-byte line store arriving whole (as NCCL's
  LL128 does on NVLink). At every G auto / "small" take it up to ll128_auto_max_bytes (PK_JAX_AR_LL128:
  "auto" default, "1" first at any G, "0" never). The kernel goes two-shot (reduce-scatter + all-gather of
  lines) from G = 3 and 256 KiB (PK_JAX_AR_LL128_SHOTS=1|2 and PK_JAX_AR_LL128_TWO_SHOT_MIN_BYTES, read once
  per process).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Literal

from pk_jax._env import choice_setting

# Payload bytes a sender may put in one receiver's LL area per op: kLLLines * 4 in
# kernels/pk/control_block.h (tests/test_small_path_cpu.py checks that they agree).
SMALL_MAX_BYTES = 1 << 20
# ... and in its chunk-flag area (kChunkedBytes).
CHUNKED_MAX_BYTES = 8 << 20
# `auto`'s LL limit for all_gather / reduce_scatter: the payload bytes each GPU sends per op ((G - 1) x
# the per-peer payload). The LL lines double it on the wire: 2 MiB at ~350 GB/s is ~6 us, about where the
# bulk path's ~12 us floor (two handshake round trips + launch) stops dominating.
AUTO_SEND_BYTES = 1 << 20
# `auto`'s all_reduce: LL one-shot while (G - 1) x n stays within LL_AUTO_SEND_BYTES, then chunk flags
# while it stays within CHUNKED_AUTO_SEND_BYTES (and n within CHUNKED_MAX_BYTES), then the bulk path.
# Measured on 2x H200 (2026-11-23, scripts/latency_floor.py slopes, us per op, LL / chunk flags): 4 KiB 5.5 /
# 5.7, 16 KiB 4.3 / 6.9, 64 KiB 4.5 / 8.0, 256 KiB 6.9 / 8.3, 1 MiB 13.9 / 10.9: the fence + flag cost ~2.5-3.5 us
# more than the LL trip, which the halved bytes repay only from ~0.5-1 MiB. 8 MiB by chunk flags: 37 us (bulk 49).
LL_AUTO_SEND_BYTES = 512 << 10
CHUNKED_AUTO_SEND_BYTES = 8 << 20
# From G = 3 (where it is two-shot: no more bytes than the bulk two-shot sends), auto / "small" take the
# pipelined chunk flags in place of the one-shot chunk flags, from this size (bytes of x) up to
# CHUNKED_MAX_BYTES; PK_JAX_AR_PIPELINED=1 puts them first at any G from this size. Measured on 4x H100
# (2026-11-27, us per op in chains of 256, chunk flags / pipelined (1 round) / psum): 512 KiB 18.3 / 19.4 / 25.7
# (the LL two-shot, which auto keeps there, 15.6), 1 MiB 23.8 / 21.1 / 31.9, 2 MiB 35.2 / 31.8 / 39.0, 4 MiB
# 56.4 / 42.0 / 56.4, 8 MiB 108.5 / 67.0 / 66.1. At G = 2 (one-shot): 1 MiB 15.6 / 13.7, 8 MiB 41.9 / 47.1:
# mixed, so not taken there.
PIPELINED_MIN_BYTES = 512 << 10
# auto / "small" take LL128 (one-shot; two-shot from G = 3 and 256 KiB, kernels/small_ll128.cu) for x up to
# ll128_auto_max_bytes(G): 8 MiB at G = 2, LL128_AUTO_MAX_BYTES from G = 3. Measured on 2x H200 (2026-11-28, session 31,
# scripts/latency_floor.py slopes in two leases, us per op, LL128 / LL one-shot / chunk flags / psum): 4 KiB 3.92-4.04
# / 4.27-4.54 / 6.06-6.16 / 9.5-13.0, 64 KiB 3.91-3.96 / 4.57-4.97 / 7.2-7.3 / 12.5-13.9, 256 KiB 4.86-4.91 / 6.79-6.89
# / 8.7-8.8 / 15.1-15.5, 1 MiB 8.34-8.41 / 12.6-13.2 / 10.9-11.3 / 20.6-23.4, 2 MiB 13.83-14.36 / - / 14.8-15.0 /
# 28.5-28.7. Session 32, GPUs 0-1 of 4x H200, once the one-shot's sums trailed its sends by 2 quads (LL128 / chunk
# flags / psum): 2 MiB 12.44 / 14.90 / 26.62, 4 MiB 20.29 / 22.60 / 36.48, 8 MiB 34.14 / 37.59 / 47.70. On 4x H200
# (session 32, one lease, LL128 (one- / two-shot) / the old ladder's pick / psum): 4 KiB 5.29 / 7.28 / 15.73, 128 KiB
# 6.47 / 8.44 / 17.85, 512 KiB 8.21 (two-shot) / 13.65 / 23.06, 1 MiB 10.70 / 19.14 / 30.59, 2 MiB 17.91 (two-shot) /
# 27.77 / 37.37; 8 MiB 67.25 against the pipelined chunk flags' 63.36. G = 3 and G > 4: not measured (the same rule).
LL128_AUTO_MAX_BYTES = 2 << 20


def auto_enabled() -> bool:
    """Whether algorithm="auto" may pick the small path: yes unless PK_JAX_SMALL_PATH=0. Measured on 2x H200
    (2026-11-23): device time per op 4.4 us at 4 KiB, 7.1 at 256 KiB, 13.4 at 1 MiB against the bulk path's
    14.6-15.5 and psum's 13.4-24.7 (scripts/latency_floor.py slopes); correct at 2 and 4 ranks.
    algorithm="small" forces it per call, algorithm="one_shot"/"two_shot"/"bulk" refuse it."""
    return os.environ.get("PK_JAX_SMALL_PATH", "1") != "0"


# `variant` attribute values of the pk_collective custom call (ffi/collective_handler.cc).
VARIANT_SMALL = 2           # all_gather, reduce_scatter, one-shot all_reduce
VARIANT_SMALL_TWO_SHOT = 3  # two-shot all_reduce
VARIANT_SMALL_CHUNKED = 4   # all_reduce, chunk-flag protocol
VARIANT_SMALL_PIPELINED = 5  # all_reduce, chunk flags with pushes and sums pipelined
VARIANT_SMALL_LL128 = 6      # all_reduce, 128-byte LL lines (one-shot; two-shot from G = 3 and 256 KiB)

SmallAllReduce = Literal["small_one_shot", "small_two_shot", "small_chunked", "small_pipelined", "small_ll128"]
ALL_REDUCE_VARIANTS = {"small_one_shot": VARIANT_SMALL, "small_two_shot": VARIANT_SMALL_TWO_SHOT,
                       "small_chunked": VARIANT_SMALL_CHUNKED, "small_pipelined": VARIANT_SMALL_PIPELINED,
                       "small_ll128": VARIANT_SMALL_LL128}


def pipelined_mode() -> str:
    """$PK_JAX_AR_PIPELINED: "auto" (default: auto / "small" take "small_pipelined" in place of "small_chunked"
    from G = 3), "1" (first, at any G) or "0" (never)."""
    return choice_setting("PK_JAX_AR_PIPELINED", "auto", ("auto", "0", "1"), owner="pk_jax.all_reduce")


def ll128_mode() -> str:
    """$PK_JAX_AR_LL128: "auto" (default: auto / "small" take "small_ll128" up to ll128_auto_max_bytes, unless
    ranks share a GPU: ll128_lines_whole),
    "1" (first at any G, from 1 byte to CHUNKED_MAX_BYTES) or "0" (only when forced)."""
    return choice_setting("PK_JAX_AR_LL128", "auto", ("auto", "0", "1"), owner="pk_jax.all_reduce")


def ll128_auto_max_bytes(group: int) -> int:
    """The largest x (bytes) auto / "small" send as LL128 lines over `group` members: every size the path serves at
    G = 2 (one-shot, ahead of the chunk flags at 8 MiB), LL128_AUTO_MAX_BYTES from G = 3 (two-shot from 256 KiB; the
    pipelined chunk flags lead at 8 MiB). The kernel's choice of shots (PK_JAX_AR_LL128_SHOTS,
    PK_JAX_AR_LL128_TWO_SHOT_MIN_BYTES) must be equal in every process of a job: members that disagree fail with an
    op-mismatch error naming both knobs (the two kernels' flag words differ)."""
    return CHUNKED_MAX_BYTES if group == 2 else LL128_AUTO_MAX_BYTES


def ll128_lines_whole() -> bool:
    """Whether auto may rely on a warp's 128-byte line store arriving whole (what LL128 needs): between GPUs over
    NVLink, as NCCL's LL128 does. Not where ranks share one GPU (the MPS test mode: stores meet loads in one L2,
    where line atomicity is not promised; one unexplained replay failure there, session 31). On PCIe-only peers
    set PK_JAX_AR_LL128=0."""
    from pk_jax import distributed

    return not distributed.shares_gpu()


def words(nbytes: int) -> int:
    """LL lines (4 payload bytes each) of an `nbytes` payload."""
    return -(-nbytes // 4)


def blocks_contiguous(shape: Sequence[int], axis: int) -> bool:
    """Whether the G blocks along `axis` are contiguous runs in row-major order (nothing before it)."""
    return math.prod(shape[:axis]) == 1


def all_reduce_choice(nbytes: int, group: int, auto: bool) -> SmallAllReduce | None:
    """The small-path all_reduce for an `nbytes` array over `group` members, or None where it has none.

    First LL128 up to ll128_auto_max_bytes (ll128_mode, ll128_lines_whole). Then, in order: LL one-shot (every
    member sends all of x to every peer as LL lines: one trip, 2 (G-1) n bytes
    on the wire) while (G-1) n <= LL_AUTO_SEND_BYTES; at G > 2, LL two-shot (owners of 1/G chunks sum theirs
    and send it back: two trips, 2 (G-1)/G n payload bytes sent, words divisible by G) while that stays
    within AUTO_SEND_BYTES; then the chunk-flag one-shot (plain stores, (G-1) n bytes, one fence + flag per
    chunk) while (G-1) n <= CHUNKED_AUTO_SEND_BYTES and n <= CHUNKED_MAX_BYTES; else None (the bulk path).
    auto=False (algorithm "small"): the same without the chunk-flag path's send limit. The pipelined chunk
    flags take PIPELINED_MIN_BYTES <= n <= CHUNKED_MAX_BYTES: in the chunk-flag one-shot's place from G = 3,
    or before everything under PK_JAX_AR_PIPELINED=1 (pipelined_mode)."""
    if nbytes <= 0:
        return None
    mode = pipelined_mode()
    pipelined = PIPELINED_MIN_BYTES <= nbytes <= CHUNKED_MAX_BYTES
    if mode == "1" and pipelined:
        return "small_pipelined"
    ll128 = ll128_mode()
    if (ll128 == "1" and nbytes <= CHUNKED_MAX_BYTES) or (ll128 == "auto" and nbytes <= ll128_auto_max_bytes(group)
                                                          and ll128_lines_whole()):
        return "small_ll128"
    send = (group - 1) * nbytes
    if nbytes <= SMALL_MAX_BYTES and send <= LL_AUTO_SEND_BYTES:
        return "small_one_shot"
    two_shot_send = 2 * (group - 1) * nbytes // group
    if (group > 2 and nbytes <= SMALL_MAX_BYTES and words(nbytes) % group == 0
            and two_shot_send <= AUTO_SEND_BYTES):
        return "small_two_shot"
    if mode == "auto" and group >= 3 and pipelined:
        return "small_pipelined"
    if nbytes <= CHUNKED_MAX_BYTES and (send <= CHUNKED_AUTO_SEND_BYTES or not auto):
        return "small_chunked"
    return None


def max_bytes(algorithm: str) -> int:
    """The largest x (bytes) a forced small all_reduce algorithm serves."""
    return (CHUNKED_MAX_BYTES if algorithm in ("small", "small_chunked", "small_pipelined", "small_ll128")
            else SMALL_MAX_BYTES)


def copy_fits(payload_bytes: int, group: int, auto: bool) -> bool:
    """all_gather (payload: x) / reduce_scatter (payload: one chunk): whether the small path serves it."""
    if payload_bytes <= 0 or payload_bytes > SMALL_MAX_BYTES:
        return False
    return not auto or (group - 1) * payload_bytes <= AUTO_SEND_BYTES
