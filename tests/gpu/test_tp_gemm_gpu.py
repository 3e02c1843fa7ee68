"""Fused TP GEMMs on GPUs vs the XLA composition and a float32 reference: fresh random inputs,
NaN-poisoned outputs, 2 and 4 GPUs (as many as the machine has), square and rectangular shapes,
explicit and autotuned num_comm_sms, deterministic bits, and a 2,000-call soak."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _ext, autotune

from .poison import poison_allocator
from .devices import gpus

_seed = itertools.count(777)


def group_sizes() -> list[int]:
    n = len(gpus())
    return sorted({2} | ({4} if n >= 4 else set()))


def dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


OPS = {
    "ag": (lambda x, w, **kw: pk_jax.all_gather_matmul(x, w, "x", **kw),
           lambda x, w: dot(jax.lax.all_gather(x, "x", tiled=True), w), (P("x"), P()), P("x")),
    "rs": (lambda x, w, **kw: pk_jax.matmul_reduce_scatter(x, w, "x", **kw),
           lambda x, w: jax.lax.psum_scatter(dot(x, w), "x", tiled=True), (P(None, "x"), P("x")), P("x")),
    "ar": (lambda x, w, **kw: pk_jax.matmul_all_reduce(x, w, "x", **kw),
           lambda x, w: jax.lax.psum(dot(x, w), "x"), (P(None, "x"), P("x")), P()),
}


def inputs(op, g, m, n, k, mesh, dtype=jnp.bfloat16):
    """Global x, w for local x (m, k) and w (k, n)."""
    _, _, (xs, ws), _ = OPS[op]
    x_shape = (g * m, k) if op == "ag" else (m, g * k)
    w_shape = (k, n) if op == "ag" else (g * k, n)
    make = lambda shape, spec: jax.jit(
        lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype),
        out_shardings=NamedSharding(mesh, spec))(jax.random.key(next(_seed)))
    return make(x_shape, xs), make(w_shape, ws)


def run(op, g, m, n, k, dtype=jnp.bfloat16, **kw):
    ours, ref, in_specs, out_spec = OPS[op]
    mesh = Mesh(np.array(gpus()[:g]), ("x",))
    x, w = inputs(op, g, m, n, k, mesh, dtype)
    f = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False))
    poison_allocator(4 * (g * m) * max(n, k) * 2, gpus()[:g])
    got = f(lambda a, b: ours(a, b, **kw))(x, w)
    want = f(ref)(x, w)
    pk_jax.runtime.check()
    return np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)), (x, w, f, mesh)


def assert_close(got, want):
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-2, f"relative error {err:.2e}"


# (256, 256, 520): a row chunk is not a whole number of the AG pushers' 32 KiB pieces (nor 8 KiB stages);
# (256, 520, 256): nor is an output row block of the store-add zeroing pieces, and the last tile column is partial.
SHAPES = [(256, 256, 256), (1024, 1024, 1024), (512, 768, 1536), (2048, 4096, 512), (128, 64, 8192), (256, 256, 520),
          (256, 520, 256)]


MODES = {"ag": [{}, {"schedule": "intra_sm"}],
         "rs": [{"deterministic": True}, {"deterministic": False, "schedule": "store_add"}],
         "ar": [{"deterministic": True}, {"deterministic": False, "schedule": "store_add"}]}


@pytest.mark.parametrize("op,mode", [(op, m) for op in OPS for m in MODES[op]], ids=str)
@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("mnk", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_composition(op, mode, g, mnk):
    m, n, k = mnk
    if op != "ag":
        m *= g  # the local rows of x must split into G row blocks of >= 128
    sms = {} if mode.get("schedule") in ("store_add", "intra_sm") else {"num_comm_sms": 8}
    got, want, _ = run(op, g, m, n, k, **sms, **mode)
    assert_close(got, want)


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
@pytest.mark.parametrize("sms", [1, 4, 16, 32])
def test_num_comm_sms(op, sms):
    kw = {} if op == "ag" else {"deterministic": True}
    got, want, _ = run(op, 2, 1024, 512, 768, num_comm_sms=sms, **kw)
    assert_close(got, want)


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_float16_and_reference(op):
    got, want, (x, w, _, _) = run(op, 2, 512, 256, 384, dtype=jnp.float16, num_comm_sms=8)
    assert_close(got, want)
    # Globally every op computes x @ w: RS scatters its rows, AR replicates it, and AG leaves the whole
    # product on each member (stacked G times by out_specs P("x")).
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert_close(got, np.tile(ref, (2, 1)) if op == "ag" else ref)


# Pull: bits fixed by the rank-order sum, at any group size. Store-add at 2 members: each element is
# 0 + a + b in either order, and bf16 addition commutes, so the bits are fixed there too (not at 4).
@pytest.mark.parametrize("op,kw,g", [(op, kw, g) for op in ("rs", "ar") for g in group_sizes() for kw in
                                     ({"num_comm_sms": 8, "deterministic": True},
                                      {"schedule": "store_add", "deterministic": False})
                                     if g == 2 or kw["deterministic"]], ids=str)
def test_deterministic_bits(op, kw, g):
    ours, _, in_specs, out_spec = OPS[op]
    mesh = Mesh(np.array(gpus()[:g]), ("x",))
    sets = [inputs(op, g, 1024, 1024, 1024, mesh) for _ in range(2)]
    f = jax.jit(jax.shard_map(lambda a, b: ours(a, b, **kw), mesh=mesh,
                              in_specs=in_specs, out_specs=out_spec, check_vma=False))
    first = [np.asarray(f(*xw).view(jnp.uint16)) for xw in sets]
    assert not np.array_equal(first[0], first[1])
    for i in range(10):  # alternating inputs: a call that read the previous op's data would differ
        assert np.array_equal(np.asarray(f(*sets[i % 2]).view(jnp.uint16)), first[i % 2])
    x, w = sets[0]
    if op == "ar":  # every member holds the same bits
        shards = [np.asarray(s.data.view(jnp.uint16)) for s in f(x, w).addressable_shards]
        assert all(np.array_equal(s, shards[0]) for s in shards)


def test_all_reduce_relay_at_two_members(monkeypatch):
    """AR store-add over > 2 members relays through each row block's owner; PK_JAX_AR_RELAY=1 forces that
    schedule at 2 members, so 2 GPUs test it: shapes with a partial piece and a partial tile column, and
    calls alternating inputs (stale counts or a relayed block sent too early would show)."""
    assert not _ext.ext.tp_all_reduce_relays(2) and _ext.ext.tp_all_reduce_relays(4)
    monkeypatch.setenv("PK_JAX_AR_RELAY", "1")
    assert _ext.ext.tp_all_reduce_relays(2)  # what each launch reads
    kw = {"schedule": "store_add", "deterministic": False}
    for m, n, k in [(256, 256, 256), (1024, 1024, 1024), (256, 520, 256), (2048, 4096, 512)]:
        got, want, (x, w, f, mesh) = run("ar", 2, 2 * m, n, k, **kw)
        assert_close(got, want)
    fused = f(lambda a, b: OPS["ar"][0](a, b, **kw))
    sets = [(x, w), inputs("ar", 2, 2 * m, n, k, mesh)]
    refs = [np.asarray(f(OPS["ar"][1])(*s).astype(jnp.float32)) for s in sets]
    for i in range(40):
        assert_close(np.asarray(fused(*sets[i % 2]).astype(jnp.float32)), refs[i % 2])
    pk_jax.runtime.check()


@pytest.mark.parametrize("schedule", ["comm_sms", "intra_sm"])
@pytest.mark.parametrize("g", group_sizes())
def test_all_gather_returns_the_gathered_x(schedule, g):
    mesh = Mesh(np.array(gpus()[:g]), ("x",))
    x, w = inputs("ag", g, 384, 256, 520, mesh)
    kw = {"num_comm_sms": 8} if schedule == "comm_sms" else {}
    poison_allocator(4 * (g * 384) * 520 * 2, gpus()[:g])
    f = jax.jit(jax.shard_map(lambda a, b: pk_jax.all_gather_matmul(a, b, "x", return_gathered=True,
                                                                    schedule=schedule, **kw),
                              mesh=mesh, in_specs=(P("x"), P()), out_specs=(P("x"), P("x")), check_vma=False))
    out, gathered = f(x, w)
    pk_jax.runtime.check()
    # Every member holds all of x (stacked G times by out_specs), bit for bit.
    assert np.array_equal(np.asarray(gathered.view(jnp.uint16)), np.tile(np.asarray(x.view(jnp.uint16)), (g, 1)))
    assert_close(np.asarray(out.astype(jnp.float32)),
                 np.tile(np.asarray(x, np.float32) @ np.asarray(w, np.float32), (g, 1)))


@pytest.mark.parametrize("op,kw", [("ag", {}), ("rs", {"deterministic": True}), ("rs", {}), ("ar", {})], ids=str)
def test_autotuned(tmp_path, monkeypatch, op, kw):
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    got, want, _ = run(op, 2, 2048, 1024, 512, **kw)
    assert_close(got, want)
    (key, entry), = autotune.entries().items()  # one shape tuned, its candidate times on disk
    assert key.endswith("|intra_sm") == (not kw)  # the intra-SM kernel competes unless deterministic
    assert entry["ms"] and all(t > 0 for t in entry["ms"].values())


def test_soak_alternating_ops():
    g = max(group_sizes())  # every GPU of the machine (2 or 4)
    mesh = Mesh(np.array(gpus()[:g]), ("x",))
    sets = [(*inputs("ag", g, 256, 256, 256, mesh), *inputs("rs", g, 512, 256, 256, mesh)) for _ in range(2)]

    def body(xa, wa, xr, wr):
        a = pk_jax.all_gather_matmul(xa, wa, "x", num_comm_sms=4)
        b = pk_jax.matmul_reduce_scatter(xr, wr, "x", num_comm_sms=4, deterministic=True)
        c = pk_jax.matmul_all_reduce(xr, wr, "x", num_comm_sms=4, deterministic=True)
        d = pk_jax.matmul_reduce_scatter(xr, wr, "x", deterministic=False, schedule="store_add")
        e = pk_jax.matmul_all_reduce(xr, wr, "x", deterministic=False, schedule="store_add")
        f = pk_jax.all_gather_matmul(xa, wa, "x", schedule="intra_sm")
        return a, b, c, d, e, f

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P(None, "x"), P("x")),
                              out_specs=(P("x"), P("x"), P(), P("x"), P(), P("x")), check_vma=False))
    refs = [[np.asarray(o.astype(jnp.float32)) for o in f(*args)] for args in sets]
    for i in range(334):  # 6 ops per call: 2,004 fused calls; inputs alternate so stale data would show
        outs = f(*sets[i % 2])
        if i % 37 == 0 or i >= 332:
            for j, (o, r) in enumerate(zip(outs, refs[i % 2])):
                o = np.asarray(o.astype(jnp.float32))
                if j not in (3, 4):  # deterministic schedules (all but store-add): the same bits every call
                    assert np.array_equal(o, r), f"call {i} op {j}"
                else:  # store-add: the same values up to the order of the bf16 adds
                    assert np.linalg.norm(o - r) / np.linalg.norm(r) < 1e-2, f"call {i} op {j}"
    pk_jax.runtime.check()


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
@pytest.mark.parametrize("axis", ["tp", "dp"])
def test_sub_axis_of_a_2d_mesh(op, axis):
    """A 2 x 2 mesh whose order is not the devices' order: each op over one axis, sharded over both."""
    if len(gpus()) < 4:
        pytest.skip("a 2 x 2 mesh needs 4 CUDA GPUs")
    mesh = Mesh(np.array(gpus()[:4]).reshape(2, 2)[:, ::-1], ("dp", "tp"))
    other = "dp" if axis == "tp" else "tp"
    m, n, k = 256, 384, 512  # local shapes; RS scatters m into 2 blocks of 128 rows
    if op == "ag":
        ours = lambda x, w: pk_jax.all_gather_matmul(x, w, axis)
        ref = lambda x, w: dot(jax.lax.all_gather(x, axis, tiled=True), w)
        specs, shapes = (P((other, axis)), P()), ((4 * m, k), (k, n))
    else:
        fused, reduce = ((pk_jax.matmul_reduce_scatter, lambda p: jax.lax.psum_scatter(p, axis, tiled=True))
                         if op == "rs" else (pk_jax.matmul_all_reduce, lambda p: jax.lax.psum(p, axis)))
        ours = lambda x, w: fused(x, w, axis)
        ref = lambda x, w: reduce(dot(x, w))
        specs, shapes = (P(other, axis), P(axis)), ((2 * m, 2 * k), (2 * k, n))
    x, w = (jax.jit(lambda key, shape=shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16),
                    out_shardings=NamedSharding(mesh, spec))(jax.random.key(next(_seed)))
            for shape, spec in zip(shapes, specs))
    every = P((other, axis))  # every device's local output, stacked
    f = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=every, check_vma=False))
    poison_allocator(4 * 4 * m * max(n, k) * 2, gpus()[:4])
    got = np.asarray(f(ours)(x, w).astype(jnp.float32))
    pk_jax.runtime.check()
    assert_close(got, np.asarray(f(ref)(x, w).astype(jnp.float32)))


