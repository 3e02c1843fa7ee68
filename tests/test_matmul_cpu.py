"""pk_jax.matmul on CPU: jnp.dot semantics, argument errors, autodiff and vmap (the GPU kernel is
tested in tests/gpu/test_matmul_gpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pk_jax


def rand(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype,out_dtype", [(jnp.bfloat16, None), (jnp.bfloat16, jnp.float32),
                                             (jnp.float16, None), (jnp.float32, None)])
def test_matches_dot(dtype, out_dtype):
    a, b = rand(0, (3, 64, 128), dtype), rand(1, (128, 96), dtype)
    got = jax.jit(lambda x, y: pk_jax.matmul(x, y, out_dtype=out_dtype))(a, b)
    want = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(out_dtype or dtype)
    assert got.shape == (3, 64, 96) and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_uneven_shapes_fall_back_with_same_result():
    a, b = rand(2, (5, 7)), rand(3, (7, 3))
    np.testing.assert_allclose(np.asarray(pk_jax.matmul(a, b).astype(jnp.float32)),
                               np.asarray(jnp.dot(a, b).astype(jnp.float32)), rtol=1e-2)


@pytest.mark.parametrize("a_shape,b_shape,match", [((4, 8), (9, 4), "contraction sizes differ"),
                                                   ((4, 8), (8,), "b must be 2-D"),
                                                   ((4, 8), (2, 8, 4), "b must be 2-D")])
def test_shape_errors(a_shape, b_shape, match):
    with pytest.raises(ValueError, match=match):
        pk_jax.matmul(jnp.ones(a_shape, jnp.bfloat16), jnp.ones(b_shape, jnp.bfloat16))


def test_tile_errors():
    a, b = jnp.ones((64, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="tile='9x9' is not one of"):
        pk_jax.matmul(a, b, tile="9x9")
    with pytest.raises(ValueError, match="no float32-output kernel"):
        pk_jax.matmul(a, b, out_dtype=jnp.float32, tile="128x256")


def test_grad_matches_dot():
    a, b = rand(4, (32, 64), jnp.float16), rand(5, (64, 48), jnp.float16)
    f = lambda mm: jax.grad(lambda x, y: (mm(x, y).astype(jnp.float32) ** 2).sum(), argnums=(0, 1))(a, b)
    ours = f(lambda x, y: pk_jax.matmul(x, y))
    ref = f(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
    for g, r in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2e-2, atol=1e-1)


def test_vmap():
    a, b = rand(6, (4, 16, 32)), rand(7, (4, 32, 8))
    shared = jax.vmap(pk_jax.matmul, in_axes=(0, None))(a, b[0])
    per = jax.vmap(pk_jax.matmul)(a, b)
    assert shared.shape == per.shape == (4, 16, 8)
    for i in range(4):
        np.testing.assert_array_equal(np.asarray(per[i].astype(jnp.float32)),
                                      np.asarray(pk_jax.matmul(a[i], b[i]).astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(shared[i].astype(jnp.float32)),
                                      np.asarray(pk_jax.matmul(a[i], b[0]).astype(jnp.float32)))


def test_grad_with_rows_not_a_multiple_of_8():
    # dB contracts over M: M = 5 (and a 1-D a, M = 1) must take the jnp.dot path, not the kernel.
    for a_shape in [(5, 16), (16,)]:
        a, b = rand(8, a_shape), rand(9, (16, 24))
        ga, gb = jax.grad(lambda x, y: pk_jax.matmul(x, y, out_dtype=jnp.float32).sum(), argnums=(0, 1))(a, b)
        ra, rb = jax.grad(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).sum(), argnums=(0, 1))(a, b)
        np.testing.assert_allclose(np.asarray(ga, np.float32), np.asarray(ra, np.float32), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(np.asarray(gb, np.float32), np.asarray(rb, np.float32), rtol=2e-2, atol=2e-2)


def test_inside_shard_map():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    P = jax.sharding.PartitionSpec
    a, b = rand(8, (128, 64)), rand(9, (64, 32))
    f = jax.jit(jax.shard_map(lambda x, y: pk_jax.matmul(x, y), mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
    np.testing.assert_array_equal(np.asarray(f(a, b).astype(jnp.float32)),
                                  np.asarray(pk_jax.matmul(a, b).astype(jnp.float32)))
