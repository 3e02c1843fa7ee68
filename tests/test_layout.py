"""Trace-time index math (pk_jax._layout) against NumPy versions of the jax.lax semantics, through
a model of the GPU kernels. Runs on CPU; catches wrong strides/origins before they reach a GPU."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kernel_emulator import copy, reduce
from pk_jax import _layout

RNG = np.random.default_rng(0)


def rand(shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def np_all_gather(xs, axis, tiled):
    return np.concatenate(xs, axis) if tiled else np.stack(xs, axis)


def np_all_to_all(xs, split, concat, tiled):
    g = len(xs)
    outs = []
    for me in range(g):
        if tiled:
            parts = [np.split(x, g, axis=split)[me] for x in xs]
            outs.append(np.concatenate(parts, axis=concat))
        else:
            parts = [np.take(x, me, axis=split) for x in xs]
            outs.append(np.stack(parts, axis=concat))
    return outs


@pytest.mark.parametrize("g", [2, 3, 4, 8])
@pytest.mark.parametrize("shape,axis,tiled", [
    ((4, 6), 0, True), ((4, 6), 1, True), ((3, 5, 8), 2, True), ((3, 5, 8), 1, False), ((3, 5, 8), 3, False),
    ((2, 3, 4, 16), 3, True), ((7,), 0, False), ((2, 8), 0, False),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("pull", [False, True])
def test_all_gather_layout(g, shape, axis, tiled, dtype, pull):
    xs = [rand(shape, dtype) for _ in range(g)]
    out, box = _layout.all_gather_box(shape, axis, tiled, g, np.dtype(dtype).itemsize)
    want = np_all_gather(xs, axis, tiled)
    assert tuple(out) == want.shape
    for got in copy(box, xs, out, pull=pull):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("g", [2, 4, 8])
@pytest.mark.parametrize("shape,split,concat,tiled", [
    ((1, 8, 16, 4), 2, 1, True), ((2, 8, 8, 8), 1, 2, True), ((8, 6), 0, 1, True), ((6, 8), 1, 0, True),
    ((16, 5), 0, 0, True), ((4, 16, 3), 1, 1, True), ("g0", 0, 1, False), ("g1", 1, 0, False), ("g1", 1, 2, False),
])
@pytest.mark.parametrize("pull", [False, True])
def test_all_to_all_layout(g, shape, split, concat, tiled, pull):
    if shape == "g0":
        shape = (g, 3, 4)
    elif shape == "g1":
        shape = (5, g, 4)
    elif shape[split] % g:
        shape = tuple(n * g if i == split else n for i, n in enumerate(shape))
    xs = [rand(shape) for _ in range(g)]
    out, box = _layout.all_to_all_box(shape, split, concat, tiled, g, 4)
    want = np_all_to_all(xs, split, concat, tiled)
    assert tuple(out) == want[0].shape
    for got, w in zip(copy(box, xs, out, pull=pull), want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("g", [2, 3, 4, 8])
@pytest.mark.parametrize("shape,dim,tiled", [((8, 16), 0, True), ((8, 16), 1, True), ((3, 8, 24), 2, True),
                                             ((6, 10, 24), 2, True), ("g", 0, False), ("g", 1, False)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_reduce_scatter_layout(g, shape, dim, tiled, dtype):
    if shape == "g":
        shape = (g, 6) if dim == 0 else (3, g, 10)
    elif shape[dim] % g:
        shape = tuple(n * g if i == dim else n for i, n in enumerate(shape))
    xs = [rand(shape, dtype) for _ in range(g)]
    out, box = _layout.reduce_scatter_box(shape, dim, tiled, g, np.dtype(dtype).itemsize)
    assert box.vec_bytes in (16, np.dtype(dtype).itemsize), "reduction kernels exist for 16 B or one element"
    total = sum(x.astype(np.float64) for x in xs)
    for r, got in enumerate(reduce(box, xs, out, broadcast=False)):
        block = np.split(total, g, axis=dim)[r] if tiled else np.take(total, r, axis=dim)
        np.testing.assert_allclose(got, block.reshape(out), rtol=1e-12)


@pytest.mark.parametrize("g", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(16, 16), (7, 13), (3, 8, 64), (24,)])
@pytest.mark.parametrize("two_shot", [False, True])
def test_all_reduce_layout(g, shape, two_shot):
    xs = [rand(shape) for _ in range(g)]
    out, box = _layout.all_reduce_box(shape, g, 4, two_shot=two_shot)
    if box is None:
        assert two_shot and int(np.prod(shape)) % g
        return
    total = sum(x.astype(np.float64) for x in xs)
    for got in reduce(box, xs, out, broadcast=two_shot):
        np.testing.assert_allclose(got, total, rtol=1e-12)


def test_make_box_merges_and_vectorizes():
    # a (64, 128) bf16 block of a (64, 256) row-major array: 64 rows of 256 contiguous bytes
    box = _layout.make_box((64, 128), (256, 1), (128, 1), itemsize=2, dst_rank_offset=128)
    assert (box.rows, box.inner, box.vec_bytes) == (64, 16, 16)
    assert box.src_stride[-1] == 32 and box.dst_stride[-1] == 16 and box.dst_rank_offset == 16
    # fully contiguous on both sides: one row
    box = _layout.make_box((4, 5, 8), (40, 8, 1), (40, 8, 1), itemsize=4)
    assert (box.rows, box.inner, box.vec_bytes) == (1, 40, 16)
    # odd lengths fall back to one element per vector
    box = _layout.make_box((3, 5), (7, 1), (5, 1), itemsize=2)
    assert box.vec_bytes == 2


def test_row_offsets_walks_mixed_radix():
    box = _layout.make_box((2, 3, 4, 8), (200, 40, 9, 1), (96, 32, 8, 1), itemsize=4, widths=(4,))
    seen = {box.row_offsets(r) for r in range(box.rows)}
    want = {(a * 200 + b * 40 + c * 9, a * 96 + b * 32 + c * 8)
            for a, b, c in itertools.product(range(2), range(3), range(4))}
    assert seen == want
