"""NumPy model of the two collective kernels, driven by the same Box the GPU kernels receive.

It walks rows with Box.row_offsets and applies the rank/peer origins exactly as
kernels/collectives.cu does, so CPU tests check the trace-time index math against jax.lax semantics.
"""

from __future__ import annotations

import numpy as np

from pk_jax._layout import Box


def _vectors(a: np.ndarray, box: Box) -> np.ndarray:
    """View a flat array as rows of vec_bytes-wide units (as the kernel sees memory)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(-1, box.vec_bytes)


def copy(box: Box, srcs: list[np.ndarray], out_shape, pull: bool = False) -> list[np.ndarray]:
    """all_gather / all_to_all: box(sender, receiver) of sender's src -> receiver's dst."""
    g = len(srcs)
    sv = [_vectors(s, box) for s in srcs]
    dv = [_vectors(np.full(out_shape, np.nan, srcs[0].dtype), box) for _ in range(g)]
    for me in range(g):
        for peer in range(g):
            sender, receiver = (peer, me) if pull else (me, peer)
            for row in range(box.rows):
                so, do = box.row_offsets(row)
                src_off = box.src_rank_offset * sender + box.src_peer_offset * receiver + so
                dst_off = box.dst_rank_offset * sender + box.dst_peer_offset * receiver + do
                dv[receiver][dst_off:dst_off + box.inner] = sv[sender][src_off:src_off + box.inner]
    return [d.reshape(-1).view(srcs[0].dtype).reshape(out_shape) for d in dv]


def reduce(box: Box, srcs: list[np.ndarray], out_shape, broadcast: bool) -> list[np.ndarray]:
    """reduce_scatter / all_reduce: rank r sums box(r) of every src in rank order (float64 here)."""
    g = len(srcs)
    per = box.vec_bytes // srcs[0].dtype.itemsize
    flat = [np.ascontiguousarray(s).reshape(-1).astype(np.float64) for s in srcs]
    dsts = [np.full(int(np.prod(out_shape)), np.nan) for _ in range(g)]
    for r in range(g):
        for row in range(box.rows):
            so, do = box.row_offsets(row)
            s0 = (so + box.src_rank_offset * r) * per
            d0 = (do + box.dst_rank_offset * r) * per
            n = box.inner * per
            total = sum(f[s0:s0 + n] for f in flat)
            for target in (range(g) if broadcast else [r]):
                dsts[target][d0:d0 + n] = total
    return [d.reshape(out_shape) for d in dsts]
