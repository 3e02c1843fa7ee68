"""The windowed all-to-all: blocks go from strided windows of each member's input straight into strided windows
of every member's output, on the side stream, by the copy engines (ffi/copy_shift.h copy_engine_all_to_all).

    y, token = window_all_to_all_start(x, axes, src=Window(axis, stride, offset, length),
                                       dst=Window(axis, stride, offset, length), out_shape=..., into=None)
    ...compute that reads its inputs through after_token(..., token)...
    y, = shift_done((y,), token, keep_alive=x, after=result_of_that_compute)

Member r sends to every member t (itself included) the block x[src.axis: t * src.stride + src.offset, + src.length]
(every other axis whole), which lands in t's y at [dst.axis: r * dst.stride + dst.offset, + dst.length]. y is
`into` with those windows overwritten, or a fresh array of `out_shape` whose cells no window covers are
unspecified (zeros off GPUs). With src = (split axis, n / G, 0, n / G) and dst = (concat axis, m, 0, m) it is the
tiled all-to-all; with a nonzero src offset it sends one head chunk of every member's block, and with a dst
offset and `into` it writes a chunk of the final layout.

Why (issue 26, Ulysses at 2 GPUs, 2x H100, 2026-11-26 timelines): the head-chunked exchanges did run under the
attention, but each chunk paid a slice per array before the exchange (0.05-0.09 ms each), a select assembling
the arrivals in source order (1.1 ms for chunk 0, 0.27-0.54 for the others) and a transpose of the output back
(0.39 ms), more than the overlap saved. Here the copy engines read and write the windows in place. Measured in
session 16 (2x H100): a strided copy (one 3-D copy, or a 2-D copy per slice) did not run beside a kernel holding
every SM, unlike the ring's contiguous copies; each began as the attention kernel retired its CTAs. Since then
each block is one cudaMemcpy3DBatchAsync op flagged to prefer overlap with compute ($PK_JAX_WINDOW_COPY=3d: the
older form, ffi/copy_shift.cc): in session 17 the peer blocks ran under the attention that way, while the own
block's local copy still waited for free SMs, so with own=False the caller places it on XLA's stream (place_own).

On GPUs the start is the `pk_exchange_start` FFI call (every member a GPU of this process; pk_jax.context.ulysses
uses it outside multi-process jobs by default at G 2, else with $PK_JAX_RING_SHIFT_ENGINE=copy and
$PK_JAX_ULYSSES_A2A=async); elsewhere, and for a group the
runtime cannot serve, it lowers to lax.ppermute and dynamic-update-slices with the same values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config, core, dispatch
from jax._src.lax.parallel import insert_collective_pvary
from jax.interpreters import mlir

from pk_jax import _ext
from pk_jax.context.ring_shift import _kernel_table, _perm, _token_aval
from pk_jax.sharding import group_size

Axes = tuple[Hashable, ...]

pk_exchange_start_p = core.Primitive("pk_exchange_start")
pk_exchange_start_p.multiple_results = True

_MAX_PITCH = 2**31 - 1  # cudaMemcpy3D's pitches are checked against the device's limit; stay well inside it


@dataclasses.dataclass(frozen=True)
class Window:
    """Rows [member * stride + offset, + length) of `axis` (member: the target on the source side, the sender on
    the destination side)."""
    axis: int
    stride: int
    offset: int
    length: int


def _row_major(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


def block_geometry(x_shape: Sequence[int], y_shape: Sequence[int], src: Window, dst: Window, itemsize: int,
                   g: int) -> tuple[int, ...]:
    """The 11 byte counts of the handler's geometry (width, height, depth, src_pitch, src_slice, dst_pitch,
    dst_slice, src_offset, src_stride, dst_offset, dst_stride): the block's dimensions collapsed to a cudaMemcpy3D
    layout. Raises ValueError where the windows are not one (the caller then takes another path)."""
    box = list(x_shape)
    box[src.axis] = src.length
    y_box = list(y_shape)
    y_box[dst.axis] = dst.length
    if box != y_box:
        raise ValueError(f"windows of {tuple(x_shape)} and {tuple(y_shape)} differ in shape: {box} vs {y_box}")
    for name, w, shape in (("src", src, x_shape), ("dst", dst, y_shape)):
        if not (0 <= w.offset and 0 <= w.stride and w.length >= 1
                and (g - 1) * w.stride + w.offset + w.length <= shape[w.axis]):
            raise ValueError(f"{name} window {w} of {g} members does not fit axis {w.axis} of {tuple(shape)}")
    if g > 1 and dst.stride < dst.length:  # the members' copies would race on the shared rows
        raise ValueError(f"dst window {dst}: the {g} senders' windows overlap (stride < length)")
    xs, ys = _row_major(x_shape), _row_major(y_shape)
    # Dimensions of more than one element, innermost last, merged where both sides are contiguous across them.
    dims: list[list[int]] = []
    for n, a, b in zip(box, xs, ys):
        if n == 1:
            continue
        if dims and dims[-1][1] == n * a and dims[-1][2] == n * b:
            dims[-1] = [dims[-1][0] * n, a, b]
        else:
            dims.append([n, a, b])
    if not dims:
        dims = [[1, 1, 1]]
    # Rows of the innermost run where it is contiguous on both sides, else (one head of head_dim 1) of one element;
    # the outer dimensions, outermost first, become (depth, height) once padded with single rows in front.
    if dims[-1][1:] == [1, 1]:
        width, outer = dims[-1][0] * itemsize, dims[:-1]
    else:
        width, outer = itemsize, dims
    if len(outer) > 2:
        raise ValueError(f"{len(outer)} strided dimensions (a 3-D copy takes 2)")
    outer = [[1, 0, 0]] * (2 - len(outer)) + outer
    (depth, ss, ds), (height, sp, dp) = outer
    src_pitch, dst_pitch = (sp * itemsize, dp * itemsize) if height > 1 else (width, width)
    src_slice, dst_slice = (ss * itemsize, ds * itemsize) if depth > 1 else (src_pitch * height, dst_pitch * height)
    too_wide = height * depth > 1 and max(src_pitch, dst_pitch) > _MAX_PITCH  # a contiguous block has no pitch
    if src_slice % src_pitch or dst_slice % dst_pitch or too_wide:
        raise ValueError("the outer strides are not a pitch and a multiple of it")
    return (width, height, depth, src_pitch, src_slice, dst_pitch, dst_slice,
            src.offset * xs[src.axis] * itemsize, src.stride * xs[src.axis] * itemsize,
            dst.offset * ys[dst.axis] * itemsize, dst.stride * ys[dst.axis] * itemsize)


def window_all_to_all_start(x: jax.Array, axes: Axes, *, src: Window, dst: Window,
                            out_shape: Sequence[int] | None = None, into: jax.Array | None = None,
                            own: bool = True) -> tuple[jax.Array, jax.Array]:
    """Starts the windowed all-to-all (module docstring): (y, token); y is valid after shift_done((y,), token, ...).
    own=False: the own block is not copied (its window keeps `into`'s cells); the caller places it on XLA's
    stream with place_own. Raises ValueError for windows that do not fit or do not match."""
    axes = tuple(axes)
    g = group_size(axes)
    shape = tuple(into.shape) if into is not None else tuple(int(n) for n in out_shape)
    if into is not None and (into.dtype != x.dtype or (out_shape is not None and tuple(out_shape) != shape)):
        raise ValueError(f"pk_jax windowed all-to-all: into {into.shape} {into.dtype} does not match x's dtype "
                         f"{x.dtype} / out_shape {out_shape}")
    block_geometry(x.shape, shape, src, dst, x.dtype.itemsize, g)  # raises for windows that cannot be copied
    x = insert_collective_pvary(axes, x)
    operands = (x,) if into is None else (x, insert_collective_pvary(axes, into))
    y, token = pk_exchange_start_p.bind(*operands, axes=axes, g=g, src=src, dst=dst, out_shape=shape, own=bool(own))
    return y, token


def _take(x: jax.Array, w: Window, member) -> jax.Array:
    """Member `member`'s window of x (a traced or static index)."""
    return lax.dynamic_slice_in_dim(x, member * w.stride + w.offset, w.length, axis=w.axis)


def _put(y: jax.Array, block: jax.Array, w: Window, member) -> jax.Array:
    """y with `block` in member `member`'s window."""
    return lax.dynamic_update_slice_in_dim(y, block, member * w.stride + w.offset, axis=w.axis)


def _rank(axes: Axes):
    return lax.axis_index(axes if len(axes) > 1 else axes[0])


def place_own(x: jax.Array, y: jax.Array, axes: Axes, src: Window, dst: Window) -> jax.Array:
    """y with this member's own block of x placed in its window (what the exchange copies unless own=False)."""
    rank = _rank(axes)
    return _put(y, _take(x, src, rank), dst, rank)


def _abstract(x, *into, axes, g, src, dst, out_shape, own):
    y = into[0] if into else x.update(shape=out_shape, dtype=x.dtype)
    if config._check_vma.value:
        varying = frozenset().union(*(a.mat.varying for a in (x, *into)))
        y = y.update(manual_axis_type=x.mat.update(varying=varying))
    return [y, _token_aval((x, *into))]


pk_exchange_start_p.def_abstract_eval(_abstract)
pk_exchange_start_p.def_impl(functools.partial(dispatch.apply_primitive, pk_exchange_start_p))


def reference(x, into, *, axes, g, src: Window, dst: Window, out_shape, own: bool = True):
    """The windowed all-to-all in lax (inside shard_map): the own block placed (if own), then one ppermute per
    distance."""
    rank = _rank(axes)
    y = into if into is not None else jnp.zeros(out_shape, x.dtype)
    if own:
        y = place_own(x, y, axes, src, dst)
    for d in range(1, g):  # member rank - d's block for this member
        got = lax.ppermute(_take(x, src, (rank + d) % g), axes if len(axes) > 1 else axes[0], _perm(g, d))
        y = _put(y, got, dst, (rank - d) % g)
    return y


def _fallback(ctx, x, *into, axes, g, src, dst, out_shape, own):
    def f(x, *into):
        return [reference(x, into[0] if into else None, axes=axes, g=g, src=src, dst=dst, out_shape=out_shape,
                          own=own), jnp.zeros((), jnp.int32)]

    return mlir.lower_fun(f, multiple_results=True)(ctx, x, *into)


def _cuda(ctx, x, *into, axes, g, src, dst, out_shape, own):
    table = _kernel_table(ctx, axes)
    if table is None:
        return _fallback(ctx, x, *into, axes=axes, g=g, src=src, dst=dst, out_shape=out_shape, own=own)
    geometry = (*block_geometry(ctx.avals_in[0].shape, out_shape, src, dst, np.dtype(ctx.avals_in[0].dtype).itemsize,
                                g), int(own))
    return jax.ffi.ffi_lowering("pk_exchange_start", has_side_effect=True,
                                operand_output_aliases={1: 0} if into else None)(
        ctx, x, *into, geometry=np.asarray(geometry, np.int64), mesh_ids=np.asarray(table.mesh_ids, np.int64),
        mesh_shape=np.asarray(table.mesh_shape, np.int64), group_axes=np.asarray(table.group_axes, np.int64))


mlir.register_lowering(pk_exchange_start_p, _fallback)
if _ext.available():
    mlir.register_lowering(pk_exchange_start_p, _cuda, platform="cuda")


# --- a buffer to place blocks into before its exchange starts -------------------------------------------------------

pk_uninitialized_p = core.Primitive("pk_uninitialized")


def uninitialized(like: jax.Array, shape: Sequence[int]) -> jax.Array:
    """An array of `shape` and like's dtype and sharding axes whose contents are unspecified (zeros off GPUs): on
    GPUs no kernel writes it (ffi/uninitialized_handler.cc), so placing a block into it and passing it as an
    exchange's `into` costs only the block. `like` is never read."""
    return pk_uninitialized_p.bind(like, shape=tuple(int(n) for n in shape))


def _uninitialized_abstract(like, *, shape):
    return like.update(shape=shape)  # keeps dtype and (under shard_map) the varying axes


pk_uninitialized_p.def_abstract_eval(_uninitialized_abstract)
pk_uninitialized_p.def_impl(functools.partial(dispatch.apply_primitive, pk_uninitialized_p))
mlir.register_lowering(pk_uninitialized_p, mlir.lower_fun(lambda like, *, shape: jnp.zeros(shape, like.dtype),
                                                           multiple_results=False))
if _ext.available():
    # Side-effecting so that XLA never merges two of them (each is filled in place by its own exchange).
    mlir.register_lowering(pk_uninitialized_p, lambda ctx, like, *, shape: jax.ffi.ffi_lowering(
        "pk_uninitialized", has_side_effect=True)(ctx, like), platform="cuda")


@dataclasses.dataclass(frozen=True)
class HeadSpans:
    """How Ulysses' pipeline cuts every member's block of heads: into `units` equal units, chunk i holding units
    [spans[i][0], spans[i][1]) (the same units of q's and of K/V's blocks, so GQA keeps each query on its K/V head)."""
    units: int
    spans: tuple[tuple[int, int], ...]

    @staticmethod
    def uniform(c: int) -> "HeadSpans":
        return HeadSpans(c, tuple((i, i + 1) for i in range(c)))

    @staticmethod
    def half_ends(c: int) -> "HeadSpans":
        """c + 1 chunks over 2c units: the first and the last one unit wide (half a chunk: less exposed before the
        first attention and after the last), the others two."""
        if c < 2:
            return HeadSpans.uniform(c)
        return HeadSpans(2 * c, ((0, 1), *((2 * i - 1, 2 * i + 1) for i in range(1, c)), (2 * c - 1, 2 * c)))

    def fits(self, heads_per_member: Sequence[int]) -> bool:
        return all(h % self.units == 0 for h in heads_per_member)

    def width(self, heads_per_member: int, i: int) -> tuple[int, int]:
        """(first head, heads) of chunk i in a member's block of `heads_per_member`."""
        unit = heads_per_member // self.units
        u0, u1 = self.spans[i]
        return u0 * unit, (u1 - u0) * unit


def heads_in(x_shape: Sequence[int], g: int, chunks: HeadSpans, i: int) -> tuple[Window, Window, tuple[int, ...]]:
    """Ulysses' exchange of head chunk i of (B, T, H, D): (src, dst, out_shape) of the all_to_all (split 2, concat 1)
    of chunk i's heads of every member's block -> (B, G T, w, D)."""
    b, t, h, d = x_shape
    first, w = chunks.width(h // g, i)
    return Window(2, h // g, first, w), Window(1, t, 0, t), (b, g * t, w, d)


def heads_out(res_shape: Sequence[int], g: int, chunks: HeadSpans, i: int) -> tuple[Window, Window, tuple[int, ...]]:
    """The way back: (B, G T, w, D) of head chunk i -> its heads of the final (B, T, heads, D) (the windows
    the all_to_all (split 1, concat 2) would fill)."""
    b, s, w, d = res_shape
    t = s // g
    u0, u1 = chunks.spans[i]
    per_member = w * chunks.units // (u1 - u0)
    first, _ = chunks.width(per_member, i)
    return Window(1, t, 0, t), Window(2, per_member, first, w), (b, t, g * per_member, d)


def usable(x_shapes: Sequence[Sequence[int]], g: int, chunks: HeadSpans, itemsize: int) -> bool:
    """Whether every exchange of a head-chunked Ulysses call has a 3-D copy layout (else the shift-based one runs)."""
    if not chunks.fits([shape[2] // g for shape in x_shapes]):
        return False
    try:
        for shape in x_shapes:
            for i in range(len(chunks.spans)):
                src, dst, out = heads_in(shape, g, chunks, i)
                block_geometry(shape, out, src, dst, itemsize, g)
                src, dst, final = heads_out(out, g, chunks, i)
                block_geometry(out, final, src, dst, itemsize, g)
    except ValueError:
        return False
    return math.prod(x_shapes[0]) > 0
