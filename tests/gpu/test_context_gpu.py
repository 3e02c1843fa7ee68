"""ring_attention and ulysses_attention on GPUs against a float32 whole-sequence reference on one GPU:
forward and gradients, causal or not, zigzag / contiguous, GQA, float32 and bfloat16, lengths that are
not powers of two, groups of 2, 4 and all GPUs; the per-device program's temporary memory flat in G;
a bench-sized shape through the chunked per-block attention."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.sharding import from_zigzag, to_zigzag
from .devices import gpus

MIN_GPUS = 2


def group_sizes() -> list[int]:
    n = len(gpus())
    return sorted({2, max(n, 2)} | ({4} if n >= 4 else set()))


def mesh(g: int) -> Mesh:
    return Mesh(np.array(gpus()[:g]), ("sp",))


def random_qkv(seed, b, s, n, kv_heads, h):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(b, s, n, h), (b, s, kv_heads, h), (b, s, kv_heads, h), (b, s, n, h)]
    return [jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes)]


@jax.jit(static_argnames="causal")
def reference(q, k, v, d_out, causal):
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(d_out))


def sharded(attn, g, layout, dtype, q, k, v, d_out):
    to = (lambda x: to_zigzag(x, g)) if layout == "zigzag" else (lambda x: x)
    back = (lambda x: from_zigzag(x, g)) if layout == "zigzag" else (lambda x: x)
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    put = lambda x: jax.device_put(to(x).astype(dtype), NamedSharding(mesh(g), P(None, "sp")))

    @jax.jit
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(d_out))

    return [back(np.asarray(x.astype(jnp.float32))) for x in run(put(q), put(k), put(v), put(d_out))]


def assert_close(got, want, tol, label):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), f"{label} {name}: non-finite values"
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        print(f"{label} {name}: rel err {err:.2e} (tol {tol})")
        assert err < tol, f"{label} {name}: relative error {err:.2e} > {tol}"


TOL = {jnp.float32: 5e-3, jnp.bfloat16: 2e-2}  # float32: XLA may use TF32 for the ring's dots on GPUs


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", True), ("zigzag", False)])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("g", group_sizes())
def test_ring_attention_matches_reference(g, kv_heads, layout, causal, dtype):
    t_local = 200  # not a power of two
    q, k, v, d_out = random_qkv(g * 7 + kv_heads, 2, g * t_local, 8, kv_heads, 64)
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
    got = sharded(attn, g, layout, dtype, q, k, v, d_out)
    assert_close(got, reference(q, k, v, d_out, causal), TOL[dtype], f"ring G={g} {layout} causal={causal}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("g", group_sizes())
def test_ulysses_attention_matches_reference(g, causal, dtype):
    q, k, v, d_out = random_qkv(g * 3 + causal, 2, g * 200, 8, 2, 64)  # 2 kv heads: replicated at G > 2
    attn = lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp", causal=causal)
    got = sharded(attn, g, "contiguous", dtype, q, k, v, d_out)
    assert_close(got, reference(q, k, v, d_out, causal), TOL[dtype], f"ulysses G={g} causal={causal}")


@pytest.mark.parametrize("chunks,a2a,local", [("4", "async", "default"), ("1", "async", "default"),
                                              ("4", "async", "pk"), ("4", "lax", "default"), ("4", "pk", "default")])
@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_head_chunks_and_exchanges(monkeypatch, chunks, a2a, local, causal):
    """PK_JAX_ULYSSES_CHUNKS / _A2A / _LOCAL on every GPU: head chunks exchanged by pk, lax or the asynchronous
    all-to-all (side-stream shifts under the previous chunk's attention; local "pk": our attention kernels leaving
    the shift its SMs), forward and gradients vs the float32 reference."""
    monkeypatch.setenv("PK_JAX_ULYSSES_CHUNKS", chunks)
    monkeypatch.setenv("PK_JAX_ULYSSES_A2A", a2a)
    monkeypatch.setenv("PK_JAX_ULYSSES_LOCAL", local)
    g = len(gpus())
    heads = 8 * g  # 8 heads per member: 4 chunks of 2 at any G (GQA with chunks is covered on CPU)
    q, k, v, d_out = random_qkv(g * 5 + causal, 2, g * 256, heads, heads, 64)
    attn = lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp", causal=causal)
    if a2a == "async":  # the kernel path, not the ppermute fallback: windowed copies (copy engines, the default) or shifts
        spec = jax.ShapeDtypeStruct((2, g * 256, heads, 64), jnp.bfloat16, sharding=NamedSharding(mesh(g), P(None, "sp")))
        f = jax.jit(jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp")))
        hlo = f.lower(spec, spec, spec).compile().as_text()
        assert "pk_exchange_start" in hlo or "pk_ring_shift_start" in hlo, "the async exchange fell back to ppermute"
    got = sharded(attn, g, "contiguous", jnp.bfloat16, q, k, v, d_out)
    assert_close(got, reference(q, k, v, d_out, causal), TOL[jnp.bfloat16], f"ulysses {chunks}:{a2a} G={g}")


def _temp_bytes(fn, g, shape):
    spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    f = jax.shard_map(fn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2)))
    return grad.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("local", ["cudnn", "cudnn-split"])
def test_ring_temp_memory_flat_in_group_size(monkeypatch, local):
    """Same local shard (T=2048, 8 heads, D 128, bf16) at G = 2 and G = all, with the bottom-right pairs whole (the
    default at these 1024-row pairs) and split for cuDNN: what a longer ring adds to the
    forward+backward temp memory is what it keeps in transit, not the sequence. At G = 2 the backward's one
    visiting step sends nothing; from G = 3 a dK/dV accumulator leaves and one arrives during a step (4 float32
    local blocks) and the next K/V pair arrives (1 float32-block's bytes of bf16 K and V): 5 blocks in all
    (4 x H100, 2026-11-26: 54.7 MB at G 2, 96.6 MB at G 4, a growth of exactly 5 blocks of 8 MiB). Flatness
    from G = 4 (the full working set) on is checked from 8 GPUs here and on CPU in tests/test_context_cpu.py.
    The all-gather baseline's grows with the sequence."""
    g_max = len(gpus())
    if g_max < 4:
        pytest.skip("needs >= 4 GPUs to compare group sizes")
    monkeypatch.setenv("PK_JAX_RING_LOCAL", local)
    t, heads, d = 2048, 8, 128
    block = t * heads * d * 4  # one float32 local block
    ring = lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=True)

    def gather(q, k, v):
        k, v = (jax.lax.all_gather(x, "sp", axis=1, tiled=True) for x in (k, v))
        return jax.nn.dot_product_attention(q, k, v)

    sizes = sorted({2, 4, g_max} if g_max >= 8 else {2, g_max})
    r = {g: _temp_bytes(ring, g, (1, g * t, heads, d)) for g in sizes}
    b = {g: _temp_bytes(gather, g, (1, g * t, heads, d)) for g in (2, g_max)}
    print(f"temp bytes: ring {r}, all-gather {b}, float32 block {block}")
    assert r[g_max] <= r[2] + 5 * block + (1 << 20), r
    if g_max >= 8:
        assert r[g_max] <= 1.1 * r[4], r
    assert b[g_max] > 1.5 * b[2], b


