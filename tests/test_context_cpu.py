"""Context parallelism on 8 virtual CPU devices: ring_attention (zigzag / contiguous, causal or not, GQA)
and ulysses_attention against a float32 single-device reference of the whole sequence, forward and
gradients; the per-block attention's chunked path; zigzag helpers; the compiled program's temporary
memory staying flat in the group size (the ring never holds the full-sequence K/V)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.context import block_attention as block_mod
from pk_jax.sharding import from_zigzag, to_zigzag, zigzag_chunk_order

T_LOCAL = 24  # deliberately not a power of two


def mesh(g: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:g]), ("sp",))


def random_qkv(seed: int, b: int, s: int, n: int, kv_heads: int, h: int, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, s, n, h), jnp.float32)
    k = jax.random.normal(keys[1], (b, s, kv_heads, h), jnp.float32)
    v = jax.random.normal(keys[2], (b, s, kv_heads, h), jnp.float32)
    d_out = jax.random.normal(keys[3], (b, s, n, h), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), d_out


@jax.jit(static_argnames="causal")
def reference(q, k, v, d_out, causal):
    """Whole-sequence float32 attention on one device, with the VJP of d_out."""
    f32 = lambda x: x.astype(jnp.float32)
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    out, vjp = jax.vjp(fn, f32(q), f32(k), f32(v))
    return (out, *vjp(d_out))


def sharded(attn, g: int, layout: str, q, k, v, d_out):
    """Runs `attn(q, k, v)` inside shard_map over the sequence in `layout` (reordered on the host, outside
    the compiled program); returns (out, dq, dk, dv) in global order, forward and VJP in one jitted call."""
    to = (lambda x: to_zigzag(x, g)) if layout == "zigzag" else (lambda x: x)
    back = (lambda x: from_zigzag(x, g)) if layout == "zigzag" else (lambda x: x)
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))

    @jax.jit
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(d_out.astype(out.dtype)))

    return [back(x) for x in run(to(q), to(k), to(v), to(d_out))]


def assert_all_close(got, want, tol, names=("out", "dq", "dk", "dv")):
    for name, a, b in zip(names, got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), f"{name}: non-finite values"
        err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
        assert err < tol, f"{name}: max error {err:.2e} relative to max |ref| (tol {tol})"


RING_CASES = [  # (G, layout, causal, q heads, kv heads)
    (2, "zigzag", True, 4, 4),
    (2, "contiguous", False, 4, 4),
    (4, "zigzag", True, 4, 2),
    (4, "contiguous", True, 4, 2),
    (4, "zigzag", False, 4, 1),
    (8, "zigzag", True, 4, 2),
    (8, "contiguous", True, 2, 2),
]


@pytest.mark.parametrize("g,layout,causal,n,kv_heads", RING_CASES)
def test_ring_attention_matches_whole_sequence_reference(g, layout, causal, n, kv_heads):
    q, k, v, d_out = random_qkv(g * 10 + causal, 2, g * T_LOCAL, n, kv_heads, 16)
    got = sharded(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout),
                  g, layout, q, k, v, d_out)
    assert_all_close(got, reference(q, k, v, d_out, causal), 1e-5)


def _shifted_dtypes(jaxpr) -> list[str]:
    """Dtypes of every array a ring transfer (lax.ppermute or the pk ring shift) sends, in nested jaxprs too."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name in ("ppermute", "pk_ring_shift_start"):
            out += [str(x.aval.dtype) for x in e.invars]
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _shifted_dtypes(inner)
    return out


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_ring_accumulators_in_the_input_dtype(monkeypatch, layout, causal):
    """PK_JAX_RING_ACC_DTYPE=input: every dK/dV hop in bf16 (not only the last; by default the others are float32):
    still bf16-accurate at G 4; a bad value names the variable."""
    from pk_jax.context import ring_overlap

    g = 4
    q, k, v, d_out = random_qkv(31 + causal, 1, g * T_LOCAL, 4, 2, 64, jnp.bfloat16)
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    # A fresh function per trace: the variable is read when traced, and traces are cached per function.
    shifted = lambda: _shifted_dtypes(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, v).jaxpr)
    # Default at G 4: the 3 accumulator hops carry step 1's fresh part as the kernel wrote it (bf16, exact),
    # step 2's sum in float32, the final hop in bf16; so float32 is one hop's two arrays (dK, dV).
    assert shifted().count("float32") == 2
    monkeypatch.setenv(ring_overlap.ACC_DTYPE_VAR, "input")
    assert set(shifted()) == {"bfloat16"}
    got = sharded(attn, g, layout, q, k, v, d_out)
    assert_all_close(got, reference(q, k, v, d_out, causal), 3e-2)
    monkeypatch.setenv(ring_overlap.ACC_DTYPE_VAR, "float64")
    with pytest.raises(ValueError, match=ring_overlap.ACC_DTYPE_VAR):
        sharded(attn, g, layout, q, k, v, d_out)


@pytest.mark.parametrize("g,layout,causal,n,kv_heads,head_dim,dtype", [
    (2, "zigzag", True, 4, 4, 16, jnp.float32),
    (4, "contiguous", True, 4, 2, 64, jnp.bfloat16),
    (4, "zigzag", False, 4, 1, 16, jnp.float32),
    (4, "zigzag", True, 4, 2, 64, jnp.bfloat16),
    (8, "zigzag", True, 4, 2, 16, jnp.bfloat16),  # bf16 on the XLA block path (float32 blocks)
])
def test_ring_deferred_sums_match_reference_and_eager(monkeypatch, g, layout, causal, n, kv_heads, head_dim, dtype):
    """PK_JAX_RING_SUMS=deferred (the default): blocks merged and the backward's dQ / the owner's dK/dV parts summed in one pass
    (lse_parts.LseParts, row_sum.RowSum); result and gradients equal the whole-sequence reference, and the eager
    path's up to float32 rounding order: in 16-bit, under 2 % of the elements differ (a block rounded once more
    would change about a quarter). Head dim 64 in bf16 takes our kernels, with the in-kernel dQ add
    (PK_JAX_RING_MERGE=dq) mixed in; 16 the XLA block path. A bad value is refused by name."""
    from pk_jax.context import row_sum

    q, k, v, d_out = random_qkv(60 + g + causal, 1, g * T_LOCAL, n, kv_heads, head_dim, dtype)
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
    monkeypatch.setenv(row_sum.SUMS_VAR, "eager")
    eager = sharded(attn, g, layout, q, k, v, d_out)
    monkeypatch.setenv(row_sum.SUMS_VAR, "deferred")
    got = sharded(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout),
                  g, layout, q, k, v, d_out)
    assert_all_close(got, reference(q, k, v, d_out, causal), 3e-2 if dtype == jnp.bfloat16 else 2e-5)
    assert_all_close(got, eager, 1e-2 if dtype == jnp.bfloat16 else 1e-5)
    if dtype == jnp.bfloat16:
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, eager):
            assert np.mean(np.asarray(a) != np.asarray(b)) < 0.02, f"{name}: deferred rounds differently from eager"
    monkeypatch.setenv(row_sum.SUMS_VAR, "later")
    with pytest.raises(ValueError, match=row_sum.SUMS_VAR):
        sharded(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout),
                g, layout, q, k, v, d_out)


