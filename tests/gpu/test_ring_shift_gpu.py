"""The asynchronous ring shift kernel (pk_ring_shift_start / _done) on GPUs: values against np.roll, a size
that is not whole 16-byte vectors, two shifts in flight, a pk collective on XLA's stream while a shift is in
flight on the side stream (separate protocol channels), the compiled order around ring attention, and ring
attention with the "pk" transport against the "xla" one. Each with both engines ($PK_JAX_RING_SHIFT_ENGINE: the
shift kernel, "sm", and the copy engines, "copy", whose handshakes are CUDA events between the members).

Run the first test alone with a short timeout before the others (a new kernel that hangs costs every later
test its full limit; waits are bounded by PK_JAX_TIMEOUT_MS, so a protocol bug should end in an error):
    PK_JAX_TIMEOUT_MS=5000 timeout 120 python -m pytest -x -q \
        "tests/gpu/test_ring_shift_gpu.py::test_shift_alone_small[sm-2]"
(and `...[copy-2]` for the copy engines: their host waits are bounded by the same timeout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.context.ring_shift import after_token, shift_done, shift_start
from .devices import gpus

MIN_GPUS = 2
ENGINES = ["sm", "copy"]


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    """$PK_JAX_RING_SHIFT_ENGINE for the test (read when the shift is traced)."""
    monkeypatch.setenv("PK_JAX_RING_SHIFT_ENGINE", request.param)
    return request.param


def mesh(g: int) -> Mesh:
    return Mesh(np.array(gpus()[:g]), ("sp",))


def run(fn, g: int, *xs):
    m = mesh(g)
    f = jax.jit(jax.shard_map(fn, mesh=m, in_specs=P("sp"), out_specs=P("sp")))
    put = lambda x: jax.device_put(x, NamedSharding(m, P("sp")))
    out = f(*(put(x) for x in xs))
    pk_jax.runtime.check()
    return [np.asarray(y) for y in out], f


def rolled(x: np.ndarray, g: int, dist: int = 1) -> np.ndarray:
    return np.roll(x.reshape(g, -1, *x.shape[1:]), dist, axis=0).reshape(x.shape)


def blocks(g: int, shape, dtype, seed=0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((g * shape[0], *shape[1:]))
    return x.astype(dtype)


def group_sizes() -> list[int]:
    return sorted({2, len(gpus())})


@pytest.mark.parametrize("g", [2])
def test_shift_alone_small(engine, g):
    """The first call of the kernel (or of the copy engines' handshakes): one small buffer, group of 2."""
    x = blocks(g, (4, 64), np.float32)

    def f(x):
        ys, token = shift_start((x,), ("sp",))
        return shift_done(ys, token, keep_alive=x)

    (got,), jitted = run(f, g, x)
    np.testing.assert_array_equal(got, rolled(x, g))
    hlo = jitted.lower(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh(g), P("sp")))).compile().as_text()
    assert "pk_ring_shift_start" in hlo and "pk_ring_shift_done" in hlo, "the kernel path, not the ppermute fallback"


@pytest.mark.parametrize("g", group_sizes())
def test_shift_distances(engine, g):
    """Buffers at distances 1..G-1 in one launch (the asynchronous all-to-all's building block): buffer d is
    member rank - d's; then that all-to-all (pk_jax/context/async_all_to_all.py) against jax.lax.all_to_all."""
    from pk_jax.context.async_all_to_all import all_to_all_done, all_to_all_start

    dists = tuple(range(1, g))[:4]
    xs = [blocks(g, (16, 40), np.float32, seed=d) for d in dists]

    def f(*xs):
        ys, token = shift_start(xs, ("sp",), dists=dists)
        return shift_done(ys, token, keep_alive=xs)

    got, jitted = run(f, g, *xs)
    for d, x, y in zip(dists, xs, got):
        np.testing.assert_array_equal(y, rolled(x, g, d), err_msg=f"distance {d}")
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh(g), P("sp"))) for x in xs]
    assert "pk_ring_shift_start" in jitted.lower(*specs).compile().as_text(), "the kernel, not the ppermute fallback"
    x = blocks(g, (4 * g, 2 * g, 64), jnp.bfloat16, seed=9)
    for split, concat in ((1, 0), (0, 1)):
        ours, _ = run(lambda x: (all_to_all_done(all_to_all_start(x, ("sp",), split, concat)),), g, x)
        want, _ = run(lambda x: (jax.lax.all_to_all(x, "sp", split, concat, tiled=True),), g, x)
        np.testing.assert_array_equal(ours[0], want[0], err_msg=f"async all_to_all split {split} concat {concat}")