def test_uses_the_kernel():
    mesh = Mesh(np.array(gpus()[:2]), ("x",))
    x, w = inputs("ar", 2, 256, 256, 256, mesh)
    f = jax.jit(jax.shard_map(lambda a, b: pk_jax.matmul_all_reduce(a, b, "x", num_comm_sms=4), mesh=mesh,
                              in_specs=(P(None, "x"), P("x")), out_specs=P(), check_vma=False))
    assert "pk_tp_gemm" in f.lower(x, w).as_text()


# transpose_w: w stored (n, k) (a weight read for an input gradient), computed as x @ wᵀ in place.
def dot_t(a, b):
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(a.dtype)


OPS_W_NK = {
    "ag": (lambda x, w, **kw: pk_jax.all_gather_matmul(x, w, "x", transpose_w=True, **kw),
           lambda x, w: dot_t(jax.lax.all_gather(x, "x", tiled=True), w), (P("x"), P()), P("x")),
    "rs": (lambda x, w, **kw: pk_jax.matmul_reduce_scatter(x, w, "x", transpose_w=True, **kw),
           lambda x, w: jax.lax.psum_scatter(dot_t(x, w), "x", tiled=True), (P(None, "x"), P(None, "x")), P("x")),
    "ar": (lambda x, w, **kw: pk_jax.matmul_all_reduce(x, w, "x", transpose_w=True, **kw),
           lambda x, w: jax.lax.psum(dot_t(x, w), "x"), (P(None, "x"), P(None, "x")), P()),
}
# Every kernel kind: comm-SM AG / pull RS / pull AR, intra-SM AG, store-add RS / AR.
MODES_W_NK = {"ag": [{"schedule": "comm_sms", "num_comm_sms": 8}, {"schedule": "intra_sm"}],
              "rs": [{"schedule": "pull", "num_comm_sms": 8, "deterministic": True},
                     {"schedule": "store_add", "deterministic": False}],
              "ar": [{"schedule": "pull", "num_comm_sms": 8, "deterministic": True},
                     {"schedule": "store_add", "deterministic": False}]}