@pytest.mark.parametrize("g,layout,causal", [(2, "zigzag", True), (4, "contiguous", False)])
def test_ring_blocks_take_the_attention_kernel_for_16_bit_inputs(g, layout, causal):
    """bf16 with head_dim 64: each block pair binds our attention kernel (pk_attention; its traced offsets
    and (B, N, T) LSE), whose XLA lowering runs here; the ring still matches the whole-sequence float32
    reference to bf16 accuracy. float32 or head_dim 16 keep the XLA block path (the cases above)."""
    q, k, v, d_out = random_qkv(7 + g, 1, g * T_LOCAL, 4, 2, 64, jnp.bfloat16)
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
    jaxpr = jax.make_jaxpr(jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp")))(q, k, v)
    assert "pk_attention" in str(jaxpr)
    got = sharded(attn, g, layout, q, k, v, d_out)
    assert_all_close(got, reference(q, k, v, d_out, causal), 3e-2)


@pytest.mark.parametrize("g,layout,causal,kv_heads", [(2, "zigzag", True, 4), (4, "zigzag", True, 1),
                                                      (2, "zigzag", False, 2),
                                                      (4, "contiguous", False, 2),
                                                      (4, "contiguous", True, 2)])
def test_ring_merged_in_place(monkeypatch, g, layout, causal, kv_heads):
    """PK_JAX_RING_MERGE=kernel (16-bit inputs): every forward block goes through pk_attention_accumulate into
    one float32 state, and every backward pair's dQ through
    pk_attention_bwd_accumulate (their XLA lowerings here); output and gradients match the whole-sequence float32
    reference to bf16 accuracy and the default path's output closely; =dq: only the backward's dQ in place, the
    forward's bits the default's; a bad value is refused by name."""
    from pk_jax.context import block_accumulate

    q, k, v, d_out = random_qkv(40 + g + causal, 1, g * T_LOCAL, 4, kv_heads, 64, jnp.bfloat16)
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
    default = sharded(attn, g, layout, q, k, v, d_out)
    monkeypatch.setenv(block_accumulate.ACC_VAR, "kernel")
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    fwd = str(jax.make_jaxpr(f)(q, k, v))
    # zigzag causal: step 0's two whole-chunk pairs, then low / high per step; else one pair per step
    want_fwd = 2 + 2 * (g - 1) if (causal and layout == "zigzag") else g
    assert fwd.count("pk_attention_accumulate[") == want_fwd
    bwd = str(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, v))
    assert "pk_attention_bwd_accumulate[" in bwd and "pk_attention_bwd[" not in bwd, "every pair's dQ added in place"
    got = sharded(attn, g, layout, q, k, v, d_out)
    assert_all_close(got, reference(q, k, v, d_out, causal), 3e-2)
    assert_all_close(got[:1], default[:1], 1e-2)  # forward blocks are no longer rounded to bf16 before a merge
    monkeypatch.setenv(block_accumulate.ACC_VAR, "dq")  # the backward's dQ only: the forward is the default's
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)  # not traced yet
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    assert "pk_attention_accumulate[" not in str(jax.make_jaxpr(f)(q, k, v))
    bwd = str(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, v))
    assert "pk_attention_bwd_accumulate[" in bwd and "pk_attention_bwd[" not in bwd
    got = sharded(attn, g, layout, q, k, v, d_out)
    assert_all_close(got, reference(q, k, v, d_out, causal), 3e-2)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(default[0]))
    monkeypatch.setenv(block_accumulate.ACC_VAR, "dq-direct")  # as dq, with q / dO rows read in place
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    bwd = str(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, v))
    assert "in_place=True" in bwd and "in_place=False" not in bwd and "pk_attention_bwd[" not in bwd
    direct = sharded(attn, g, layout, q, k, v, d_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), direct, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"dq-direct vs dq: {name}")
    monkeypatch.setenv(block_accumulate.ACC_VAR, "cuda")
    with pytest.raises(ValueError, match=block_accumulate.ACC_VAR):
        sharded(attn, g, layout, q, k, v, d_out)


def test_accumulate_reference_writes_and_merges_rows():
    """block_accumulate.reference: mode write puts the block's attention in its rows only; merging two key
    halves in turn equals attention over all keys (rows elsewhere untouched); bad shapes name the argument."""
    from pk_jax.context.block_accumulate import accumulate

    q, k, v, _ = random_qkv(5, 2, 32, 4, 2, 64, jnp.bfloat16)
    acc = jnp.full((2, 48, 4, 64), 7.0, jnp.float32)
    lse = jnp.full((2, 4, 48), -jnp.inf, jnp.float32)
    off = jnp.zeros(2, jnp.int32)
    kw = dict(scale=0.125, causal=False)
    a1, l1 = accumulate(q, k[:, :16], v[:, :16], off, acc, lse, row_start=8, merge=False, **kw)
    a2, l2 = accumulate(q, k[:, 16:], v[:, 16:], off, a1, l1, row_start=8, merge=True, **kw)
    want = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                        scale=0.125, implementation="xla")
    assert_all_close([a2[:, 8:40]], [want], 1e-2, names=("merged",))  # P is rounded to bf16 as in the kernel
    np.testing.assert_array_equal(np.asarray(a2[:, :8]), 7.0)
    np.testing.assert_array_equal(np.asarray(a2[:, 40:]), 7.0)
    assert np.isneginf(np.asarray(l2[:, :, :8])).all() and np.isfinite(np.asarray(l2[:, :, 8:40])).all()
    with pytest.raises(ValueError, match="outside the state"):
        accumulate(q, k, v, off, acc, lse, row_start=20, merge=True, **kw)
    with pytest.raises(ValueError, match="lse"):
        accumulate(q, k, v, off, acc, lse[:, :, :40], row_start=0, merge=True, **kw)


def test_accumulate_bwd_in_place_reads_the_pair_rows():
    """accumulate_bwd(in_place=True): q and dO are the state's whole rows and the pair's are [row_start, row_start +
    Tq) (Tq from lse): the same results as the call on the sliced rows; q of the pair's shape is refused by name."""
    from pk_jax.context.block_accumulate import accumulate_bwd

    q, k, v, _ = random_qkv(11, 2, 40, 4, 2, 64, jnp.bfloat16)
    do = q[:, ::-1]
    stats = jax.random.normal(jax.random.key(3), (2, 16, 4), jnp.float32)
    dq = jax.random.normal(jax.random.key(4), (2, 40, 4, 64), jnp.float32)
    off = jnp.asarray([24, 0], jnp.int32)
    kw = dict(row_start=24, scale=0.125, causal=True)
    want = accumulate_bwd(q[:, 24:], k, v, do[:, 24:], stats, stats * 0.5, off, dq, **kw)
    got = accumulate_bwd(q, k, v, do, stats, stats * 0.5, off, dq, in_place=True, **kw)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="state's rows"):
        accumulate_bwd(q[:, 24:], k, v, do[:, 24:], stats, stats * 0.5, off, dq, in_place=True, **kw)


