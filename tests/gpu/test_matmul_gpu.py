"""pk_jax.matmul on one GPU vs a float32 reference: fresh random inputs, NaN-poisoned outputs,
square, rectangular, skinny and edge-tile shapes from 64 to 16384, every tile, bf16/f16 in,
bf16/f16/f32 out, bit-identical repeats, gradients; every operand layout (NN, NT, TN, TT)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pk_jax
from pk_jax.matmul import TILES

from .poison import poison_allocator

MIN_GPUS = 1
_seed = itertools.count(4321)

SHAPES = [  # (M, N, K)
    (64, 64, 64), (128, 256, 64), (1024, 1024, 1024), (4096, 4096, 4096),
    (64, 16384, 1024), (128, 4096, 8192),          # skinny M
    (16384, 64, 1024), (1024, 1024, 16384),        # skinny N, long K
    (192, 320, 448), (100, 72, 200), (1000, 1032, 8),  # edge tiles (M any; N, K multiples of 8)
    (16384, 16384, 1024), (16384, 4096, 16384),    # large: rows sampled for the reference
]


def rand(shape, dtype) -> jax.Array:
    return jax.random.normal(jax.random.key(next(_seed)), shape, jnp.float32).astype(dtype)


def check(m: int, n: int, k: int, dtype=jnp.bfloat16, out_dtype=None, tile: str = "auto") -> jax.Array:
    a, b = rand((m, k), dtype), rand((k, n), dtype)
    out_dtype = out_dtype or dtype
    poison_allocator(2 * m * n * jnp.dtype(out_dtype).itemsize, jax.devices("gpu")[:1])
    c = jax.jit(lambda x, y: pk_jax.matmul(x, y, out_dtype=out_dtype, tile=tile))(a, b)
    assert c.shape == (m, n) and c.dtype == out_dtype
    rows = np.arange(m) if m <= 4096 else np.random.default_rng(m + n + k).choice(m, 512, replace=False)
    ref = np.asarray(a[rows], np.float32) @ np.asarray(b, np.float32)
    got = np.asarray(c[rows].astype(jnp.float32))
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    tol = 1e-2 if out_dtype != jnp.float32 else 2e-3
    assert err < tol, f"relative error {err:.2e} at {(m, n, k)} {jnp.dtype(dtype).name}->{jnp.dtype(out_dtype).name}"
    # Every checked element, not just the norm (a misplaced or stale tile shows here).
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max() + 1e-3
    return c


@pytest.mark.parametrize("mnk", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16(mnk):
    check(*mnk)


@pytest.mark.parametrize("tile", TILES[1:])
@pytest.mark.parametrize("mnk", [(192, 320, 448), (1024, 2048, 512), (100, 72, 200)], ids=lambda s: "x".join(map(str, s)))
def test_every_tile(mnk, tile):
    check(*mnk, tile=tile)


@pytest.mark.parametrize("dtype,out_dtype", [(jnp.float16, None), (jnp.bfloat16, jnp.float32),
                                             (jnp.float16, jnp.float32)])
@pytest.mark.parametrize("mnk", [(256, 512, 1024), (2048, 2048, 2048), (100, 72, 200)],
                         ids=lambda s: "x".join(map(str, s)))
def test_dtypes(mnk, dtype, out_dtype):
    check(*mnk, dtype=dtype, out_dtype=out_dtype)


def test_repeat_bits():
    a, b = rand((4096, 4096), jnp.bfloat16), rand((4096, 4096), jnp.bfloat16)
    f = jax.jit(pk_jax.matmul)
    first = np.asarray(f(a, b).view(jnp.uint16))
    for _ in range(5):
        assert np.array_equal(np.asarray(f(a, b).view(jnp.uint16)), first)


def test_batched_and_grad():
    a, b = rand((4, 256, 512), jnp.bfloat16), rand((512, 384), jnp.bfloat16)
    got = np.asarray(jax.jit(pk_jax.matmul)(a, b).astype(jnp.float32))
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
    loss = lambda x, y: (pk_jax.matmul(x, y, out_dtype=jnp.float32) ** 2).sum()
    ga, gb = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    ra, rb = jax.grad(lambda x, y: (jnp.dot(x.astype(jnp.float32), y.astype(jnp.float32)) ** 2).sum(),
                      argnums=(0, 1))(a, b)
    for g, r in ((ga, ra), (gb, rb)):
        g, r = np.asarray(g.astype(jnp.float32)), np.asarray(r)
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2
    # M not a multiple of 8: dB = a^T @ g contracts over M, which the kernel cannot take -> jnp.dot.
    a5 = rand((100, 512), jnp.bfloat16)
    g5 = jax.jit(jax.grad(lambda x, y: pk_jax.matmul(x, y, out_dtype=jnp.float32).sum(), argnums=1))(a5, b)
    r5 = np.asarray(a5, np.float32).sum(0)[:, None] * np.ones((1, 384), np.float32)
    assert np.linalg.norm(np.asarray(g5, np.float32) - r5) / np.linalg.norm(r5) < 2e-2


def test_uses_the_kernel():
    hlo = jax.jit(pk_jax.matmul).lower(rand((256, 256), jnp.bfloat16), rand((256, 256), jnp.bfloat16)).as_text()
    assert "pk_matmul" in hlo


# Transposed layouts, read in place: "NT" = a (m, k) with b stored (n, k); "TN" = a stored (k, m) with
# b (k, n); "TT" both. Shapes include edges: M, N, K not multiples of the tiles, small M, K of one box.
# The stored row lengths must be multiples of 8 (TMA): TN/TT need M % 8 == 0, NT/TT K % 8 == 0.
LAYOUTS = {"NN": (False, False), "NT": (False, True), "TN": (True, False), "TT": (True, True)}
LAYOUT_SHAPES = [
    (64, 64, 64), (128, 256, 64), (2048, 2048, 2048),
    (64, 4096, 1024), (8, 1024, 512), (16384, 64, 1024),   # small / skinny M, skinny N
    (192, 320, 448), (200, 72, 8), (1000, 1032, 200), (136, 264, 4104),  # edge tiles
    (8192, 7168, 8192),                                     # a Llama-70B backward shape at G = 4
]


def check_layout(m: int, n: int, k: int, layout: str, dtype=jnp.bfloat16, out_dtype=None,
                 tile: str = "auto") -> None:
    ta, tb = LAYOUTS[layout]
    a, b = rand((k, m) if ta else (m, k), dtype), rand((n, k) if tb else (k, n), dtype)
    out_dtype = out_dtype or dtype
    poison_allocator(2 * m * n * jnp.dtype(out_dtype).itemsize, jax.devices("gpu")[:1])
    f = jax.jit(lambda x, y: pk_jax.matmul(x, y, out_dtype=out_dtype, transpose_a=ta, transpose_b=tb, tile=tile))
    assert "pk_matmul" in f.lower(a, b).as_text(), f"{layout} {(m, n, k)} did not lower to the kernel"
    c = f(a, b)
    assert c.shape == (m, n) and c.dtype == out_dtype
    rows = np.arange(m) if m <= 4096 else np.random.default_rng(m + n + k).choice(m, 512, replace=False)
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    ref = (a32[:, rows].T if ta else a32[rows]) @ (b32.T if tb else b32)
    got = np.asarray(c[rows].astype(jnp.float32))
    assert np.isfinite(got).all(), f"{layout}: unwritten (NaN-poisoned) or non-finite output elements"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    tol = 1e-2 if out_dtype != jnp.float32 else 2e-3
    name = f"{layout} {(m, n, k)} {jnp.dtype(dtype).name}->{jnp.dtype(out_dtype).name} tile {tile}"
    assert err < tol, f"relative error {err:.2e} at {name}"
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max() + 1e-3, f"element error at {name}"


@pytest.mark.parametrize("layout", ["NT", "TN", "TT"])
@pytest.mark.parametrize("mnk", LAYOUT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layouts_bf16(mnk, layout):
    check_layout(*mnk, layout)


@pytest.mark.parametrize("layout", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize("dtype,out_dtype", [(jnp.float16, None), (jnp.bfloat16, jnp.float32),
                                             (jnp.float16, jnp.float32)])
@pytest.mark.parametrize("mnk", [(256, 512, 1024), (200, 72, 136)], ids=lambda s: "x".join(map(str, s)))
def test_layouts_dtypes(mnk, dtype, out_dtype, layout):
    check_layout(*mnk, layout, dtype=dtype, out_dtype=out_dtype)


@pytest.mark.parametrize("layout", ["NT", "TN", "TT"])
@pytest.mark.parametrize("tile", TILES[1:])
def test_layouts_every_tile(tile, layout):
    check_layout(200, 320, 448, layout, tile=tile)
    check_layout(1024, 2048, 512, layout, out_dtype=jnp.float32 if tile != "128x256" else None, tile=tile)


@pytest.mark.parametrize("ta,tb", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_layout_grads_run_on_the_kernel(ta, tb):
    """The backward GEMMs of every layout read their operands in place (no transposes in the HLO)."""
    m, n, k = 256, 384, 512
    a = rand((k, m) if ta else (m, k), jnp.bfloat16)
    b = rand((n, k) if tb else (k, n), jnp.bfloat16)
    loss = lambda x, y: (pk_jax.matmul(x, y, out_dtype=jnp.float32, transpose_a=ta, transpose_b=tb) ** 2).sum()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    hlo = grad.lower(a, b).as_text()
    assert hlo.count("pk_matmul") >= 3, "forward and both backward GEMMs on the kernel"
    assert "stablehlo.transpose" not in hlo, "a transpose in HBM"
    ga, gb = grad(a, b)
    op = lambda x, t: x.T if t else x
    ref = lambda x, y: (jnp.dot(op(x, ta).astype(jnp.float32), op(y, tb).astype(jnp.float32)) ** 2).sum()
    ra, rb = jax.grad(ref, argnums=(0, 1))(a, b)
    for g, r in ((ga, ra), (gb, rb)):
        g, r = np.asarray(g.astype(jnp.float32)), np.asarray(r)
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2


def test_layout_with_unaligned_stored_rows_falls_back():
    """A call whose stored row length is not a multiple of 8 runs dot_general (TN with M = 100)."""
    a, b = rand((64, 100), jnp.bfloat16), rand((64, 128), jnp.bfloat16)
    hlo = jax.jit(lambda x, y: pk_jax.matmul(x, y, transpose_a=True)).lower(a, b).as_text()
    assert "pk_matmul" not in hlo
    got = np.asarray(pk_jax.matmul(a, b, transpose_a=True), np.float32)
    ref = np.asarray(a, np.float32).T @ np.asarray(b, np.float32)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