def run_w_nk(op, g, m, n, k, dtype=jnp.bfloat16, **kw):
    """Local x (m, k) and w stored (n, k); returns ours, the composition and the float32 reference."""
    ours, ref, (xs, ws), out_spec = OPS_W_NK[op]
    mesh = Mesh(np.array(gpus()[:g]), ("x",))
    x_shape = (g * m, k) if op == "ag" else (m, g * k)
    w_shape = (n, k) if op == "ag" else (n, g * k)
    make = lambda shape, spec: jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype),
                                       out_shardings=NamedSharding(mesh, spec))(jax.random.key(next(_seed)))
    x, w = make(x_shape, xs), make(w_shape, ws)
    f = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(xs, ws), out_specs=out_spec, check_vma=False))
    poison_allocator(4 * (g * m) * max(n, k) * 2, gpus()[:g])
    mine = f(lambda a, b: ours(a, b, **kw))
    assert "pk_tp_gemm" in mine.lower(x, w).as_text(), f"{op} {kw} transpose_w did not lower to the fused kernel"
    got = np.asarray(mine(x, w).astype(jnp.float32))
    pk_jax.runtime.check()
    want = np.asarray(f(ref)(x, w).astype(jnp.float32))
    full = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    return got, want, np.tile(full, (g, 1)) if op == "ag" else full


@pytest.mark.parametrize("op,mode", [(op, m) for op in OPS_W_NK for m in MODES_W_NK[op]], ids=str)
@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("mnk", [(256, 256, 256), (512, 768, 1536), (256, 520, 256), (256, 256, 520)],
                         ids=lambda s: "x".join(map(str, s)))
def test_transpose_w_matches_composition_and_reference(op, mode, g, mnk):
    m, n, k = mnk
    if op != "ag":
        m *= g  # the local rows of x must split into G row blocks of >= 128
    got, want, full = run_w_nk(op, g, m, n, k, **mode)
    assert_close(got, want)
    assert_close(got, full)


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_transpose_w_float16(op):
    mode = MODES_W_NK[op][0]
    got, want, full = run_w_nk(op, 2, 512, 256, 384, dtype=jnp.float16, **mode)
    assert_close(got, want)
    assert_close(got, full)