def test_ring_attention_bench_shape_runs_in_bounded_memory():
    """One bench point (B16 N16 D128 bf16, S=12288, causal zigzag, forward+backward) on all GPUs: the
    chunked per-block attention keeps it within memory and the result is finite."""
    g = len(gpus())
    shape = (16, 12288, 16, 128)
    sh = NamedSharding(mesh(g), P(None, "sp"))
    make = jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16), out_shardings=sh)
    q, k, v = (make(jax.random.key(i)) for i in range(3))
    f = jax.shard_map(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=True), mesh=mesh(g),
                      in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2)))(q, k, v)
    for name, x in zip(("dq", "dk", "dv"), grads):
        assert bool(jnp.isfinite(x.astype(jnp.float32)).all()), f"{name} has non-finite values"
    print(f"bench shape {shape} on {g} GPUs: ok, peak memory per GPU "
          f"{max(d.memory_stats().get('peak_bytes_in_use', 0) for d in gpus()[:g]) / 2**30:.1f} GiB")


@pytest.mark.parametrize("sp_first", [False, True])
def test_ring_attention_on_a_sub_axis(sp_first):
    """4+ GPUs: ring attention at defaults (copy-engine shifts) over the size-2 "sp" axis of a 2-D mesh, batch
    over "dp", so two rings run at once on their own copy-engine boards; either axis order. Causal zigzag,
    bf16, forward and gradients vs the float32 reference."""
    n = len(gpus()) // 2 * 2
    if n < 4:
        pytest.skip("needs 4 GPUs (two rings)")
    shape, names = ((2, n // 2), ("sp", "dp")) if sp_first else ((n // 2, 2), ("dp", "sp"))
    m = Mesh(np.array(gpus()[:n]).reshape(shape), names)
    g, b = 2, n // 2
    q, k, v, d_out = random_qkv(43 + sp_first, b, g * 200, 8, 4, 64)
    spec = P("dp", "sp")
    f = jax.shard_map(lambda a, b_, c: pk_jax.ring_attention(a, b_, c, "sp", causal=True), mesh=m, in_specs=spec,
                      out_specs=spec)

    @jax.jit
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(d_out))

    put = lambda x: jax.device_put(to_zigzag(x, g).astype(jnp.bfloat16), NamedSharding(m, spec))
    got = [from_zigzag(np.asarray(x.astype(jnp.float32)), g) for x in run(*(put(x) for x in (q, k, v, d_out)))]
    assert_close(got, reference(q, k, v, d_out, True), TOL[jnp.bfloat16], f"ring on sp of a {shape} mesh {names}")


@pytest.mark.parametrize("merge", ["dq", "dq-direct"])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", True), ("zigzag", False)])
def test_ring_attention_deferred_sums_match_reference(monkeypatch, layout, causal, merge):
    """PK_JAX_RING_SUMS=deferred (pk_jax/context/row_sum.py, lse_parts.py): blocks merged and gradient parts summed
    once at the end, with the pairs on cuDNN (the default), on our kernels (PK_JAX_RING_LOCAL=pk) and the forward's
    on cuDNN, the backward's on our kernels (cudnn-fwd); bf16, GQA,
    a length that is not a power of two, on every GPU; forward and gradients vs the float32 reference; on our
    kernels the same bits on a second call (cuDNN's backward adds dQ with atomics). merge "dq-direct"
    (PK_JAX_RING_MERGE): the pairs on our backward kernel read their q / dO rows in place (zigzag chunks of 96
    rows: the last 64-row block reads the next chunk's rows) and add dQ into the ring's float32 state by TMA tensor
    reduce; the program binds the in-place call."""
    monkeypatch.setenv("PK_JAX_RING_SUMS", "deferred")
    monkeypatch.setenv("PK_JAX_RING_MERGE", merge)
    g = group_sizes()[-1]
    q, k, v, d_out = random_qkv(g * 7 + causal, 2, g * 192, 8, 2, 128)
    for local in ("cudnn", "pk", "cudnn-fwd"):
        monkeypatch.setenv("PK_JAX_RING_LOCAL", local)
        attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
        if merge == "dq-direct" and (local != "cudnn" or (causal and layout == "zigzag")):  # a pair on our kernel
            f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
            bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
            assert "in_place=True" in str(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(*bf16))
        got = sharded(attn, g, layout, jnp.bfloat16, q, k, v, d_out)
        assert_close(got, reference(q, k, v, d_out, causal), TOL[jnp.bfloat16],
                     f"deferred {merge} {local} G={g} {layout}")
        if local == "pk" and merge == "dq":
            again = sharded(attn, g, layout, jnp.bfloat16, q, k, v, d_out)
            assert all(np.array_equal(a, b) for a, b in zip(got, again)), "deferred on our kernels: bits changed"


@pytest.mark.parametrize("local", ["cudnn", "cudnn-split", "cudnn-fwd"])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", True), ("zigzag", False)])
def test_ring_attention_on_cudnn_matches_reference(monkeypatch, layout, causal, local):
    """PK_JAX_RING_LOCAL=cudnn (the default, pk_jax/context/cudnn_block.py): the pairs cuDNN can mask run on it,
    forward with its LSE and backward fed the whole row's output and LSE; on every GPU, bf16, GQA, head dim 128,
    a length that is not a power of two; forward and gradients vs the float32 reference; the program calls cuDNN.
    cudnn-split (opt-in): the bottom-right pairs as two cuDNN calls each, and no pair on our kernel. cudnn-fwd
    (opt-in): the forward's pairs on cuDNN, every backward pair on our backward kernel."""
    monkeypatch.setenv("PK_JAX_RING_LOCAL", local)
    g = group_sizes()[-1]
    q, k, v, d_out = random_qkv(g * 5 + causal, 2, g * 192, 8, 2, 128)
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
    spec = jax.ShapeDtypeStruct(q.shape, jnp.bfloat16, sharding=NamedSharding(mesh(g), P(None, "sp")))
    kv_spec = jax.ShapeDtypeStruct(k.shape, jnp.bfloat16, sharding=NamedSharding(mesh(g), P(None, "sp")))
    loss = lambda a, b, c: jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))(
        a, b, c).astype(jnp.float32).sum()
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, kv_spec, kv_spec).compile().as_text()
    assert "__cudnn" in hlo, "no cuDNN call in the ring's program"
    if local == "cudnn-split":  # the bottom-right pairs split for cuDNN too: none is left on our kernel
        assert 'custom_call_target="pk_attention' not in hlo, "a pair left on our kernel"
    if local == "cudnn-fwd":  # the forward on cuDNN, no cuDNN backward
        assert not re.search(r"__cudnn\$fmha\w*Backward", hlo) and 'custom_call_target="pk_attention_bwd' in hlo
    got = sharded(attn, g, layout, jnp.bfloat16, q, k, v, d_out)
    assert_close(got, reference(q, k, v, d_out, causal), TOL[jnp.bfloat16], f"ring on cuDNN G={g} {layout} {causal}")
