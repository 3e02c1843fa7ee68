"""Index math for the collective kernels, done once at trace time.

Every op moves a *box*: an n-d block whose rows (up to 3 outer dimensions with arbitrary strides)
end in a run that is contiguous in both source and destination. The box's origin depends on the
run-time rank (and, for pushes, the destination peer) through two offsets each. The kernels see
only the canonical form built here (`Box.fields()`), in units of `vec_bytes`-wide vectors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

MAX_OUTER_DIMS = 3
VECTOR_WIDTHS = (16, 8, 4, 2)
# Reduction kernels come in two widths: 16 bytes, or one element.
REDUCE_WIDTHS = (16,)


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a row-major array of `shape`."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


@dataclasses.dataclass(frozen=True)
class Box:
    """A canonical box in vector units (mirrors kernels/pk/box.cuh)."""

    rows: int
    inner: int
    extent: tuple[int, int, int]
    src_stride: tuple[int, int, int]
    dst_stride: tuple[int, int, int]
    src_rank_offset: int
    src_peer_offset: int
    dst_rank_offset: int
    dst_peer_offset: int
    vec_bytes: int

    def fields(self) -> tuple[int, ...]:
        """The 15 integers the FFI handler decodes, in its order."""
        return (self.rows, self.inner, *self.extent, *self.src_stride, *self.dst_stride,
                self.src_rank_offset, self.src_peer_offset, self.dst_rank_offset, self.dst_peer_offset)

    def row_offsets(self, row: int) -> tuple[int, int]:
        """(src, dst) offsets of `row`, the same mixed-radix walk as Box::row_offsets."""
        src = dst = 0
        for d in reversed(range(MAX_OUTER_DIMS)):
            i = row % self.extent[d]
            row //= self.extent[d]
            src += i * self.src_stride[d]
            dst += i * self.dst_stride[d]
        return src, dst


def make_box(shape: Sequence[int], src_strides: Sequence[int], dst_strides: Sequence[int], *,
             itemsize: int, src_rank_offset: int = 0, src_peer_offset: int = 0,
             dst_rank_offset: int = 0, dst_peer_offset: int = 0,
             widths: Sequence[int] = VECTOR_WIDTHS) -> Box:
    """Canonicalizes a box given in elements: drops unit dims, merges dims contiguous on both
    sides, and picks the widest vector (from `widths`, else one element) that divides every
    length, stride and offset."""
    dims = [(n, s, d) for n, s, d in zip(shape, src_strides, dst_strides) if n != 1]
    if not dims or dims[-1][1] != 1 or dims[-1][2] != 1:
        dims.append((1, 1, 1))  # innermost run must be unit-stride on both sides
    merged = [dims[-1]]
    for n, s, d in reversed(dims[:-1]):
        n0, s0, d0 = merged[0]
        if s == n0 * s0 and d == n0 * d0:
            merged[0] = (n * n0, s0, d0)
        else:
            merged.insert(0, (n, s, d))
    inner = merged[-1][0]
    outer = merged[:-1]
    if len(outer) > MAX_OUTER_DIMS:
        raise ValueError(f"pk_jax: layout needs {len(outer)} strided dimensions (max {MAX_OUTER_DIMS})")
    quantities = [inner, src_rank_offset, src_peer_offset, dst_rank_offset, dst_peer_offset]
    quantities += [s for _, s, _ in outer] + [d for _, _, d in outer]
    vec_bytes = next(v for v in tuple(widths) + (itemsize,)
                     if v % itemsize == 0 and all(q * itemsize % v == 0 for q in quantities))
    per = vec_bytes // itemsize
    outer = [(1, 0, 0)] * (MAX_OUTER_DIMS - len(outer)) + outer
    return Box(
        rows=math.prod(n for n, _, _ in outer),
        inner=inner // per,
        extent=tuple(n for n, _, _ in outer),
        src_stride=tuple(s // per for _, s, _ in outer),
        dst_stride=tuple(d // per for _, _, d in outer),
        src_rank_offset=src_rank_offset // per,
        src_peer_offset=src_peer_offset // per,
        dst_rank_offset=dst_rank_offset // per,
        dst_peer_offset=dst_peer_offset // per,
        vec_bytes=vec_bytes,
    )


def _insert(seq: Sequence[int], pos: int, value: int) -> tuple[int, ...]:
    return tuple(seq[:pos]) + (value,) + tuple(seq[pos:])


def all_gather_box(shape: Sequence[int], axis: int, tiled: bool, group: int, itemsize: int):
    """Rank r's x lands at block r along `axis` of every member's output."""
    if tiled:
        out = _insert(shape[:axis], axis, shape[axis] * group) + tuple(shape[axis + 1:])
        dst = row_major_strides(out)
        rank_offset = shape[axis] * dst[axis]
        box = make_box(shape, row_major_strides(shape), dst, itemsize=itemsize, dst_rank_offset=rank_offset)
    else:
        out = _insert(shape, axis, group)
        out_strides = row_major_strides(out)
        dst = out_strides[:axis] + out_strides[axis + 1:]
        box = make_box(shape, row_major_strides(shape), dst, itemsize=itemsize,
                       dst_rank_offset=out_strides[axis])
    return out, box


def reduce_scatter_box(shape: Sequence[int], dim: int, tiled: bool, group: int, itemsize: int):
    """Rank r sums block r along `dim` of every member's x."""
    src = row_major_strides(shape)
    if tiled:
        out = tuple(shape[:dim]) + (shape[dim] // group,) + tuple(shape[dim + 1:])
        box = make_box(out, src, row_major_strides(out), itemsize=itemsize,
                       src_rank_offset=out[dim] * src[dim], widths=REDUCE_WIDTHS)
    else:
        out = tuple(shape[:dim]) + tuple(shape[dim + 1:])
        box = make_box(out, src[:dim] + src[dim + 1:], row_major_strides(out), itemsize=itemsize,
                       src_rank_offset=src[dim], widths=REDUCE_WIDTHS)
    return out, box


def all_reduce_box(shape: Sequence[int], group: int, itemsize: int, two_shot: bool):
    """One-shot: every rank sums everything. Two-shot: rank r sums chunk r of the flattened
    array and writes it into every member's output. Returns None for two-shot when the array
    does not split into whole vectors per rank."""
    total = math.prod(shape)
    if not two_shot:
        return tuple(shape), make_box((total,), (1,), (1,), itemsize=itemsize, widths=REDUCE_WIDTHS)
    if total % group:
        return tuple(shape), None
    chunk = total // group
    return tuple(shape), make_box((chunk,), (1,), (1,), itemsize=itemsize, src_rank_offset=chunk,
                                  dst_rank_offset=chunk, widths=REDUCE_WIDTHS)


def all_to_all_box(shape: Sequence[int], split_axis: int, concat_axis: int, tiled: bool, group: int,
                   itemsize: int):
    """Rank r's block p along `split_axis` lands at block r along `concat_axis` of peer p."""
    src = row_major_strides(shape)
    if tiled:
        box_shape = tuple(shape[:split_axis]) + (shape[split_axis] // group,) + tuple(shape[split_axis + 1:])
        out = list(box_shape)
        out[concat_axis] *= group  # split == concat: the same axis, back to its full size
        out = tuple(out)
        dst = row_major_strides(out)
        rank_offset = box_shape[concat_axis] * dst[concat_axis]
        box = make_box(box_shape, src, dst, itemsize=itemsize,
                       src_peer_offset=box_shape[split_axis] * src[split_axis], dst_rank_offset=rank_offset)
    else:
        kept = tuple(shape[:split_axis]) + tuple(shape[split_axis + 1:])
        out = _insert(kept, concat_axis, group)
        out_strides = row_major_strides(out)
        kept_dst = out_strides[:concat_axis] + out_strides[concat_axis + 1:]
        dst = kept_dst[:split_axis] + (0,) + kept_dst[split_axis:]
        box_shape = tuple(shape[:split_axis]) + (1,) + tuple(shape[split_axis + 1:])
        box = make_box(box_shape, src, dst, itemsize=itemsize, src_peer_offset=src[split_axis],
                       dst_rank_offset=out_strides[concat_axis])
    return out, box
