"""pk_jax.matmul on one GPU vs a float32 reference: fresh random inputs, NaN-poisoned outputs,
square, rectangular, skinny and edge-tile shapes from 64 to 16384, every tile, bf16/f16 in,
bf16/f16/f32 out, bit-identical repeats, gradients."""

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
