"""The small-message path (LL lines, LL128 lines or chunk flags, no handshakes) on GPUs: every size from 2 bytes to 8 MiB (odd
sizes, 16-bit halves at 2 (mod 4) offsets), f32/bf16/f16, 1-3-D shapes, against a NumPy float32
rank-order reference bit for bit (the kernels sum in float32 in rank order and round once), the same
bits as the bulk path, interleaving with bulk ops and across groups, and 1,000 command-buffer replays."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _small_path

from .poison import poison_allocator
from .devices import gpus

MIN_GPUS = 2
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Per-member bytes: odd element counts, 2 (mod 4), around the LL area's cap (1 MiB), up to 8 MiB.
SIZES = [2, 4, 6, 10, 12, 100, 1022, 4096, 4098, 16384, 65534, 65536, 131074, 262144, 524290,
         (1 << 20) - 2, 1 << 20, (1 << 20) + 4, 2 << 20, 8 << 20]
_seed = itertools.count(777)


def group_sizes() -> list[int]:
    n = len(gpus())
    return sorted({2, max(n, 2)})


def np_dtype(dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def random_global(shape, dtype, mesh, spec) -> jax.Array:
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype),
                   out_shardings=NamedSharding(mesh, spec))
    return make(jax.random.key(next(_seed)))


def run(mesh, fn, x, out_spec=P("x")) -> np.ndarray:
    poison_allocator(max(x.nbytes, 1 << 20) * 2)
    out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=out_spec, check_vma=False))(x)
    pk_jax.runtime.check()
    return np.asarray(out)


def rank_order_sum(blocks: list[np.ndarray]) -> np.ndarray:
    acc = np.zeros(blocks[0].shape, np.float32)
    for b in blocks:
        acc = (acc + b.astype(np.float32)).astype(np.float32)
    return acc.astype(blocks[0].dtype)


def assert_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    ua, ub = a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}")
    bad = int((ua != ub).sum())
    assert bad == 0, f"{what}: {bad} of {a.size} elements differ (first at {np.argmax(ua != ub)})"


def _elems(nbytes: int, dtype) -> int | None:
    item = jnp.dtype(dtype).itemsize
    return nbytes // item if nbytes % item == 0 else None


# ---------------------------------------------------------------- all_reduce
@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("algorithm", ["auto", "small", "small_one_shot", "small_two_shot", "small_chunked",
                                       "small_ll128"])
def test_all_reduce_sizes(g, dtype, nbytes, algorithm):
    n = _elems(nbytes, dtype)
    if n is None:
        pytest.skip("size not a whole number of elements")
    if algorithm != "auto" and nbytes > _small_path.max_bytes(algorithm):
        pytest.skip("above the small path's cap (auto covers it)")
    if algorithm == "small_two_shot" and _small_path.words(nbytes) % g:
        pytest.skip("two-shot needs the words divisible by G")
    mesh = Mesh(np.array(gpus()[:g]), ("x",))
    x = random_global((g * n,), dtype, mesh, P("x"))
    got = run(mesh, lambda v: pk_jax.all_reduce(v, "x", algorithm=algorithm), x)
    want = rank_order_sum(np.split(np.asarray(x), g))
    for r, blk in enumerate(np.split(got, g)):
        assert_bits(blk, want, f"member {r}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("nbytes", [4096, 262144, 1 << 20, 8 << 20])
@pytest.mark.parametrize("algorithm", ["small_ll128", "small_one_shot"])
def test_all_reduce_chain_stays_exact(dtype, nbytes, algorithm):
    """64 dependent all_reduces per call, 20 calls: v = all_reduce(x), then v <- all_reduce(v + k) - G k - (G - 1) v
    (k = i mod 3, so each payload differs from the one two ops back in the same area), which returns the group's sum
    S exactly (x integers in [-4, 4]). A line whose flag passed with stale payload beside it (a torn LL128 line)
    would shift v for good: the stress test of the flags carried with the data."""
    if nbytes > _small_path.max_bytes(algorithm):
        pytest.skip("above the algorithm's cap")
    g = len(gpus())
    mesh = Mesh(np.array(gpus()), ("x",))
    n = nbytes // jnp.dtype(dtype).itemsize

    def chain(v):
        v = pk_jax.all_reduce(v, "x", algorithm=algorithm)
        for i in range(1, 64):
            k = i % 3
            v = pk_jax.all_reduce(v + k, "x", algorithm=algorithm) - g * k - (g - 1) * v
        return v

    f = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    rng = np.random.default_rng(nbytes)
    for call in range(20):
        x_np = rng.integers(-4, 5, (g * n,)).astype(np_dtype(dtype))
        x = jax.device_put(x_np, NamedSharding(mesh, P("x")))
        want = sum(b.astype(np.float32) for b in np.split(x_np, g)).astype(np_dtype(dtype))
        got = np.asarray(f(x))
        pk_jax.runtime.check()
        for r, blk in enumerate(np.split(got, g)):
            assert_bits(blk, want, f"call {call}, member {r}")


@pytest.mark.parametrize("knob,value", [("PK_JAX_AR_LL128_SHOTS", "2"), ("PK_JAX_SMALL_LL128_LAG", "2"),
                                        ("PK_JAX_SMALL_LL128_LAG", "0"), ("PK_JAX_SMALL_LL128_CTAS_PER_SM", "2")])
def test_ll128_knob_in_a_fresh_process(knob, value):
    """The LL128 kernels under a knob read once per process pass this file's LL128 size sweep and chain stress in a
    process of their own (G = every GPU of the machine): the two-shot forced at every size (PK_JAX_AR_LL128_SHOTS=2;
    sizes with fewer lines than members run one-shot), and the one-shot summing each quad two iterations after
    sending it (PK_JAX_SMALL_LL128_LAG=2, the default before session 34: sends and sums interleaved wherever a warp
    has three quads or more) or in the same iteration (lag 0; the default is 1), and 2 CTAs per SM for both kernels
    (PK_JAX_SMALL_LL128_CTAS_PER_SM; the one-shot takes 3 by default)."""
    if os.environ.get(knob):
        pytest.skip(f"this process already runs with {knob} set")
    res = subprocess.run([sys.executable, "-m", "pytest", os.path.abspath(__file__), "-m", "gpu", "-q", "-x", "-k",
                          "small_ll128 and (sizes or chain)"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, knob: value,
                              "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("local_shape", [(3, 5, 7), (1, 8192), (16, 8192), (7, 13), (2, 3, 4, 40)])
def test_all_reduce_dims_same_bits_as_bulk(dtype, local_shape):
    g = len(gpus())
    mesh = Mesh(np.array(gpus()), ("x",))
    x = random_global((g * local_shape[0],) + local_shape[1:], dtype, mesh, P("x"))
    small = run(mesh, lambda v: pk_jax.all_reduce(v, "x", algorithm="small"), x)
    bulk = run(mesh, lambda v: pk_jax.all_reduce(v, "x", algorithm="one_shot"), x)
    assert_bits(small, bulk, "small vs bulk one-shot")
    assert_bits(np.split(small, g)[0], rank_order_sum(np.split(np.asarray(x), g)), "vs NumPy")


# ---------------------------------------------------------------- all_gather
@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nbytes", [s for s in SIZES if s <= _small_path.SMALL_MAX_BYTES])
@pytest.mark.parametrize("tiled", [True, False])
def test_all_gather_sizes(g, dtype, nbytes, tiled):
    n = _elems(nbytes, dtype)
    if n is None:
        pytest.skip("size not a whole number of elements")
    mesh = Mesh(np.array(gpus()[:g]), ("x",))
    x = random_global((g * n,), dtype, mesh, P("x"))
    got = run(mesh, lambda v: pk_jax.all_gather(v, "x", axis=0, tiled=tiled, algorithm="small"), x)
    want = np.asarray(x) if tiled else np.asarray(x).reshape(g, n)
    for r, blk in enumerate(np.split(got, g)):
        assert_bits(blk, want, f"member {r}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("local_shape,axis", [((1, 4097), 1), ((1, 3, 5), 1), ((4, 6), 0), ((1, 1, 9), 1)])
def test_all_gather_dims(dtype, local_shape, axis):
    g = len(gpus())
    mesh = Mesh(np.array(gpus()), ("x",))
    x = random_global((g * local_shape[0],) + local_shape[1:], dtype, mesh, P("x"))
    small = run(mesh, lambda v: pk_jax.all_gather(v, "x", axis=axis, tiled=True, algorithm="small"), x)
    ref = run(mesh, lambda v: jax.lax.all_gather(v, "x", axis=axis, tiled=True), x)
    assert_bits(small, ref, "vs jax.lax.all_gather")


# ---------------------------------------------------------------- reduce_scatter
@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nbytes", [s for s in SIZES if s <= _small_path.SMALL_MAX_BYTES])
def test_reduce_scatter_sizes(g, dtype, nbytes):
    n = _elems(nbytes, dtype)  # one block; x holds G of them
    if n is None:
        pytest.skip("size not a whole number of elements")
    mesh = Mesh(np.array(gpus()[:g]), ("x",))
    x = random_global((g * g * n,), dtype, mesh, P("x"))
    got = run(mesh, lambda v: pk_jax.reduce_scatter(v, "x", tiled=True, algorithm="small"), x)
    xs = np.split(np.asarray(x), g)
    for r, blk in enumerate(np.split(got, g)):
        assert_bits(blk, rank_order_sum([np.split(xm, g)[r] for xm in xs]), f"member {r}")


# ---------------------------------------------------------------- interleaving
def test_small_and_bulk_ops_interleave_over_many_calls():
    """Small-path epochs are separate from the ready/done protocol's: alternate both in one program,
    many calls, every output checked (bits vs the same program with bulk algorithms only)."""
    g = len(gpus())
    mesh = Mesh(np.array(gpus()), ("x",))

    def prog(small: bool):
        s = "small" if small else "bulk"

        def step(v):
            a = pk_jax.all_reduce(v, "x", algorithm="small" if small else "one_shot")
            b = pk_jax.all_reduce(a * 0.25, "x", algorithm="one_shot")
            c = pk_jax.all_gather(b, "x", tiled=True, algorithm=s)
            d = pk_jax.reduce_scatter(c, "x", tiled=True, algorithm=s)
            e = pk_jax.all_reduce(d * 0.5, "x", algorithm="small_chunked" if small else "one_shot")
            return a, b, c, d, e

        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=(P("x"),) * 5, check_vma=False))

    f, ref = prog(True), prog(False)
    xs = [random_global((g * 64, 96), jnp.bfloat16, mesh, P("x")) for _ in range(3)]
    want = [[np.asarray(o) for o in ref(x)] for x in xs]
    for i in range(300):
        outs = f(xs[i % 3])
        if i % 10 == 0:
            for name, o, w in zip("abcde", outs, want[i % 3]):
                assert_bits(np.asarray(o), w, f"call {i} output {name}")
    pk_jax.runtime.check()


def test_groups_of_different_axes_interleave():
    """Per-pair epochs: small ops over the rows, columns and all of a 2-D mesh, alternated."""
    n = len(gpus())
    if n < 4:
        pytest.skip("needs >= 4 GPUs for two axes of size >= 2")
    mesh = Mesh(np.array(gpus()[:4]).reshape(2, 2), ("dp", "tp"))
    x = random_global((2 * 8, 2 * 64), jnp.float32, mesh, P("dp", "tp"))

    def step(v):
        a = pk_jax.all_reduce(v, "tp", algorithm="small")
        b = pk_jax.all_reduce(a, "dp", algorithm="small")
        return pk_jax.all_reduce(b, ("dp", "tp"), algorithm="small")

    def ref(v):
        return jax.lax.psum(jax.lax.psum(jax.lax.psum(v, "tp"), "dp"), ("dp", "tp"))

    spec = dict(mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"), check_vma=False)
    f, r = jax.jit(jax.shard_map(step, **spec)), jax.jit(jax.shard_map(ref, **spec))
    want = np.asarray(r(x))
    for _ in range(50):
        np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5, atol=1e-5)
    pk_jax.runtime.check()


# ---------------------------------------------------------------- command buffers
def test_1000_command_buffer_replays():
    """In a fresh process (XLA flags are read at start-up): see tests/gpu/small_replay.py."""
    script = os.path.join(os.path.dirname(__file__), "small_replay.py")
    res = subprocess.run([sys.executable, script, "1000"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")})
    print(res.stdout[-4000:], res.stderr[-2000:])
    assert res.returncode == 0 and "PASS 1000 replays" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