@pytest.mark.parametrize("engine_unroll", ["sm:4", "sm:8", "sm:16", "copy:4"])
@pytest.mark.parametrize("g", group_sizes())
def test_shift_several_buffers_and_odd_sizes(g, engine_unroll, monkeypatch):
    """Four buffers, bf16 / f32 / int8 with a size that is not a multiple of 16 bytes, 64 MiB in one; every
    kernel instance ($PK_JAX_RING_SHIFT_UNROLL: loads in flight per thread) and the copy engines."""
    engine, unroll = engine_unroll.split(":")
    monkeypatch.setenv("PK_JAX_RING_SHIFT_ENGINE", engine)
    monkeypatch.setenv("PK_JAX_RING_SHIFT_UNROLL", unroll)
    a = blocks(g, (8191, 4099), jnp.bfloat16)            # ~64 MiB per member, an odd count of 16-byte vectors:
                                                         # the unrolled loop, then its remainder, then a tail
    b = blocks(g, (3, 7), np.float32, seed=1)            # 84 bytes: 5 vectors and a 4-byte tail
    c = (blocks(g, (1001,), np.float32, seed=2) * 50).astype(np.int8)
    d = blocks(g, (2, 128, 8), np.float32, seed=3)

    def f(a, b, c, d):
        ys, token = shift_start((a, b, c, d), ("sp",))
        return shift_done(ys, token, keep_alive=(a, b, c, d))

    got, _ = run(f, g, a, b, c, d)
    for name, x, y in zip("abcd", (a, b, c, d), got):
        np.testing.assert_array_equal(np.asarray(y), rolled(np.asarray(x), g), err_msg=name)