def test_accumulate_under_vmap_equals_a_loop():
    """The two in-place primitives under jax.vmap (the mapped axis folded into the batch axis; a mapped offsets
    runs the XLA composition per element): the same values as one call per element."""
    from pk_jax.context.block_accumulate import accumulate, accumulate_bwd

    q, k, v, _ = random_qkv(9, 2, 16, 4, 2, 64, jnp.bfloat16)
    qs, ks, vs = (jnp.stack([x, x[::-1]]) for x in (q, k, v))  # a mapped axis of 2
    acc = jnp.stack([jnp.zeros((2, 24, 4, 64), jnp.float32)] * 2)
    lse = jnp.full((2, 2, 4, 24), -jnp.inf, jnp.float32)
    off = jnp.asarray([4, 0], jnp.int32)
    kw = dict(row_start=4, merge=False, scale=0.125, causal=True)
    got = jax.vmap(lambda q, k, v, a, l: accumulate(q, k, v, off, a, l, **kw))(qs, ks, vs, acc, lse)
    for i in range(2):
        want = accumulate(qs[i], ks[i], vs[i], off, acc[i], lse[i], **kw)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-6, atol=1e-6)
    offs = jnp.asarray([[4, 0], [8, 0]], jnp.int32)  # mapped offsets
    got = jax.vmap(lambda q, k, v, o, a, l: accumulate(q, k, v, o, a, l, **kw))(qs, ks, vs, offs, acc, lse)
    want = accumulate(qs[1], ks[1], vs[1], offs[1], acc[1], lse[1], **kw)
    np.testing.assert_allclose(np.asarray(got[0][1]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
    do = qs.astype(jnp.float32)
    stats = jnp.ones((2, 2, 16, 4), jnp.float32)
    dq = jnp.zeros((2, 2, 24, 4, 64), jnp.float32)
    bkw = dict(row_start=8, scale=0.125, causal=False)
    got = jax.vmap(lambda q, k, v, do, l, d, dq: accumulate_bwd(q, k, v, do, l, d, off, dq, **bkw))(
        qs, ks, vs, do.astype(jnp.bfloat16), stats, stats * 0.5, dq)
    want = accumulate_bwd(qs[0], ks[0], vs[0], do[0].astype(jnp.bfloat16), stats[0], stats[0] * 0.5, off, dq[0], **bkw)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a[0], np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)


def test_ring_attention_group_of_one_is_plain_attention():
    q, k, v, d_out = random_qkv(1, 1, 2 * T_LOCAL, 4, 2, 8)
    got = sharded(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=True), 1, "zigzag", q, k, v, d_out)
    assert_all_close(got, reference(q, k, v, d_out, True), 1e-5)


ULYSSES_CASES = [  # (G, layout, causal, q heads, kv heads): kv heads 2 at G 4/8 exercise the replication
    (4, "contiguous", True, 8, 4),
    (4, "zigzag", True, 8, 2),
    (8, "contiguous", False, 8, 2),
]


@pytest.mark.parametrize("g,layout,causal,n,kv_heads", ULYSSES_CASES)
def test_ulysses_attention_matches_whole_sequence_reference(g, layout, causal, n, kv_heads):
    q, k, v, d_out = random_qkv(g + 100 * causal, 2, g * T_LOCAL, n, kv_heads, 16)
    got = sharded(lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp", causal=causal, layout=layout),
                  g, layout, q, k, v, d_out)
    assert_all_close(got, reference(q, k, v, d_out, causal), 1e-5)


# Each (chunks, exchange) once, the two mesh cases alternating (CI time: the full product was 12 programs).
@pytest.mark.parametrize("chunks,a2a,g,layout,causal,n,kv_heads", [
    (*ca, *[(2, "zigzag", True, 8, 4), (4, "contiguous", False, 16, 8)][i % 2]) for i, ca in enumerate(
        [("2", "pk"), ("4", "lax"), ("3", "pk"), ("1", "async"), ("2", "async"), ("4", "async")])])
