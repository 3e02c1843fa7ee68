"""Every collective vs jax.lax (and a float64 reference) on GPUs: fresh random inputs, poisoned
allocator, shapes from one tile to >= 1 GiB, odd shapes, 1-D meshes over 2..all GPUs, 2-D mesh
sub-axes, a 10,000-call soak, and the timeout path."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _ext

from .poison import poison_allocator
from .devices import gpus

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
_seed = itertools.count(1234)


def mesh_1d(n: int) -> Mesh:
    return Mesh(np.array(gpus()[:n]), ("x",))


def group_sizes() -> list[int]:
    n = len(gpus())
    return sorted({2, max(n, 2)} | ({4} if n >= 4 else set()))


def random_global(shape, dtype, mesh, spec) -> jax.Array:
    key = jax.random.key(next(_seed))
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype),
                   out_shardings=NamedSharding(mesh, spec))
    return make(key)


def run_both(mesh, ours, ref, x, in_spec, out_spec):
    f = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False))
    poison_allocator(max(x.nbytes, 1 << 20) * 2)
    a = f(ours)(x)
    b = f(ref)(x)
    pk_jax.runtime.check()
    return np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))


def assert_close(a, b, dtype):
    assert np.isfinite(a).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err < tol, f"relative error {err}"


# ---------------------------------------------------------------- all_gather
@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis,tiled", [
    ((64, 64), 1, True), ((64, 64), 0, True), ((8, 256, 96), 2, True), ((3, 5, 7), 2, True),
    ((3, 5, 7), 1, False), ((16, 128), 0, False), ((1, 16), 1, True), ((2, 3, 4, 40), 3, True),
])
def test_all_gather(g, dtype, shape, axis, tiled):
    mesh = mesh_1d(g)
    x = random_global((g * shape[0],) + shape[1:], dtype, mesh, P("x"))
    a, b = run_both(mesh, lambda v: pk_jax.all_gather(v, "x", axis=axis, tiled=tiled),
                    lambda v: jax.lax.all_gather(v, "x", axis=axis, tiled=tiled), x, P("x"), P("x"))
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- reduce_scatter
@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("local_shape,dim,tiled", [
    ((64, 128), 1, True), ((128, 64), 0, True), ((6, 10, 24), 2, True), ((4, 8, 40), 1, True), (None, 0, False),
])
def test_reduce_scatter(g, dtype, local_shape, dim, tiled):
    mesh = mesh_1d(g)
    local_shape = local_shape or (g, 33)
    if tiled and local_shape[dim] % g:
        local_shape = tuple(n * g if i == dim else n for i, n in enumerate(local_shape))
    x = random_global((g * local_shape[0],) + local_shape[1:], dtype, mesh, P("x"))
    a, b = run_both(mesh, lambda v: pk_jax.reduce_scatter(v, "x", scatter_dimension=dim, tiled=tiled),
                    lambda v: jax.lax.psum_scatter(v.astype(jnp.float32), "x", scatter_dimension=dim, tiled=tiled),
                    x, P("x"), P("x"))
    assert_close(a, b, dtype)


# ---------------------------------------------------------------- all_reduce
@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ["auto", "one_shot", "two_shot"])
@pytest.mark.parametrize("local_shape", [(16, 16), (7, 13), (256, 1024), (2048, 2048)])
def test_all_reduce(g, dtype, algorithm, local_shape):
    mesh = mesh_1d(g)
    if algorithm == "two_shot" and int(np.prod(local_shape)) % g:
        pytest.skip("two_shot needs the size divisible by the group")
    x = random_global((g * local_shape[0],) + local_shape[1:], dtype, mesh, P("x"))
    a, b = run_both(mesh, lambda v: pk_jax.all_reduce(v, "x", algorithm=algorithm),
                    lambda v: jax.lax.psum(v.astype(jnp.float32), "x"), x, P("x"), P("x"))
    assert_close(a, b, dtype)
    # every member holds the same bits
    blocks = np.split(a, g, axis=0)
    for blk in blocks[1:]:
        np.testing.assert_array_equal(blk, blocks[0])


def test_all_reduce_repeatable_bits():
    g = len(gpus())
    mesh = mesh_1d(g)
    x = random_global((g * 512, 512), jnp.bfloat16, mesh, P("x"))
    f = jax.jit(jax.shard_map(lambda v: pk_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                              check_vma=False))
    first = np.asarray(f(x).astype(jnp.float32))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(f(x).astype(jnp.float32)), first)


# ---------------------------------------------------------------- all_to_all
@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("local_shape,split,concat,tiled", [
    ((1, 64, 8, 128), 2, 1, True), ((2, 32, 16, 64), 1, 2, True), ((32, 24), 0, 1, True), ((32, 24), 1, 0, True),
    ((16, 40), 0, 0, True), ("g", 0, 1, False), ("g", 1, 0, False),
])
def test_all_to_all(g, dtype, local_shape, split, concat, tiled):
    mesh = mesh_1d(g)
    if local_shape == "g":
        local_shape = (g, 6, 10) if split == 0 else (6, g, 10)
    elif local_shape[split] % g:
        local_shape = tuple(n * g if i == split else n for i, n in enumerate(local_shape))
    x = random_global((g * local_shape[0],) + local_shape[1:], dtype, mesh, P("x"))
    a, b = run_both(mesh, lambda v: pk_jax.all_to_all(v, "x", split, concat, tiled=tiled),
                    lambda v: jax.lax.all_to_all(v, "x", split, concat, tiled=tiled), x, P("x"), P("x"))
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- large sizes
def test_large_all_gather_and_all_reduce():
    g = len(gpus())
    mesh = mesh_1d(g)
    n = 16384
    x = random_global((n, 2 * n), jnp.bfloat16, mesh, P(None, "x"))  # gathered output: 1 GiB per GPU
    a, b = run_both(mesh, lambda v: pk_jax.all_gather(v, "x", axis=1, tiled=True),
                    lambda v: jax.lax.all_gather(v, "x", axis=1, tiled=True), x, P(None, "x"), P(None, "x"))
    np.testing.assert_array_equal(a, b)
    del x, a, b
    x = random_global((g * n, 2 * n), jnp.bfloat16, mesh, P("x"))  # 1 GiB per GPU
    a, b = run_both(mesh, lambda v: pk_jax.all_reduce(v, "x"), lambda v: jax.lax.psum(v.astype(jnp.float32), "x"),
                    x, P("x"), P("x"))
    assert_close(a, b, jnp.bfloat16)


# ---------------------------------------------------------------- 2-D meshes
@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_2d_mesh_sub_axes(layout):
    n = len(gpus())
    if n < 4:
        shape = (1, n) if layout == "rows" else (n, 1)
    else:
        shape = (2, n // 2) if layout == "rows" else (n // 2, 2)
    devs = np.array(gpus()[: shape[0] * shape[1]]).reshape(shape)
    mesh = Mesh(devs[:, ::-1], ("dp", "tp"))  # reversed: mesh order != device order
    x = random_global((shape[0] * 32, shape[1] * 64), jnp.bfloat16, mesh, P("dp", "tp"))
    for axis in ("dp", "tp", ("dp", "tp")):
        if (mesh.shape[axis] if isinstance(axis, str) else mesh.size) < 2:
            continue
        a, b = run_both(mesh, lambda v: pk_jax.all_gather(v, axis, axis=1, tiled=True),
                        lambda v: jax.lax.all_gather(v, axis, axis=1, tiled=True), x, P("dp", "tp"), P("dp", "tp"))
        np.testing.assert_array_equal(a, b)
        a, b = run_both(mesh, lambda v: pk_jax.all_reduce(v, axis),
                        lambda v: jax.lax.psum(v.astype(jnp.float32), axis), x, P("dp", "tp"), P("dp", "tp"))
        assert_close(a, b, jnp.bfloat16)


# ---------------------------------------------------------------- soak
def test_soak_10000_calls():
    g = len(gpus())
    mesh = mesh_1d(g)

    def step(v):
        return (pk_jax.all_gather(v, "x", axis=1, tiled=True), pk_jax.reduce_scatter(v, "x", scatter_dimension=1, tiled=True),
                pk_jax.all_reduce(v, "x"), pk_jax.all_to_all(v, "x", 1, 0, tiled=True))

    def ref(v):
        v32 = v.astype(jnp.float32)
        return (jax.lax.all_gather(v, "x", axis=1, tiled=True),
                jax.lax.psum_scatter(v32, "x", scatter_dimension=1, tiled=True),
                jax.lax.psum(v32, "x"), jax.lax.all_to_all(v, "x", 1, 0, tiled=True))

    specs = dict(mesh=mesh, in_specs=P("x"), out_specs=(P("x"),) * 4, check_vma=False)
    f, r = jax.jit(jax.shard_map(step, **specs)), jax.jit(jax.shard_map(ref, **specs))
    xs = [random_global((g * 64, 128 * g), jnp.bfloat16, mesh, P("x")) for _ in range(4)]
    steps = 2500  # x 4 ops = 10,000 collective calls
    outs = None
    for i in range(steps):
        outs = f(xs[i % 4])
        if i % 250 == 249:
            want = r(xs[i % 4])
            for o, w, exact in zip(outs, want, (True, False, False, True)):
                o, w = np.asarray(o.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
                if exact:
                    np.testing.assert_array_equal(o, w)
                else:
                    assert_close(o, w, jnp.bfloat16)
            pk_jax.runtime.check()
    jax.block_until_ready(outs)


# ---------------------------------------------------------------- timeout path
def test_peer_that_never_arrives_reports_error():
    msg = _ext.ext.wait_for_absent_peer(0, 1, 300)
    try:
        assert "waited more than 300 ms for GPU 1" in msg, msg
        assert "self-test" in msg
        with pytest.raises(RuntimeError, match="waited more than"):
            pk_jax.runtime.check()
        # Ops refuse to run on a stopped runtime and say why.
        mesh = mesh_1d(2)
        x = random_global((64, 64), jnp.bfloat16, mesh, P("x"))
        f = jax.jit(jax.shard_map(lambda v: pk_jax.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"),
                                  out_specs=P("x"), check_vma=False))
        with pytest.raises(Exception, match="waited more than"):
            jax.block_until_ready(f(x))
    finally:
        _ext.ext.set_timeout_ms(5000)
        pk_jax.runtime.reset()
    pk_jax.runtime.check()
    a = np.asarray(f(x).astype(jnp.float32))
    assert np.isfinite(a).all()


# ---------------------------------------------------------------- TMA primitives
@pytest.mark.parametrize("chunks", [1, 64, 2048])  # 16 KiB .. 32 MiB
def test_tma_load_store_and_store_add_with_peer(chunks):
    assert _ext.ext.tma_peer_selftest(0, 1, chunks) == ""
    assert _ext.ext.tma_peer_selftest(1, 0, chunks) == ""
