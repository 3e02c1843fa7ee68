"""When collectives take the small-message (LL) path, decided at trace time.

The small path (kernels/small_collectives.cu, docs/design-small-collectives.md) sends data as 8-byte
LL lines (4 payload bytes + the op's epoch as flag) straight into each receiver's LL area in its
control block: one cross-GPU trip per phase and no per-call handshakes, but 2x the bytes on NVLink.
So it wins where latency dominates and the bulk path wins for large messages.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Literal

# Payload bytes a sender may put in one receiver's LL area per op: kLLLines * 4 in
# kernels/pk/control_block.h (tests/test_small_path_cpu.py checks that they agree).
SMALL_MAX_BYTES = 1 << 20
# `auto` takes the small path while the payload bytes each GPU sends per op stay within this
# (one-shot all_reduce / all_gather / reduce_scatter: (G - 1) x the per-peer payload). The LL lines
# double it on the wire: 2 MiB at ~350 GB/s is ~6 us, about where the bulk path's ~12 us floor
# (two handshake round trips + launch) stops dominating. Initial value from the numbers;
# `python -m pk_jax.bench collectives --latency --variants` measures the crossover.
AUTO_SEND_BYTES = 1 << 20



def auto_enabled() -> bool:
    """Whether algorithm="auto" may pick the small path: yes unless PK_JAX_SMALL_PATH=0. Measured on 2x H200
    (2026-11-23): device time per op 4.4 us at 4 KiB, 7.1 at 256 KiB, 13.4 at 1 MiB against the bulk path's
    14.6-15.5 and psum's 13.4-24.7 (scripts/latency_floor.py slopes); correct at 2 and 4 ranks.
    algorithm="small" forces it per call, algorithm="one_shot"/"two_shot"/"bulk" refuse it."""
    return os.environ.get("PK_JAX_SMALL_PATH", "1") != "0"


# `variant` attribute values of the pk_collective custom call (ffi/collective_handler.cc).
VARIANT_SMALL = 2           # all_gather, reduce_scatter, one-shot all_reduce
VARIANT_SMALL_TWO_SHOT = 3  # two-shot all_reduce

SmallAllReduce = Literal["small_one_shot", "small_two_shot"]


def words(nbytes: int) -> int:
    """LL lines (4 payload bytes each) of an `nbytes` payload."""
    return -(-nbytes // 4)


def blocks_contiguous(shape: Sequence[int], axis: int) -> bool:
    """Whether the G blocks along `axis` are contiguous runs in row-major order (nothing before it)."""
    return math.prod(shape[:axis]) == 1


def all_reduce_choice(nbytes: int, group: int, auto: bool) -> SmallAllReduce | None:
    """The small-path all_reduce for an `nbytes` array over `group` members, or None where it has none.

    One-shot (every member sends all of x to every peer: one trip, (G-1) x n bytes sent) while that
    stays within AUTO_SEND_BYTES; above it two-shot (owners of 1/G chunks sum theirs and send it back:
    two trips, 2 (G-1)/G x n bytes), which needs the words to split evenly over the members and only
    pays at G > 2. auto=False (algorithm "small"): any size up to SMALL_MAX_BYTES, by the same rule."""
    if nbytes <= 0 or nbytes > SMALL_MAX_BYTES:
        return None
    one_shot_send = (group - 1) * nbytes
    two_shot_send = 2 * (group - 1) * nbytes // group
    two_shot_ok = group > 2 and words(nbytes) % group == 0
    if one_shot_send <= AUTO_SEND_BYTES:
        return "small_one_shot"
    if two_shot_ok and (two_shot_send <= AUTO_SEND_BYTES or not auto):
        return "small_two_shot"
    return None if auto else "small_one_shot"


def copy_fits(payload_bytes: int, group: int, auto: bool) -> bool:
    """all_gather (payload: x) / reduce_scatter (payload: one chunk): whether the small path serves it."""
    if payload_bytes <= 0 or payload_bytes > SMALL_MAX_BYTES:
        return False
    return not auto or (group - 1) * payload_bytes <= AUTO_SEND_BYTES