def test_ulysses_head_chunks(monkeypatch, chunks, a2a, g, layout, causal, n, kv_heads):
    """PK_JAX_ULYSSES_CHUNKS / PK_JAX_ULYSSES_A2A: the heads exchanged and attended in chunks (3 is cut to a count
    dividing every member's query and K/V heads), by either all-to-all or the asynchronous one (distance shifts,
    its own VJP; the SM shift engine, as the copy engines' windowed exchanges are test_ulysses_windowed_exchanges'):
    the same result and gradients, and one exchange per chunk and tensor in the program."""
    from pk_jax.context import ring_shift, ulysses

    monkeypatch.setenv(ring_shift.ENGINE_VAR, "sm")
    monkeypatch.setenv(ulysses.CHUNKS_VAR, chunks)
    monkeypatch.setenv(ulysses.A2A_VAR, a2a)
    q, k, v, d_out = random_qkv(g + 7 * causal, 2, g * T_LOCAL, n, kv_heads, 16)
    attn = lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp", causal=causal, layout=layout)
    assert_all_close(sharded(attn, g, layout, q, k, v, d_out), reference(q, k, v, d_out, causal), 1e-5)
    jaxpr = str(jax.make_jaxpr(jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp")))(
        q, k, v))
    c = math.gcd(int(chunks), n // g, kv_heads // g)
    op = "pk_ring_shift_start" if a2a == "async" else "all_to_all"  # async: one shift launch per exchange at G <= 5
    assert jaxpr.count(op) >= 4 * c, (c, op, jaxpr.count(op))


_WINDOW_CASES = [(2, "zigzag", True, 8, 4), (4, "contiguous", False, 16, 8), (8, "contiguous", True, 16, 8)]


# Every (own, chunks) pair once, the mesh cases rotated through them (CI time: the full product was 18 programs).
@pytest.mark.parametrize("own,chunks,g,layout,causal,n,kv_heads", [
    (own, chunks, *_WINDOW_CASES[(i + j) % 3]) for i, own in enumerate(["xla", "copy"])
    for j, chunks in enumerate(["1", "2", "4"])])
def test_ulysses_windowed_exchanges(monkeypatch, own, chunks, g, layout, causal, n, kv_heads):
    """PK_JAX_ULYSSES_A2A=async with PK_JAX_RING_SHIFT_ENGINE=copy: every exchange a windowed all-to-all (chunk i
    read from the whole q/k/v, results written into their heads of the whole output: no chunk slices, assembly
    or unchunk pass), forward and gradients equal to the reference; one start per tensor and chunk each way, each
    copying its own block or not as PK_JAX_WINDOW_OWN says."""
    from pk_jax.context import ring_shift, ulysses

    monkeypatch.setenv(ulysses.OWN_VAR, own)
    monkeypatch.setenv(ulysses.CHUNKS_VAR, chunks)
    monkeypatch.setenv(ulysses.A2A_VAR, "async")
    monkeypatch.setenv(ring_shift.ENGINE_VAR, "copy")
    q, k, v, d_out = random_qkv(g + 11 * causal, 2, g * T_LOCAL, n, kv_heads, 16)
    attn = lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp", causal=causal, layout=layout)
    assert_all_close(sharded(attn, g, layout, q, k, v, d_out), reference(q, k, v, d_out, causal), 1e-5)
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    c = math.gcd(int(chunks), n // g, kv_heads // g)
    fwd = str(jax.make_jaxpr(f)(q, k, v))
    assert fwd.count("pk_exchange_start[") == 4 * c and fwd.count(f"own={own == 'copy'}") == 4 * c
    bwd = str(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, v))
    assert bwd.count("pk_exchange_start[") == 4 * c + 4 * c and "pk_ring_shift_start" not in bwd


@pytest.mark.parametrize("g,n,kv_heads", [(2, 32, 16), (2, 8, 4), (4, 16, 8)])
def test_ulysses_auto_exchange(monkeypatch, g, n, kv_heads):
    """PK_JAX_ULYSSES_A2A unset ("auto") as on GPUs of one process: at G 2 the windowed pipeline in 8 head chunks
    (fewer where the heads do not split that far), own blocks placed by XLA, matching the reference; at G 4 one
    exchange each way, no side stream."""
    from pk_jax.context import ulysses

    monkeypatch.setattr(ulysses, "_on_gpus", lambda: True)
    q, k, v, d_out = random_qkv(g + n, 2, g * T_LOCAL, n, kv_heads, 16)
    attn = lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp")
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    fwd = str(jax.make_jaxpr(f)(q, k, v))
    if g == 2:
        c = math.gcd(ulysses.AUTO_WINDOWED_CHUNKS, n // g, kv_heads // g)
        assert fwd.count("pk_exchange_start[") == 4 * c and fwd.count("own=False") == 4 * c
        assert_all_close(sharded(attn, g, "contiguous", q, k, v, d_out), reference(q, k, v, d_out, False), 1e-5)
    else:
        assert "pk_exchange_start" not in fwd and "pk_ring_shift_start" not in fwd
    monkeypatch.setattr(ulysses, "_on_gpus", lambda: False)  # CPU: one exchange each way (a new trace)
    f_cpu = jax.shard_map(lambda a, b, c: attn(a, b, c), mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    assert "pk_exchange_start" not in str(jax.make_jaxpr(f_cpu)(q, k, v))


@pytest.mark.parametrize("g,n,kv_heads,layout,causal", [(2, 16, 8, "zigzag", True), (4, 32, 16, "contiguous", False)])
def test_ulysses_windowed_half_ends(monkeypatch, g, n, kv_heads, layout, causal):
    """PK_JAX_ULYSSES_HALF_ENDS=1: 2 chunks become 3 over 4 units (widths 1, 2, 1 units of every member's q and
    K/V blocks), forward and gradients equal to the reference; the windows tile every block exactly once."""
    from pk_jax.context import ring_shift, ulysses
    from pk_jax.context.window_exchange import HeadSpans, heads_in, heads_out

    spans = HeadSpans.half_ends(2)
    assert spans == HeadSpans(4, ((0, 1), (1, 3), (3, 4)))
    assert HeadSpans.half_ends(8).spans[1:3] == ((1, 3), (3, 5)) and len(HeadSpans.half_ends(8).spans) == 9
    for heads in (n, kv_heads):  # input windows and output windows cover each member's block once, in order
        shape = (1, T_LOCAL, heads, 16)
        got = [heads_in(shape, g, spans, i)[0] for i in range(3)]
        assert [(w.offset, w.length) for w in got] == [(0, heads // g // 4), (heads // g // 4, heads // g // 2),
                                                       (3 * heads // g // 4, heads // g // 4)]
        for i in range(3):
            out = heads_in(shape, g, spans, i)[2]
            assert heads_out(out, g, spans, i)[1] == got[i] and heads_out(out, g, spans, i)[2] == shape
    monkeypatch.setenv(ulysses.HALF_ENDS_VAR, "1")
    monkeypatch.setenv(ulysses.CHUNKS_VAR, "2")
    monkeypatch.setenv(ulysses.A2A_VAR, "async")
    monkeypatch.setenv(ring_shift.ENGINE_VAR, "copy")
    q, k, v, d_out = random_qkv(g + 17, 2, g * T_LOCAL, n, kv_heads, 16)
    attn = lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp", causal=causal, layout=layout)
    assert_all_close(sharded(attn, g, layout, q, k, v, d_out), reference(q, k, v, d_out, causal), 1e-5)
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    assert str(jax.make_jaxpr(f)(q, k, v)).count("pk_exchange_start[") == 4 * 3


@pytest.mark.parametrize("prefill,g,layout,causal", [("0", 2, "zigzag", True), ("2", 2, "contiguous", False),
                                                     ("7", 4, "contiguous", True)])
def test_ulysses_prefilled_own_blocks(monkeypatch, prefill, g, layout, causal):
    """PK_JAX_ULYSSES_PREFILL=p: the own input blocks of chunks 1 .. min(p, c-1) are placed into buffers of their own
    (pk_uninitialized) ahead of chunk 0's wait, and those chunks' exchanges then fill the rest (forward: q, k, v;
    backward: dO); forward and gradients equal to the reference."""
    from pk_jax.context import ring_shift, ulysses

    monkeypatch.setenv(ulysses.PREFILL_VAR, prefill)
    monkeypatch.setenv(ulysses.CHUNKS_VAR, "4")
    monkeypatch.setenv(ulysses.A2A_VAR, "async")
    monkeypatch.setenv(ring_shift.ENGINE_VAR, "copy")
    n, kv_heads = 4 * g, 4 * g
    q, k, v, d_out = random_qkv(g + 23, 2, g * T_LOCAL, n, kv_heads, 16)
    attn = lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp", causal=causal, layout=layout)
    assert_all_close(sharded(attn, g, layout, q, k, v, d_out), reference(q, k, v, d_out, causal), 1e-5)
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    early = min(int(prefill), 3)
    assert str(jax.make_jaxpr(f)(q, k, v)).count("pk_uninitialized[") == 3 * early
    bwd = str(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, v))
    assert bwd.count("pk_uninitialized[") == 3 * early + early


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside its equations' parameters."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("engine", ["copy", "sm"])
def test_ulysses_async_backward_waits_for_every_forward_chunk(monkeypatch, engine):
    """With PK_JAX_ULYSSES_BWD_BARRIER=chunks the async backward's first exchange depends on every chunk's attention
    output (one optimization barrier over d_out and them), so XLA cannot defer chunks 1..c-1's forward attention
    into the backward, where its exchanges would queue behind the backward's on the side stream; by default there
    is no such barrier."""
    from pk_jax.context import ring_shift, ulysses

    c = 4
    monkeypatch.setenv(ulysses.BWD_BARRIER_VAR, "chunks")
    monkeypatch.setenv(ulysses.A2A_VAR, "async")
    monkeypatch.setenv(ulysses.CHUNKS_VAR, str(c))
    monkeypatch.setenv(ring_shift.ENGINE_VAR, engine)
    q, k, v, _ = random_qkv(5, 1, 2 * T_LOCAL, 8, 8, 16)
    f = jax.shard_map(lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp"), mesh=mesh(2), in_specs=P(None, "sp"),
                      out_specs=P(None, "sp"))

    def barriers() -> list[list[tuple[int, ...]]]:  # each optimization barrier's operand shapes in the VJP
        jaxpr = jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, v).jaxpr
        return [[tuple(x.aval.shape) for x in e.invars] for e in _eqns(jaxpr) if e.primitive.name == "optimization_barrier"]

    d_out = (1, q.shape[1] // 2, *q.shape[2:])  # on one member; a chunk's output: the whole sequence, its heads
    chunk = (1, q.shape[1], q.shape[2] // 2 // c, q.shape[3])
    assert [d_out] + [chunk] * c in barriers(), f"no barrier over d_out and every chunk's output: {barriers()}"
    monkeypatch.delenv(ulysses.BWD_BARRIER_VAR)
    assert [d_out] + [chunk] * c not in barriers(), f"the default has no backward barrier: {barriers()}"


@pytest.mark.parametrize("g", [2, 3, 8])
def test_window_all_to_all_places_windows(g):
    """The windowed all-to-all's semantics (its lax lowering here): the tiled all-to-all for whole blocks; a source
    offset sends one run of every block; a destination offset with `into` overwrites only the windows."""
    from pk_jax.context.ring_shift import shift_done
    from pk_jax.context.window_exchange import Window, window_all_to_all_start

    b, t, h, d = 2, 3, 4 * g, 5
    x = jnp.arange(g * b * t * h * d, dtype=jnp.float32).reshape(b, g * t, h, d)
    run = lambda f, x: jax.jit(jax.shard_map(f, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp")))(x)

    def exchange(x, **kw):
        y, token = window_all_to_all_start(x, ("sp",), **kw)
        return shift_done((y,), token, keep_alive=x)[0]

    whole = lambda x: exchange(x, src=Window(2, h // g, 0, h // g), dst=Window(1, t, 0, t), out_shape=(b, g * t, h // g, d))
    want = lambda x: jax.lax.all_to_all(x, "sp", 2, 1, tiled=True)
    np.testing.assert_array_equal(run(whole, x), run(want, x))
    # The second run of 2 of every member's h / G heads, landing after t rows that keep `into`'s sevens.
    part = lambda x: exchange(x, src=Window(2, h // g, 2, 2), dst=Window(1, t, t, t),
                              into=jnp.full((b, (g + 1) * t, 2, d), 7.0))
    got = np.asarray(run(part, x)).reshape(b, g, (g + 1) * t, 2, d)  # by member
    tiled = np.asarray(run(want, x)).reshape(b, g, g * t, h // g, d)
    np.testing.assert_array_equal(got[:, :, t:], tiled[..., 2:4, :])
    assert (got[:, :, :t] == 7.0).all()
    # own=False: the own block's window keeps `into`'s cells until place_own puts the block there.
    from pk_jax.context.window_exchange import place_own
    src, dst = Window(2, h // g, 2, 2), Window(1, t, t, t)
    skip = lambda x: exchange(x, src=src, dst=dst, into=jnp.full((b, (g + 1) * t, 2, d), 7.0), own=False)
    got_skip = np.asarray(run(skip, x)).reshape(b, g, (g + 1) * t, 2, d)
    for r in range(g):  # member r's own rows are [t + r t, t + (r + 1) t)
        own_rows = slice(t + r * t, t + (r + 1) * t)
        assert (got_skip[:, r, own_rows] == 7.0).all()
        others = np.delete(np.arange(t, (g + 1) * t), np.arange(r * t, (r + 1) * t))
        np.testing.assert_array_equal(got_skip[:, r, others], got[:, r, others])
    placed = run(lambda x: place_own(x, skip(x), ("sp",), src, dst), x)
    np.testing.assert_array_equal(np.asarray(placed).reshape(got.shape), got)
    with pytest.raises(ValueError, match="does not fit"):
        run(lambda x: exchange(x, src=Window(2, h // g, 1, h // g), dst=Window(1, t, 0, t),
                               out_shape=(b, g * t, h // g, d)), x)
    with pytest.raises(ValueError, match="overlap"):  # every sender into the same rows: a race on GPUs
        run(lambda x: exchange(x, src=Window(2, h // g, 0, h // g), dst=Window(1, 0, 0, t),
                               out_shape=(b, t, h // g, d)), x)


def test_window_geometry_rows_of_one_element():
    """One head of head_dim 1 per window: rows of one element (no contiguous run), still a 3-D copy layout whose
    bytes are the windows'."""
    from pk_jax.context.window_exchange import HeadSpans, block_geometry, heads_in

    src, dst, out = heads_in((2, 5, 4, 1), 2, HeadSpans.uniform(2), 1)  # w = 1 head, D = 1
    width, height, depth, sp, ss, dp, ds, so, sst, do, dst_ = block_geometry((2, 5, 4, 1), out, src, dst, 2, 2)
    assert (width, height, depth) == (2, 5, 2) and (sp, ss, dp, ds) == (8, 40, 2, 20)
    assert (so, sst, do, dst_) == (2, 4, 0, 10)


@pytest.mark.parametrize("g", [2, 3, 6, 8])  # 6 and 8: two shift launches (at most 4 blocks each)
@pytest.mark.parametrize("split,concat", [(2, 1), (1, 2), (1, -2), (-1, 0)])
def test_async_all_to_all_equals_lax(g, split, concat):
    from pk_jax.context.async_all_to_all import all_to_all_done, all_to_all_start

    x = jnp.arange(g * 2 * g * 4 * g * 3 * g * 1.0).reshape(g * 2, g * 4, g * 3, g)
    ours = lambda x: all_to_all_done(all_to_all_start(x, ("sp",), split, concat))
    want = lambda x: jax.lax.all_to_all(x, "sp", split % 4, concat % 4, tiled=True)
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh(g), in_specs=P("sp"), out_specs=P("sp")))(x)
    np.testing.assert_array_equal(run(ours), run(want))


@pytest.mark.parametrize("g,a2a,causal", [(2, "async", True), (4, "async", False), (2, "pk", False)])
def test_ulysses_local_attention_by_our_kernel(monkeypatch, g, a2a, causal):
    """PK_JAX_ULYSSES_LOCAL=pk: the local attention binds our kernel (bf16, head_dim 64; its XLA lowering here),
    forward and gradients to bf16 accuracy, with the exchanges of PK_JAX_ULYSSES_A2A."""
    from pk_jax.context import ulysses

    monkeypatch.setenv(ulysses.LOCAL_VAR, "pk")
    monkeypatch.setenv(ulysses.A2A_VAR, a2a)
    monkeypatch.setenv(ulysses.CHUNKS_VAR, "2")
    q, k, v, d_out = random_qkv(40 + g, 1, g * T_LOCAL, 4 * g, 2 * g, 64, jnp.bfloat16)
    attn = lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp", causal=causal)
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, v))
    assert "pk_attention" in jaxpr and "pk_attention_bwd" in jaxpr
    assert_all_close(sharded(attn, g, "contiguous", q, k, v, d_out), reference(q, k, v, d_out, causal), 3e-2)
    monkeypatch.setenv(ulysses.LOCAL_VAR, "cudnn")
    with pytest.raises(ValueError, match=ulysses.LOCAL_VAR):
        sharded(attn, g, "contiguous", q, k, v, d_out)


def test_ulysses_windowed_exchanges_leave_sms_to_the_copies(monkeypatch):
    """Windowed exchanges (copy engines, single process): our local attention, forward and backward, leaves
    $PK_JAX_ULYSSES_RESERVE_SMS free (the strided copies need SMs); a bad count names the variable."""
    from pk_jax.context import ulysses
    from pk_jax.context.ring_shift import ENGINE_VAR

    for var, val in ((ulysses.LOCAL_VAR, "pk"), (ulysses.A2A_VAR, "async"), (ulysses.CHUNKS_VAR, "2"),
                     (ENGINE_VAR, "copy"), (ulysses.RESERVE_VAR, "24")):
        monkeypatch.setenv(var, val)
    q, k, v, d_out = random_qkv(61, 1, 2 * T_LOCAL, 8, 4, 64, jnp.bfloat16)
    f = jax.shard_map(lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp"), mesh=mesh(2), in_specs=P(None, "sp"),
                      out_specs=P(None, "sp"))
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, k, v))
    assert "pk_exchange_start" in jaxpr
    reserves = re.findall(r"reserve_sms=(\d+)", jaxpr)
    assert len(reserves) >= 4 and set(reserves) == {"24"}, "2 chunks' forward and backward kernels, each 24"
    monkeypatch.setenv(ulysses.RESERVE_VAR, "-1")
    with pytest.raises(ValueError, match=ulysses.RESERVE_VAR):
        ulysses.window_reserve_sms()


def test_ulysses_async_compiled_order_overlaps_exchanges_with_attention(monkeypatch):
    """In the compiled CPU program (G 2, 2 head chunks, the shifts' collective-permute fallback): chunk 0's three
    exchanges, then chunk 1's, whose results are first read only after chunk 0's softmax and P V; then the two
    output exchanges. (The fallback's token is a constant, so on CPU XLA may still put chunk 0's Q Kᵀ before
    chunk 1's starts; on GPUs the token is the start call's output and the barrier holds all of the attention.)"""
    from pk_jax.context import ulysses

    monkeypatch.setenv(ulysses.A2A_VAR, "async")
    monkeypatch.setenv(ulysses.CHUNKS_VAR, "2")
    spec = jax.ShapeDtypeStruct((1, 2 * 32, 8, 16), jnp.float32)
    f = jax.shard_map(lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp"), mesh=mesh(2), in_specs=P(None, "sp"),
                      out_specs=P(None, "sp"))
    hlo = jax.jit(f).lower(spec, spec, spec).compile().as_text()
    lines = [ln.strip() for ln in hlo[hlo.index("ENTRY"):].splitlines()]
    permutes = [i for i, ln in enumerate(lines) if "collective-permute(" in ln]
    assert len(permutes) == 8, "q, k, v in and the output back, for each of 2 chunks"
    chunk1 = permutes[3:6]
    names = [re.match(r"%?([\w.\-]+) =", lines[i]).group(1) for i in chunk1]
    uses = lambda ln: "=" in ln and any(re.search(rf"%{re.escape(n)}\b", ln.split("=", 1)[1]) for n in names)
    first_use = min(i for i, ln in enumerate(lines) if uses(ln))
    between = [i for i, ln in enumerate(lines) if "fusion(" in ln and max(chunk1) < i < first_use]
    assert between, "chunk 0's attention sits between chunk 1's exchange start and the first read of its result"


def test_ulysses_chunk_heads_round_trip_and_bad_settings(monkeypatch):
    from pk_jax.context import ulysses

    x = jnp.arange(2 * 3 * 24 * 2).reshape(2, 3, 24, 2)
    g, c = 4, 3
    parts = [ulysses.chunk_heads(x, g, c, i) for i in range(c)]
    np.testing.assert_array_equal(ulysses.unchunk_heads(parts, g), x)
    # member j's run i: heads j * 6 + i * 2 + (0, 1)
    np.testing.assert_array_equal(parts[1][0, 0, :, 0], x[0, 0, [2, 3, 8, 9, 14, 15, 20, 21], 0])
    for var, bad in ((ulysses.CHUNKS_VAR, "0"), (ulysses.A2A_VAR, "nccl")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            ulysses.head_chunks() if var == ulysses.CHUNKS_VAR else ulysses.exchange()
        monkeypatch.delenv(var)


@pytest.mark.parametrize("causal", [False, True])
def test_block_attention_chunked_path_and_global_offsets(monkeypatch, causal):
    """The XLA per-block attention in query chunks (tiny score budget) with keys placed after some
    queries: rows that see no key have lse -inf, output 0 and zero gradients."""
    b, tq, tk, n, kv_heads, h = 1, 24, 16, 4, 2, 8
    q, k, v, d_out = random_qkv(7, b, tq, n, kv_heads, h)
    k, v = k[:, :tk], v[:, :tk]
    q_off, kv_off = 40, 50  # query rows 0..9 precede every key
    monkeypatch.setattr(block_mod, "SCORE_BYTES_BUDGET", b * n * tk * 4 * 6)  # 6-row chunks
    assert block_mod.query_chunk_rows(b, tq, n, tk, block_mod.SCORE_BYTES_BUDGET) == 6
    mask = (q_off + jnp.arange(tq))[:, None] >= (kv_off + jnp.arange(tk))[None, :] if causal else None

    def ref(q, k, v):
        kk, vv = jnp.repeat(k, n // kv_heads, 2), jnp.repeat(v, n // kv_heads, 2)
        s = jnp.einsum("bqnh,bknh->bnqk", q, kk) / np.sqrt(h)
        s = jnp.where(mask, s, -jnp.inf) if causal else s
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
        return jnp.einsum("bnqk,bknh->bqnh", p, vv), jnp.moveaxis(lse, 1, 2)

    fwd = lambda q, k, v: block_mod.block_attention(q, k, v, scale=1 / np.sqrt(h), causal=causal,
                                                    q_offset=q_off, kv_offset=kv_off)
    out, lse = jax.jit(fwd)(q, k, v)
    want_out, want_lse = jax.jit(ref)(q, k, v)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    np.testing.assert_allclose(np.where(np.isfinite(lse), lse, 0), np.where(np.isfinite(want_lse), want_lse, 0),
                               atol=1e-5)
    delta = jnp.sum(d_out * out, axis=-1)
    grads = jax.jit(lambda *a: block_mod.block_attention_bwd(*a, scale=1 / np.sqrt(h), causal=causal,
                                                             q_offset=q_off, kv_offset=kv_off))(q, k, v, d_out, lse, delta)
    want = jax.jit(lambda *a: jax.vjp(lambda q, k, v: ref(q, k, v)[0], *a)[1](d_out))(q, k, v)
    assert_all_close(grads, want, 1e-5, names=("dq", "dk", "dv"))
    if causal:
        assert np.all(np.asarray(grads[0])[:, :10] == 0), "rows that see no key must get dq = 0"


@pytest.mark.parametrize("g", [1, 2, 3, 8])
def test_zigzag_round_trip_and_chunk_ownership(g):
    x = jnp.arange(2 * 2 * g * 5 * 3).reshape(2, 2 * g * 5, 3)  # batch 2, chunks of 5 rows
    z = to_zigzag(x, g)
    np.testing.assert_array_equal(from_zigzag(z, g), x)
    chunk = 5
    for r in range(g):  # a contiguous G-way shard r of the zigzag order holds global chunks r and 2G-1-r
        shard = np.asarray(z[:, r * 2 * chunk:(r + 1) * 2 * chunk])
        np.testing.assert_array_equal(shard[:, :chunk], x[:, r * chunk:(r + 1) * chunk])
        np.testing.assert_array_equal(shard[:, chunk:], x[:, (2 * g - 1 - r) * chunk:(2 * g - r) * chunk])
    assert sorted(zigzag_chunk_order(g)) == list(range(2 * g))
    np.testing.assert_array_equal(from_zigzag(to_zigzag(x, g, axis=-2), g, axis=-2), x)


def test_zigzag_rejects_lengths_not_divisible():
    with pytest.raises(ValueError, match="divisible by 2 \\* groups"):
        to_zigzag(jnp.zeros((1, 10, 2)), 4)


def _temp_bytes(fn, g: int, b: int, t: int, n: int, h: int) -> int:
    """Temporary bytes of the compiled per-device forward+backward program (inputs/outputs excluded)."""
    spec = jax.ShapeDtypeStruct((b, g * t, n, h), jnp.float32)
    f = jax.shard_map(fn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), (0, 1, 2)))
    return grad.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes


def _gather_then_attend(q, k, v):
    k, v = (jax.lax.all_gather(x, "sp", axis=1, tiled=True) for x in (k, v))
    return jax.nn.dot_product_attention(q, k, v, is_causal=False)


def test_ring_temp_memory_is_local_not_full_sequence():
    """Per-device temp memory of ring forward+backward is flat in G and within the local working set.
    The overlapped backward (the default "pk" transport, pk_jax/context/ring_overlap.py) holds float32 dq
    (1 local block), the owner's dK/dV (2), a visiting block's fresh dK/dV (2), the accumulator leaving and
    the one arriving (4), and two K/V blocks (held and arriving, 4); plus one block pair's score-sized
    intermediates (s, p, dp/ds: 3 x T^2). At G = 2 no accumulator is in transit during a compute, so the
    flatness is measured from G = 4 (the ring's full working set) to G = 8. The all-gather baseline,
    measured the same way, grows with G (the measurement sees full-sequence K/V)."""
    b, t, n, h = 1, 128, 4, 32
    block = b * t * n * h * 4
    scores = b * n * t * t * 4
    ring = lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=True)
    ring_temp = {g: _temp_bytes(ring, g, b, t, n, h) for g in (2, 4, 8)}
    base_temp = {g: _temp_bytes(_gather_then_attend, g, b, t, n, h) for g in (2, 8)}
    budget = (1 + 2 + 2 + 4 + 4) * block + 3 * scores
    assert ring_temp[8] <= 1.1 * ring_temp[4], ring_temp
    assert max(ring_temp.values()) <= budget, (ring_temp, budget)
    assert base_temp[8] >= 3 * base_temp[2], base_temp  # control: the full K/V shows up in the measure
    assert ring_temp[8] < base_temp[8] / 4, (ring_temp, base_temp)


def test_ring_temp_memory_xla_transport(monkeypatch):
    """The "xla" transport (lax.scan, ppermute): flat from G = 2, within the same budget."""
    monkeypatch.setenv("PK_JAX_RING_TRANSPORT", "xla")
    b, t, n, h = 1, 128, 4, 32
    block, scores = b * t * n * h * 4, b * n * t * t * 4
    ring = lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=True)
    ring_temp = {g: _temp_bytes(ring, g, b, t, n, h) for g in (2, 8)}
    assert ring_temp[8] <= 1.1 * ring_temp[2], ring_temp
    assert max(ring_temp.values()) <= (1 + 2 + 2 + 4 + 4) * block + 3 * scores, ring_temp


def test_trace_time_errors_name_the_argument():
    f = lambda fn, shape_q, shape_kv: jax.shard_map(fn, mesh=mesh(2), in_specs=P(None, "sp"),
                                                    out_specs=P(None, "sp"))(
        jnp.zeros(shape_q), jnp.zeros(shape_kv), jnp.zeros(shape_kv))
    with pytest.raises(ValueError, match="even local sequence length"):
        f(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=True), (1, 2 * 23, 2, 8), (1, 2 * 23, 2, 8))
    with pytest.raises(ValueError, match="layout="):
        f(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", layout="striped"), (1, 8, 2, 8), (1, 8, 2, 8))
    with pytest.raises(ValueError, match="must divide q heads"):
        f(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp"), (1, 8, 3, 8), (1, 8, 2, 8))
    with pytest.raises(ValueError, match="must divide the query heads"):
        f(lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp"), (1, 8, 3, 8), (1, 8, 3, 8))
    with pytest.raises(NameError, match="'tp' is not a mesh axis"):
        f(lambda a, b, c: pk_jax.ring_attention(a, b, c, "tp"), (1, 8, 2, 8), (1, 8, 2, 8))


def _fake_cudnn(monkeypatch) -> tuple[list[bool], list[bool]]:
    """The cuDNN route (the default, pk_jax/context/cudnn_block.py) on CPU: cuDNN's two calls replaced by XLA functions of the same contract (forward:
    out in q's dtype and statistics (B, N, Tq), top-left causal mask or none; backward: gradients from a given
    output and statistics). Returns the lists each traced forward / backward call appends its mask to."""
    from pk_jax.context import block_attention as blocks
    from pk_jax.context import cudnn_block

    masks: list[bool] = []
    bwd_masks: list[bool] = []

    def fwd(q, k, v, scale, top_left):
        masks.append(top_left)
        out, lse = blocks.block_attention(q, k, v, scale=scale, causal=top_left)  # offsets (0, 0): top-left
        return out.astype(q.dtype), jnp.swapaxes(lse, 1, 2)

    def bwd(q, k, v, out, stats, do, scale, top_left):
        bwd_masks.append(top_left)
        delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
        dq, dk, dv = blocks.block_attention_bwd(q, k, v, do, jnp.swapaxes(stats, 1, 2), delta, scale=scale,
                                                causal=top_left)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    monkeypatch.setenv(cudnn_block.LOCAL_VAR, "cudnn")
    monkeypatch.setattr(cudnn_block, "_on_gpu", lambda d: True)
    monkeypatch.setattr(cudnn_block, "_cudnn_fwd", fwd)
    monkeypatch.setattr(cudnn_block, "_cudnn_bwd", bwd)
    return masks, bwd_masks


# The pk transport on every case up to G 4, the xla transport (lax.scan, ppermute) on two of them (CI time).
@pytest.mark.parametrize("transport,g,layout,causal,n,kv_heads",
                         [("pk", *c) for c in RING_CASES if c[0] <= 4] + [("xla", *c) for c in RING_CASES[1:3]])
def test_ring_cudnn_route_matches_reference(monkeypatch, transport, g, layout, causal, n, kv_heads):
    """PK_JAX_RING_LOCAL=cudnn (cuDNN's calls stood in for by XLA functions of their contract): the pairs cuDNN can
    mask (none, or top-left causal on a diagonal pair) go to it, forward and backward with the whole row's output
    and LSE, the others stay on our kernel path; result and gradients equal the whole-sequence reference."""
    masks, bwd_masks = _fake_cudnn(monkeypatch)
    monkeypatch.setenv("PK_JAX_RING_TRANSPORT", transport)
    q, k, v, d_out = random_qkv(g * 11 + causal, 2, g * T_LOCAL, n, kv_heads, 16, jnp.bfloat16)
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
    assert_all_close(sharded(attn, g, layout, q, k, v, d_out), reference(q, k, v, d_out, causal), 3e-2)
    assert masks and bwd_masks, "no pair went to cuDNN"
    assert any(masks) == any(bwd_masks) == causal, f"a top-left mask where the ring is causal only: {masks}"


# Each local setting on two cases, each case once: both masks, layouts and sums (CI time: was 8 programs).
@pytest.mark.parametrize("g,layout,sums,local", [(4, "zigzag", "eager", "cudnn-split"), (2, "zigzag", "deferred", "cudnn"),
                                                (4, "contiguous", "eager", "cudnn"),
                                                (2, "contiguous", "deferred", "cudnn-split")])
def test_ring_cudnn_split_route(monkeypatch, g, layout, sums, local):
    """PK_JAX_RING_LOCAL=cudnn-split, or the default "cudnn" with pairs of SPLIT_MIN_ROWS query rows (cuDNN's calls
    stood in for): the "bottom_right" pairs too (zigzag's own q1 pair; contiguous causal's bottom half of the split
    diagonal, backward) run as two cuDNN calls (their visible keys, then their diagonal), so no pair is left on our
    kernel; result and gradients equal the reference."""
    from pk_jax.context import cudnn_block, row_sum

    masks, bwd_masks = _fake_cudnn(monkeypatch)
    monkeypatch.setenv(cudnn_block.LOCAL_VAR, local)
    monkeypatch.setattr(cudnn_block, "SPLIT_MIN_ROWS", T_LOCAL // 4)  # every bottom-right pair here has as many
    monkeypatch.setenv(row_sum.SUMS_VAR, sums)
    q, k, v, d_out = random_qkv(g * 17, 1, g * T_LOCAL, 4, 2, 64, jnp.bfloat16)  # head dim 64: our kernel would take it
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=True, layout=layout)
    f = jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    grads = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2)))(q, k, v))
    assert not re.findall(r"\bpk_attention(_bwd)?\w*\[", grads), "a pair left on our kernel"
    assert True in bwd_masks and False in bwd_masks
    assert_all_close(sharded(attn, g, layout, q, k, v, d_out), reference(q, k, v, d_out, True), 3e-2)


def test_ring_cudnn_splits_bottom_right_pairs_from_min_rows(monkeypatch):
    """takes(): the default "cudnn" runs a bottom-right pair on cuDNN (split) from SPLIT_MIN_ROWS query rows, counted
    by `rows` where q holds more than the pair; cudnn-split always, cudnn-whole and pk never; other masks unchanged."""
    from pk_jax.context import cudnn_block

    monkeypatch.setattr(cudnn_block, "_on_gpu", lambda d: True)
    n = cudnn_block.SPLIT_MIN_ROWS
    q = jax.ShapeDtypeStruct((1, n, 2, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2 * n, 2, 64), jnp.bfloat16)
    cases = {"cudnn": (True, False), "cudnn-split": (True, True), "cudnn-whole": (False, False), "pk": (False, False),
             "cudnn-fwd": (True, False)}
    for local, (at_min, below) in cases.items():
        monkeypatch.setenv(cudnn_block.LOCAL_VAR, local)
        assert cudnn_block.takes(q, k, True, "bottom_right") is at_min, local
        assert cudnn_block.takes(q, k, True, "bottom_right", rows=n - 1) is below, local
        assert cudnn_block.takes(q, k, True, "diagonal", rows=1) is (local != "pk"), local
        assert cudnn_block.takes(q, k, True, "shifted") is False, local
        # A backward pair: as the forward's, except that cudnn-fwd keeps every one on our kernel.
        assert cudnn_block.takes(q, k, False, "all", backward=True) is (local not in ("pk", "cudnn-fwd")), local


@pytest.mark.parametrize("g,layout,causal,merge", [(4, "zigzag", True, "dq-direct"), (2, "contiguous", False, "dq")])
def test_ring_cudnn_fwd_route(monkeypatch, g, layout, causal, merge):
    """PK_JAX_RING_LOCAL=cudnn-fwd (cuDNN's calls stood in for): the forward's pairs go to cuDNN as with "cudnn",
    no backward pair does (our kernel's path, here its XLA lowering), with either dQ merge; result and gradients
    equal the whole-sequence reference."""
    from pk_jax.context import block_accumulate, cudnn_block

    masks, bwd_masks = _fake_cudnn(monkeypatch)
    monkeypatch.setenv(cudnn_block.LOCAL_VAR, "cudnn-fwd")
    monkeypatch.setenv(block_accumulate.ACC_VAR, merge)
    q, k, v, d_out = random_qkv(g * 13 + causal, 2, g * T_LOCAL, 4, 2, 16, jnp.bfloat16)
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
    assert_all_close(sharded(attn, g, layout, q, k, v, d_out), reference(q, k, v, d_out, causal), 3e-2)
    assert masks, "no forward pair went to cuDNN"
    assert not bwd_masks, "a backward pair went to cuDNN"


@pytest.mark.parametrize("g,layout,causal", [(4, "zigzag", True), (4, "contiguous", False), (2, "contiguous", True)])
def test_ring_cudnn_route_with_deferred_sums(monkeypatch, g, layout, causal):
    """The cuDNN route (stand-ins) with PK_JAX_RING_SUMS=deferred: each pair's dQ (cuDNN's, in bf16) kept as a part
    and summed once; result and gradients equal the whole-sequence reference."""
    from pk_jax.context import row_sum

    masks, bwd_masks = _fake_cudnn(monkeypatch)
    monkeypatch.setenv(row_sum.SUMS_VAR, "deferred")
    q, k, v, d_out = random_qkv(g * 13 + causal, 2, g * T_LOCAL, 4, 2, 16, jnp.bfloat16)
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal, layout=layout)
    assert_all_close(sharded(attn, g, layout, q, k, v, d_out), reference(q, k, v, d_out, causal), 3e-2)
    assert bwd_masks, "no pair's backward went to cuDNN"


def test_ring_cudnn_route_pairs(monkeypatch):
    """Which zigzag causal pairs cuDNN takes at G 4 ("pk" transport), forward and backward: the own q0 pair
    (diagonal, top-left mask) and the three visiting blocks (no mask; both branches of each step's lax.cond); the
    own q1 pair (its mask shifted by a chunk) stays on our kernel. $PK_JAX_RING_LOCAL=pk: none."""
    from pk_jax.context import cudnn_block

    g = 4
    masks, bwd_masks = _fake_cudnn(monkeypatch)
    q, k, v, _ = random_qkv(3, 1, g * T_LOCAL, 4, 2, 64, jnp.bfloat16)  # head dim 64: our kernel takes the rest
    f = jax.shard_map(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=True), mesh=mesh(g),
                      in_specs=P(None, "sp"), out_specs=P(None, "sp"))
    jaxpr = str(jax.make_jaxpr(f)(q, k, v))
    assert sorted(masks) == [False] * 2 * (g - 1) + [True], masks  # visiting: low and high branches of lax.cond
    assert len(re.findall(r"\bpk_attention\[", jaxpr)) == 1, "the q1 pair on our kernel"
    masks.clear()
    grads = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2)))(q, k, v))
    assert sorted(bwd_masks) == [False] * 2 * (g - 1) + [True], bwd_masks
    assert len(re.findall(r"\bpk_attention_bwd\w*\[", grads)) == 1, "the q1 pair's backward on our kernel"
    masks.clear()
    bwd_masks.clear()
    monkeypatch.setenv(cudnn_block.LOCAL_VAR, "pk")
    jax.make_jaxpr(f)(q, k, v)
    assert masks == [] and bwd_masks == []


@pytest.mark.parametrize("visible,mask", [("diagonal", "CAUSAL"), ("all", "NO_MASK")])
def test_cudnn_block_lowers_to_cudnn_calls(monkeypatch, visible, mask):
    """cudnn_block's real calls, lowered for CUDA on this CPU machine (cuDNN's version and capability checks
    stubbed): one cuDNN forward and one backward, the backward fed q, k, v, the statistics, dO and the output
    (6 operands), both with the mask the pair needs."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    from pk_jax.context import cudnn_block

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
    q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)  # GQA, Tk != Tq

    def pair(q, k, v, do):
        out, lse = cudnn_block.forward(q, k, v, scale=0.125, causal=True, visible=visible)
        return cudnn_block.backward(q, k, v, out, do, lse, scale=0.125, causal=True, visible=visible)

    text = jax.jit(pair).trace(q, kv, kv, q).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @__cudnn$fmha" in ln]
    assert [re.search(r"@__cudnn\$(\w+)\(", ln)[1] for ln in calls] == ["fmhaSoftmax", "fmhaSoftmaxBackward"], calls
    assert len(re.search(r"Backward\(([^)]*)\)", calls[1])[1].split(",")) == 6
    assert all(f"mask_type\\22: \\22{mask}\\22" in ln for ln in calls)


def test_ring_cudnn_route_mixed_with_our_kernel(monkeypatch):
    """Head dim 64 (our kernel takes what cuDNN does not), contiguous causal at G 4 with the backward's in-kernel
    dQ add (PK_JAX_RING_MERGE=dq): each member's diagonal and visiting pairs on cuDNN (stand-ins), the split
    diagonal's bottom half on our kernel path, per pair as expected; result and gradients equal the reference."""
    g = 4
    masks, bwd_masks = _fake_cudnn(monkeypatch)
    monkeypatch.setenv("PK_JAX_RING_MERGE", "dq")
    q, k, v, d_out = random_qkv(77, 1, g * T_LOCAL, 4, 2, 64, jnp.bfloat16)
    attn = lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=True, layout="contiguous")
    assert_all_close(sharded(attn, g, "contiguous", q, k, v, d_out), reference(q, k, v, d_out, True), 3e-2)
    # forward: step 0 the diagonal (top-left), steps 1..3 the whole block (no mask); backward: step 0's top half
    # (top-left; the bottom half's mask is shifted: our kernel), steps 1..3 no mask
    assert sorted(masks) == [False] * (g - 1) + [True] and sorted(bwd_masks) == [False] * (g - 1) + [True], (
        masks, bwd_masks)
