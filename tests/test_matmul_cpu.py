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


LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]


def stored(x: jax.Array, transposed: bool) -> jax.Array:
    """The operand as a caller stores it: x itself, or xᵀ laid out in memory (a copy, for the test)."""
    return jnp.asarray(np.ascontiguousarray(np.asarray(x).T)) if transposed else x


@pytest.mark.parametrize("transpose_a,transpose_b", LAYOUTS)
@pytest.mark.parametrize("dtype,out_dtype", [(jnp.bfloat16, None), (jnp.float16, jnp.float32)])
def test_transposed_layouts_match_float32_reference(transpose_a, transpose_b, dtype, out_dtype):
    m, n, k = 48, 40, 72
    a, b = rand(10, (m, k), dtype), rand(11, (k, n), dtype)
    got = jax.jit(lambda x, y: pk_jax.matmul(x, y, out_dtype=out_dtype, transpose_a=transpose_a,
                                             transpose_b=transpose_b))(stored(a, transpose_a), stored(b, transpose_b))
    want = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    assert got.shape == (m, n) and got.dtype == jnp.dtype(out_dtype or dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=5e-2)


def test_transpose_b_keeps_leading_dims_of_a():
    a, w = rand(12, (2, 3, 32)), rand(13, (24, 32))  # w stored (n, k)
    got = pk_jax.matmul(a, w, transpose_b=True)
    want = np.asarray(a, np.float32) @ np.asarray(w, np.float32).T
    assert got.shape == (2, 3, 24)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("transpose_a,transpose_b", LAYOUTS)
def test_transposed_layout_grads_match_dot(transpose_a, transpose_b):
    a, b = rand(14, (32, 64), jnp.float16), rand(15, (64, 48), jnp.float16)
    sa, sb = stored(a, transpose_a), stored(b, transpose_b)
    loss = lambda c: (c.astype(jnp.float32) ** 2).sum()
    ours = jax.grad(lambda x, y: loss(pk_jax.matmul(x, y, transpose_a=transpose_a, transpose_b=transpose_b)),
                    argnums=(0, 1))(sa, sb)
    ref = jax.grad(lambda x, y: loss(jnp.dot(x.T if transpose_a else x, y.T if transpose_b else y,
                                             preferred_element_type=jnp.float32).astype(x.dtype)),
                   argnums=(0, 1))(sa, sb)
    for g, r, s in zip(ours, ref, (sa, sb)):
        assert g.shape == s.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize("transpose_a,transpose_b", LAYOUTS)
def test_transposed_layout_vmap(transpose_a, transpose_b):
    a, b = rand(16, (3, 16, 32)), rand(17, (3, 32, 8))
    sa = jnp.swapaxes(a, 1, 2) if transpose_a else a
    sb = jnp.swapaxes(b, 1, 2) if transpose_b else b
    mm = lambda x, y: pk_jax.matmul(x, y, transpose_a=transpose_a, transpose_b=transpose_b)
    per = jax.vmap(mm)(sa, sb)
    shared = jax.vmap(mm, in_axes=(0, None))(sa, sb[0])
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(per[i], np.float32), np.asarray(mm(sa[i], sb[i]), np.float32))
        np.testing.assert_array_equal(np.asarray(shared[i], np.float32), np.asarray(mm(sa[i], sb[0]), np.float32))


@pytest.mark.parametrize("a_shape,b_shape,kw,match", [
    ((2, 8, 4), (8, 4), {"transpose_a": True}, r"2-D \(k, m\) with transpose_a=True"),
    ((6, 4), (8, 4), {"transpose_a": True}, r"a\(6, 4\)\[0\] = 6 but b\(8, 4\)\[0\] = 8"),
    ((4, 8), (8, 4), {"transpose_b": True}, r"b\(8, 4\)\[1\] = 4"),
    ((8, 4), (6, 4), {"transpose_a": True, "transpose_b": True}, r"a\(8, 4\)\[0\] = 8 but b\(6, 4\)\[1\] = 4"),
    ((4, 8), (8,), {"transpose_b": True}, r"b must be 2-D \(n, k\)"),
])
def test_transposed_shape_errors(a_shape, b_shape, kw, match):
    with pytest.raises(ValueError, match=match):
        pk_jax.matmul(jnp.ones(a_shape, jnp.bfloat16), jnp.ones(b_shape, jnp.bfloat16), **kw)