@pytest.mark.parametrize("g", group_sizes())
def test_two_shifts_in_flight(engine, g):
    a, b = blocks(g, (256, 512), np.float32), blocks(g, (128, 64), np.float32, seed=1)

    def f(a, b):
        ya, ta = shift_start((a,), ("sp",))
        yb, tb = shift_start((b,), ("sp",))
        work = jnp.sin(after_token(a, ta, tb)) * 2
        (ya,) = shift_done(ya, ta, keep_alive=a, after=work)
        (yb,) = shift_done(yb, tb, keep_alive=b, after=work)
        return ya, yb, work

    (ya, yb, work), _ = run(f, g, a, b)
    np.testing.assert_array_equal(ya, rolled(a, g))
    np.testing.assert_array_equal(yb, rolled(b, g))
    np.testing.assert_allclose(work, np.sin(a) * 2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("g", group_sizes())
def test_many_shifts_in_a_row(engine, g):
    """40 dependent shifts in one program, the program run twice: more shifts than the copy engines' board has
    slots (16), so every slot and its events are reused; the result is the input moved 40 members on."""
    x = blocks(g, (64, 96), np.float32, seed=7)

    def f(x):
        for _ in range(40):
            ys, token = shift_start((x,), ("sp",))
            (x,) = shift_done(ys, token, keep_alive=x)
        return (x,)

    for _ in range(2):
        (got,), _ = run(f, g, x)
        np.testing.assert_array_equal(got, rolled(x, g, 40 % g))


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("g", group_sizes())
def test_pk_collective_on_the_main_stream_while_a_shift_is_in_flight(engine, g, algorithm):
    """all_reduce and all_gather (main channel, XLA's stream) between start and done of a large shift
    (side channel, side stream): both right, several times in a row (epochs stay in step)."""
    big = blocks(g, (4096, 4096), jnp.bfloat16)  # 32 MiB per member: in flight for a while
    z = blocks(g, (64, 1024), np.float32, seed=5)

    def f(big, z):
        ys, token = shift_start((big,), ("sp",))
        z2 = after_token(z, token)
        r = pk_jax.all_reduce(z2, "sp", algorithm=algorithm)
        gathered = pk_jax.all_gather(z2, "sp", axis=0, tiled=True)
        (y,) = shift_done(ys, token, keep_alive=big, after=(r, gathered))
        return y, r, gathered[None]

    for _ in range(3):
        (y, r, gathered), _ = run(f, g, big, z)
        np.testing.assert_array_equal(y, rolled(np.asarray(big), g))
        zs = z.reshape(g, -1, z.shape[1])
        np.testing.assert_allclose(r.reshape(g, -1, z.shape[1]), np.broadcast_to(zs.sum(0), zs.shape), rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_array_equal(gathered.reshape(g, *z.shape), np.broadcast_to(z, (g, *z.shape)))


def test_ring_attention_compiled_order_and_transports_agree(engine, monkeypatch):
    """Ring attention (bf16, causal zigzag, G = 2) with the "pk" transport: in the compiled program each
    shift's start comes before an attention call and its done after it; outputs and gradients match the
    "xla" transport's (same kernels, same pairs, same order of merges)."""
    g = 2
    shape = (2, g * 512, 8, 128)
    keys = jax.random.split(jax.random.key(0), 4)
    sh = NamedSharding(mesh(g), P(None, "sp"))
    q, k, v, dout = (jax.device_put(jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16), sh)
                     for key in keys)
    f = jax.shard_map(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=True), mesh=mesh(g),
                      in_specs=P(None, "sp"), out_specs=P(None, "sp"))

    def program():
        def fwd_bwd(q, k, v, dout):
            out, vjp = jax.vjp(f, q, k, v)
            return (out, *vjp(dout))
        return jax.jit(fwd_bwd)

    monkeypatch.setenv("PK_JAX_RING_TRANSPORT", "pk")
    pk_prog = program()
    hlo = pk_prog.lower(q, k, v, dout).compile().as_text()
    got = [np.asarray(x.astype(jnp.float32)) for x in pk_prog(q, k, v, dout)]
    pk_jax.runtime.check()
    order = [ln for ln in hlo[hlo.index("ENTRY"):].splitlines()
             if 'custom_call_target="pk_ring_shift_start"' in ln or 'custom_call_target="pk_ring_shift_done"' in ln
             or 'custom_call_target="pk_attention' in ln]
    kinds = ["start" if "shift_start" in ln else "done" if "shift_done" in ln else "attn" for ln in order]
    print("compiled order:", " ".join(kinds))
    assert kinds.count("start") == 3 and kinds.count("done") == 3, kinds  # fwd 1, bwd 1 K/V + 1 accumulator
    for i, kind in enumerate(kinds):
        if kind == "start":
            nxt = kinds[i + 1:]
            assert "attn" in nxt and nxt.index("attn") < (nxt.index("done") if "done" in nxt else len(nxt)), kinds

    monkeypatch.setenv("PK_JAX_RING_TRANSPORT", "xla")
    want = [np.asarray(x.astype(jnp.float32)) for x in program()(q, k, v, dout)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        print(f"{name}: pk vs xla transport rel err {err:.2e}")
        # out / dq: same bits expected; dk / dv: the final hop carries bf16 (one extra rounding)
        assert err < 1e-2, f"{name}: {err}"
