"""pk_jax.attention on CPU: semantics of both implementations (the kernel's primitive lowers to the
XLA path here) vs a float32 numpy reference incl. GQA/MQA, odd lengths, causal offsets (static and
traced), rows that see no key, the LSE, gradients (incl. through the LSE), vmap, argument errors.
The GPU kernel itself: tests/gpu/test_attention_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pk_jax
from pk_jax.attention import BWD_VAR
from tests.compile_ahead_probe import record_taken
from tests.gpu.attention_reference import attention_f32

# (B, Tq, N, Tk, K, D, causal, q_offset, kv_offset)
CASES = [
    (2, 64, 4, 64, 4, 64, False, 0, 0),
    (1, 100, 8, 77, 2, 128, True, 0, 0),     # GQA 4:1, odd lengths, Tq > Tk
    (1, 50, 4, 130, 1, 64, True, 80, 0),     # MQA, the queries sit after the keys start
    (2, 33, 2, 40, 2, 64, True, 0, 10),      # rows 0..9 see no key: out 0, lse -inf
    (1, 17, 2, 200, 1, 128, False, 5, 7),    # offsets ignored without causal
]


def rand(seed, shape, dtype):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def inputs(case, dtype, seed=0):
    b, tq, n, tk, kh, d = case[:6]
    return rand(seed, (b, tq, n, d), dtype), rand(seed + 1, (b, tk, kh, d), dtype), rand(seed + 2, (b, tk, kh, d), dtype)


def tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype != jnp.float32 else dict(atol=1e-5, rtol=1e-5)


# Every case on the kernel's primitive (bf16) and the fallback (f32); the other dtypes on one case each.
COMBOS = ([(c, "pk", jnp.bfloat16) for c in CASES] + [(c, "fallback", jnp.float32) for c in CASES]
          + [(CASES[1], "pk", jnp.float16), (CASES[3], "fallback", jnp.bfloat16)])


@pytest.mark.parametrize("case,implementation,dtype", COMBOS)
def test_matches_f32_reference(case, implementation, dtype):
    causal, qo, ko = case[6:]
    q, k, v = inputs(case, dtype)
    scale = 0.3
    f = jax.jit(lambda q, k, v: pk_jax.attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                                  q_offset=qo, kv_offset=ko, implementation=implementation))
    out, lse = f(q, k, v)
    want_out, want_lse = attention_f32(q, k, v, scale=scale, causal=causal, q_offset=qo, kv_offset=ko)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, **tol(dtype))
    np.testing.assert_allclose(np.asarray(lse), want_lse, **tol(dtype))  # -inf rows compare equal
    plain = pk_jax.attention(q, k, v, causal=causal, scale=scale, q_offset=qo, kv_offset=ko,
                             implementation=implementation)
    np.testing.assert_allclose(np.asarray(plain, np.float32), want_out, **tol(dtype))


def test_default_is_fallback_and_matches_dot_product_attention():
    q, k, v = inputs(CASES[1], jnp.float32)
    got = pk_jax.attention(q, k, v, causal=True)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_env_var_selects_and_is_checked(monkeypatch):
    q, k, v = inputs(CASES[0], jnp.bfloat16)
    monkeypatch.setenv("PK_JAX_ATTENTION", "pk")
    traced = jax.make_jaxpr(lambda q, k, v: pk_jax.attention(q, k, v))(q, k, v)
    assert "pk_attention" in str(traced)
    monkeypatch.setenv("PK_JAX_ATTENTION", "cudnn")
    with pytest.raises(ValueError, match="PK_JAX_ATTENTION"):
        pk_jax.attention(q, k, v)


def test_schedule_var_is_checked(monkeypatch):
    """$PK_JAX_ATTENTION_SCHEDULE picks the kernel's consumer schedule at lowering; a wrong value names
    the variable and the choices."""
    from pk_jax.attention import SCHEDULES, _schedule

    assert _schedule() == "in_turn"
    monkeypatch.setenv("PK_JAX_ATTENTION_SCHEDULE", "pipelined")
    assert _schedule() == "pipelined" and set(SCHEDULES) == {"in_turn", "pipelined"}
    monkeypatch.setenv("PK_JAX_ATTENTION_SCHEDULE", "fast")
    with pytest.raises(ValueError, match="PK_JAX_ATTENTION_SCHEDULE"):
        _schedule()


def test_fwd_variant_var_is_checked(monkeypatch):
    """$PK_JAX_ATTENTION_FWD_VARIANT picks the forward kernel variant at lowering (unset or empty:
    DEFAULT_FWD_VARIANT, fa3); a wrong value names the variable and the choices."""
    from pk_jax.attention import DEFAULT_FWD_VARIANT, FWD_VARIANT_VAR, FWD_VARIANTS, fwd_variant

    monkeypatch.delenv(FWD_VARIANT_VAR, raising=False)
    assert fwd_variant() == DEFAULT_FWD_VARIANT == "fa3n160" and FWD_VARIANTS[0] == "base"
    for name in FWD_VARIANTS:
        monkeypatch.setenv(FWD_VARIANT_VAR, name)
        assert fwd_variant() == name
    monkeypatch.setenv(FWD_VARIANT_VAR, "")
    assert fwd_variant() == DEFAULT_FWD_VARIANT
    monkeypatch.setenv(FWD_VARIANT_VAR, "fastest")
    with pytest.raises(ValueError, match=FWD_VARIANT_VAR):
        fwd_variant()


@pytest.mark.parametrize("tk,want", [(1024, "fa3"), (1000, "fa3"), (512, "fa3"), (128, "fa3"), (2048, "fa3n160"),
                                     (4096, "fa3n160"), (640, "fa3n160"), (160, "fa3n160"), (65536, "fa3n160")])
def test_default_fwd_variant_by_key_length(tk, want, monkeypatch):
    """Unset, the variant follows the key length: fa3 (128-key blocks) where 160-key blocks pad badly (1024: 8 blocks
    of 128 against 7 of 160, 60 % of the last one padding), fa3n160 elsewhere; at head_dim 64 without a causal mask
    fa3w3 at every length, and with one from FWD_W3_CAUSAL_MIN_KEYS keys; a set variable wins everywhere."""
    from pk_jax.attention import FWD_VARIANT_VAR, FWD_W3_CAUSAL_MIN_KEYS, default_fwd_variant, fwd_variant

    monkeypatch.delenv(FWD_VARIANT_VAR, raising=False)
    assert default_fwd_variant(tk) == fwd_variant(tk) == want
    assert default_fwd_variant(tk, 128, False) == want
    causal64 = "fa3w3" if tk >= FWD_W3_CAUSAL_MIN_KEYS else want
    assert default_fwd_variant(tk, 64, True) == fwd_variant(tk, 64, True) == causal64
    assert default_fwd_variant(tk, 64, False) == fwd_variant(tk, 64) == "fa3w3"  # D 64 without a causal mask
    monkeypatch.setenv(FWD_VARIANT_VAR, "fa3n176")
    assert fwd_variant(tk) == fwd_variant(tk, 64) == "fa3n176"


def test_lowering_takes_the_variant_of_its_key_length(monkeypatch):
    """The GPU lowering passes default_fwd_variant(Tk) as the kernel's variant attribute (a stand-in for
    jax.ffi.ffi_lowering records the attributes, so it runs without a GPU)."""
    import importlib

    attention = importlib.import_module("pk_jax.attention")  # the package re-exports the function of that name
    seen = []
    monkeypatch.setattr(attention.jax.ffi, "ffi_lowering", lambda name: lambda ctx, *a, **kw: seen.append(kw) or [])
    monkeypatch.delenv(attention.FWD_VARIANT_VAR, raising=False)

    class Ctx:  # what _cuda_lowering reads of the lowering context
        def __init__(self, tk, d):
            self.avals_in = [None, jax.core.ShapedArray((1, tk, 1, d), jnp.bfloat16)]

    for tk, d, causal, want in ((1024, 128, False, "fa3"), (4096, 128, False, "fa3n160"), (2048, 64, True, "fa3n160"),
                                (1024, 64, True, "fa3"), (4096, 64, True, "fa3w3"), (1024, 64, False, "fa3w3")):
        attention._cuda_lowering(Ctx(tk, d), None, None, None, None, scale=1.0, causal=causal, with_lse=True)
        assert int(seen[-1]["variant"]) == attention.FWD_VARIANTS.index(want)


def test_fwd_variants_bits_and_bench_selection():
    """fa3n160 / fa3n176 (160- / 176-key blocks) are variants whose bits may differ; the others must give base's bits. The
    bench times every variant for --fwd-variants, only the named ones for --fwd-variants NAME..., and its
    same-bits flag fails a row only for the variants that must match."""
    from pk_jax.attention import DEFAULT_FWD_VARIANT, FWD_VARIANTS, FWD_VARIANTS_SAME_BITS
    from pk_jax.bench.attention import bad_row, bits_expected, extra_kernels

    assert FWD_VARIANTS.index("fa3n160") == 4 and FWD_VARIANTS.index("fa3n176") == 5
    assert "fa3n160" not in FWD_VARIANTS_SAME_BITS and "fa3n176" not in FWD_VARIANTS_SAME_BITS
    assert set(FWD_VARIANTS_SAME_BITS) == {"base", "l2order", "pingpong", "fa3"}
    others = [v for v in FWD_VARIANTS if v != DEFAULT_FWD_VARIANT]
    assert extra_kernels(False, True) == extra_kernels(False, []) == others
    assert extra_kernels(False, False) == extra_kernels(False, None) == []
    assert extra_kernels(False, ["fa3n176", "fa3n160"]) == ["fa3n160", "fa3n176"]  # named: the default's too
    assert extra_kernels(True, False) == ["pipelined"] + others
    with pytest.raises(ValueError, match="unknown forward variants"):
        extra_kernels(False, ["fa4"])
    default_is_exact = DEFAULT_FWD_VARIANT in FWD_VARIANTS_SAME_BITS  # fa3n160 (the default) is not
    assert bits_expected("pipelined") == bits_expected("base") == default_is_exact
    assert not bits_expected("fa3n176") and not bits_expected("fa3n160")
    row = {"extra": {"check": "ok", "base_check": "ok", "base_same_bits": True, "base_bits_expected": True,
                     "fa3n160_check": "ok", "fa3n160_same_bits": False, "fa3n160_bits_expected": False}}
    assert not bad_row(row)
    row["extra"]["base_same_bits"] = False
    assert bad_row(row)
    row["extra"].update(base_same_bits=True, fa3n160_check="MISMATCH")
    assert bad_row(row)
    assert bad_row({"extra": {"check": "ok", "l2order_same_bits": False}})  # rows from before the flag


def test_bwd_variant_var_and_bench_selection(monkeypatch):
    """$PK_JAX_ATTENTION_BWD_VARIANT picks the backward kernel variant at lowering (unset or empty:
    DEFAULT_BWD_VARIANT, l2order_dqfirst);
    the bench's --bwd-variants names them bwd_<name> and expects the default's out / dK / dV bits."""
    from pk_jax.attention import BWD_VARIANT_VAR, BWD_VARIANTS, DEFAULT_BWD_VARIANT, bwd_variant
    from pk_jax.bench.attention import _label, bits_expected, bwd_extra_kernels

    monkeypatch.delenv(BWD_VARIANT_VAR, raising=False)
    assert bwd_variant() == DEFAULT_BWD_VARIANT == "l2order_dqfirst" and BWD_VARIANTS[0] == "base"
    for name in BWD_VARIANTS:
        monkeypatch.setenv(BWD_VARIANT_VAR, name)
        assert bwd_variant() == name
    monkeypatch.setenv(BWD_VARIANT_VAR, "fastest")
    with pytest.raises(ValueError, match=BWD_VARIANT_VAR):
        bwd_variant()
    assert bwd_extra_kernels(None) == bwd_extra_kernels(False) == []
    others = ["bwd_" + v for v in BWD_VARIANTS if v != DEFAULT_BWD_VARIANT]
    assert bwd_extra_kernels(True) == bwd_extra_kernels([]) == others == ["bwd_base", "bwd_dqfirst", "bwd_w3"]
    assert bwd_extra_kernels(["dqfirst"]) == ["bwd_dqfirst"]
    assert bwd_extra_kernels(["w3", DEFAULT_BWD_VARIANT]) == ["bwd_l2order_dqfirst", "bwd_w3"]  # named: the default too
    with pytest.raises(ValueError, match="unknown backward variants"):
        bwd_extra_kernels(["fa3"])
    assert bits_expected("bwd_dqfirst") and bits_expected("bwd_l2order_dqfirst")
    assert len({_label(n) for n in ["bwd_dqfirst", "bwd_l2order_dqfirst", "l2order", "fa3n160", "fa3n176"]}) == 5


def test_bwd_head_split_var(monkeypatch):
    """$PK_JAX_ATTENTION_BWD_HEAD_SPLIT: tasks per kv head's query heads, cut to a divisor of the group (gcd), so one
    setting serves GQA and plain rows alike; unset: BWD_HEAD_SPLIT_CAUSAL (2) under a causal mask or for w3, else 1;
    variants without the split (base, dqfirst): 1; not a positive integer: ValueError naming the variable."""
    from pk_jax.attention import BWD_HEAD_SPLIT_CAUSAL, BWD_HEAD_SPLIT_VAR, bwd_head_split

    monkeypatch.delenv(BWD_HEAD_SPLIT_VAR, raising=False)
    assert BWD_HEAD_SPLIT_CAUSAL == 2
    assert [bwd_head_split(16, 2, True), bwd_head_split(16, 2, False), bwd_head_split(16, 16, True)] == [2, 1, 1]
    assert bwd_head_split(12, 4, True) == 1 and bwd_head_split(16, 2, True, "w3") == 2  # group 3: no even split
    assert bwd_head_split(16, 2, True, "base") == bwd_head_split(16, 2, True, "dqfirst") == 1
    assert bwd_head_split(16, 2, False, "w3") == 2 and bwd_head_split(16, 16, False, "w3") == 1  # w3: any mask
    monkeypatch.setenv(BWD_HEAD_SPLIT_VAR, "8")
    assert [bwd_head_split(n, kv, True) for n, kv in [(16, 2), (16, 16), (8, 2), (12, 2)]] == [8, 1, 4, 2]
    monkeypatch.setenv(BWD_HEAD_SPLIT_VAR, "2")
    assert bwd_head_split(16, 2, False) == 2 and bwd_head_split(16, 16, False) == 1
    monkeypatch.setenv(BWD_HEAD_SPLIT_VAR, "1")
    assert bwd_head_split(16, 2, True) == 1
    for bad in ("0", "two"):
        monkeypatch.setenv(BWD_HEAD_SPLIT_VAR, bad)
        with pytest.raises(ValueError, match=BWD_HEAD_SPLIT_VAR):
            bwd_head_split(16, 2, True)


@pytest.mark.parametrize("tk,d,causal,want", [(4096, 64, True, "w3"), (16384, 64, False, "w3"), (4096, 64, False, None),
                                             (2048, 64, True, None), (16384, 128, True, None), (65536, 128, False, None)])
def test_default_bwd_variant_by_shape(tk, d, causal, want, monkeypatch):
    """Unset, the backward takes w3 at head_dim 64 where its 192-key blocks waste little (causal from Tk 4096, any mask
    from Tk 16384), DEFAULT_BWD_VARIANT elsewhere; a set variable wins everywhere."""
    from pk_jax.attention import BWD_VARIANT_VAR, DEFAULT_BWD_VARIANT, bwd_variant, default_bwd_variant

    monkeypatch.delenv(BWD_VARIANT_VAR, raising=False)
    assert default_bwd_variant(tk, d, causal) == bwd_variant(tk, d, causal) == (want or DEFAULT_BWD_VARIANT)
    monkeypatch.setenv(BWD_VARIANT_VAR, "base")
    assert bwd_variant(tk, d, causal) == "base"


def test_backward_call_takes_the_variant_of_its_shape(monkeypatch):
    """The backward's custom call passes default_bwd_variant(Tk, D, causal) as its variant attribute (a stand-in for
    jax.ffi.ffi_call records the attributes, so it runs without a GPU)."""
    import importlib

    attention = importlib.import_module("pk_jax.attention")
    seen = []

    def fake_ffi_call(name, shapes, **_):
        def call(*args, **attrs):
            seen.append(attrs)
            return [jnp.zeros(x.shape, x.dtype) for x in shapes]
        return call

    monkeypatch.setattr(attention.jax.ffi, "ffi_call", fake_ffi_call)
    monkeypatch.delenv(attention.BWD_VARIANT_VAR, raising=False)
    for tk, d, causal, want in ((4096, 64, True, "w3"), (4096, 64, False, "l2order_dqfirst"),
                                (4096, 128, True, "l2order_dqfirst")):
        q = jnp.zeros((1, 8, 1, d), jnp.bfloat16)
        k = jnp.zeros((1, tk, 1, d), jnp.bfloat16)
        lse = jnp.zeros((1, 1, 8), jnp.float32)
        attention._kernel_bwd_call(q, k, k, q, lse, lse, jnp.zeros((2,), jnp.int32), scale=1.0, causal=causal)
        assert int(seen[-1]["variant"]) == attention.BWD_VARIANTS.index(want)


@pytest.mark.parametrize("shape", [(4, 16, 16, 16384, 16384), (2, 8, 2, 1000, 77), (1, 3, 1, 64, 5000)])
def test_bwd_l2order_task_order_covers_every_block_once(shape):
    """kernels/attention_bwd_kernel.cuh work_of, variant l2order_dqfirst's order in Python: every (key block, batch, kv head)
    exactly once, key blocks fastest (the CTAs at work share a head)."""
    batch, heads, kv_heads, tq, tk = shape
    blocks = -(-tk // 128)
    order = []
    for task in range(blocks * kv_heads * batch):
        pair = task // blocks
        order.append((task - pair * blocks, pair // kv_heads, pair % kv_heads))
    assert sorted(order) == sorted((n, b, h) for n in range(blocks) for b in range(batch) for h in range(kv_heads))
    assert [n for n, _, _ in order[:blocks]] == list(range(blocks)) and len({(b, h) for _, b, h in order[:blocks]}) == 1


def _section_order(batch, heads, kv_heads, tq, tk, d, bm=128):
    """kernels/attention_kernel.cuh work_of (kSections) and attention.cu heads_per_section, in Python:
    task -> (q tile, batch, head)."""
    pairs = batch * heads
    per = min(max(1, (16 << 20) // (2 * tk * d * 2)) * (heads // kv_heads), pairs)
    tiles = -(-tq // bm)
    out = []
    for task in range(tiles * pairs):
        sec = task // (per * tiles)
        r = task - sec * per * tiles
        hs = min(per, pairs - sec * per)
        bh = sec * per + r % hs
        out.append((tiles - 1 - r // hs, bh // heads, bh % heads))
    return per, out


@pytest.mark.parametrize("shape", [(4, 16, 16, 16384, 16384, 128), (16, 16, 2, 4096, 4096, 128),
                                   (3, 5, 5, 1000, 77, 64), (1, 7, 1, 300, 100000, 128), (2, 3, 3, 1, 1, 64)])
def test_fwd_variant_task_order_covers_every_tile_once(shape):
    """The l2order/pingpong/fa3 task order visits every (query tile, batch, head) exactly once, heaviest
    query tiles first within a section, and sections hold whole GQA groups."""
    batch, heads, kv_heads, tq, tk, d = shape
    per, order = _section_order(*shape)
    tiles = -(-tq // 128)
    assert sorted(order) == sorted((t, b, h) for t in range(tiles) for b in range(batch) for h in range(heads))
    assert per >= 1 and (per % (heads // kv_heads) == 0 or per == batch * heads)
    for start in range(0, len(order), per * tiles):
        sec = order[start:start + per * tiles]
        assert [t for t, _, _ in sec] == sorted((t for t, _, _ in sec), reverse=True)


def test_traced_offsets_in_jit():
    case = CASES[2]
    q, k, v = inputs(case, jnp.bfloat16)
    f = jax.jit(lambda q, k, v, qo, ko: pk_jax.attention(q, k, v, causal=True, return_lse=True, q_offset=qo,
                                                          kv_offset=ko, implementation="pk"))
    for qo, ko in [(80, 0), (0, 64), (3, 3)]:
        out, lse = f(q, k, v, jnp.int32(qo), jnp.int32(ko))
        want_out, want_lse = attention_f32(q, k, v, scale=1 / 8, causal=True, q_offset=qo, kv_offset=ko)
        np.testing.assert_allclose(np.asarray(out, np.float32), want_out, **tol(jnp.bfloat16))
        np.testing.assert_allclose(np.asarray(lse), want_lse, **tol(jnp.bfloat16))


@pytest.mark.parametrize("implementation,dtype", [("pk", jnp.float16), ("fallback", jnp.float32)])
@pytest.mark.parametrize("case", [CASES[1], CASES[2]])
def test_gradients_incl_lse(case, implementation, dtype):
    causal, qo, ko = case[6:]
    q, k, v = inputs(case, dtype, seed=7)
    w_out = rand(11, q.shape, jnp.float32)
    w_lse = rand(12, (q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)
        return f

    ours = loss(lambda q, k, v: pk_jax.attention(q, k, v, causal=causal, return_lse=True, q_offset=qo,
                                                 kv_offset=ko, implementation=implementation))
    ref = loss(lambda q, k, v: attention_f32(q, k, v, scale=q.shape[-1] ** -0.5, causal=causal, q_offset=qo,
                                             kv_offset=ko, xp=jnp))
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(ref, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for g, w, x in zip(got, want, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=2e-2 * scale if dtype != jnp.float32
                                   else 1e-4 * scale, rtol=2e-2 if dtype != jnp.float32 else 1e-4)


def test_vmap_folds_into_batch():
    q, k, v = inputs(CASES[1], jnp.bfloat16)
    qs, ks, vs = (jnp.stack([x, x * 0.5]) for x in (q, k, v))
    out = jax.vmap(lambda q, k, v: pk_jax.attention(q, k, v, causal=True, implementation="pk"))(qs, ks, vs)
    for i in range(2):
        want, _ = attention_f32(qs[i], ks[i], vs[i], scale=128 ** -0.5, causal=True)
        np.testing.assert_allclose(np.asarray(out[i], np.float32), want, **tol(jnp.bfloat16))


@pytest.mark.parametrize("shapes,match", [
    (((1, 8, 2, 64), (1, 8, 2, 64), (1, 9, 2, 64)), "same shape"),
    (((1, 8, 3, 64), (1, 8, 2, 64), (1, 8, 2, 64)), "must divide"),
    (((1, 8, 2, 64), (1, 8, 2, 32), (1, 8, 2, 32)), "batch and head_dim"),
    (((8, 2, 64),) * 3, "4-D"),
])
def test_shape_errors(shapes, match):
    with pytest.raises(ValueError, match=match):
        pk_jax.attention(*(jnp.ones(s, jnp.bfloat16) for s in shapes))


def test_argument_errors():
    q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation"):
        pk_jax.attention(q, q, q, implementation="flash")
    with pytest.raises(ValueError, match="q_offset"):
        pk_jax.attention(q, q, q, causal=True, q_offset=1.5)
    with pytest.raises(ValueError, match="dtype"):
        pk_jax.attention(q, q.astype(jnp.float16), q)


def test_no_keys_and_other_head_dims_fall_back():
    q = rand(0, (1, 5, 2, 64), jnp.bfloat16)
    empty = jnp.zeros((1, 0, 2, 64), jnp.bfloat16)
    out, lse = pk_jax.attention(q, empty, empty, return_lse=True, implementation="pk")
    assert not np.any(np.asarray(out, np.float32)) and np.all(np.isneginf(np.asarray(lse)))
    q, k, v = (rand(i, (1, 9, 2, 32), jnp.bfloat16) for i in range(3))  # head_dim 32: not a kernel shape
    out = pk_jax.attention(q, k, v, causal=True, implementation="pk")
    want, _ = attention_f32(q, k, v, scale=32 ** -0.5, causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, **tol(jnp.bfloat16))


def _kernel_chunks(dq: np.ndarray) -> np.ndarray:
    """What the backward kernel's storer adds into dq_acc for dq (B, Tq_pad, N, D), written from the
    kernel's own indexing (attention_bwd_kernel.cuh): consumer thread t's accumulator register
    i = 4c + j holds row 16 (t // 32) + (t % 32) // 4 + 8 (j // 2), column 8c + 2 (t % 4) + j % 2 of its
    64 x 64 chunk, stored as float (c * 128 + t) * 4 + j; chunk `box` of block m sits at
    ((b N + h) Tq_pad + 64 m) D + 4096 box."""
    b, tp, n, d = dq.shape
    acc = np.zeros((b, n, tp * d), np.float32)
    t, c, j = np.meshgrid(np.arange(128), np.arange(8), np.arange(4), indexing="ij")
    rows = 16 * (t // 32) + (t % 32) // 4 + 8 * (j // 2)
    cols = 8 * c + 2 * (t % 4) + j % 2
    where = (c * 128 + t) * 4 + j
    by_head = dq.transpose(0, 2, 1, 3)  # (B, N, Tq_pad, D)
    for m in range(tp // 64):
        for box in range(d // 64):
            acc[:, :, m * 64 * d + box * 4096 + where] = by_head[:, :, 64 * m + rows, 64 * box + cols]
    return acc.reshape(b, n, tp, d)


@pytest.mark.parametrize("d", [64, 128])
def test_backward_kernel_dq_layout(d):
    """pk_jax.attention.dq_from_chunks inverts the backward kernel's dQ chunk order (and crops, scales)."""
    from pk_jax.attention import dq_from_chunks

    dq = np.asarray(rand(3, (2, 192, 3, d), jnp.float32))
    got = np.asarray(dq_from_chunks(jnp.asarray(_kernel_chunks(dq)), 150, 0.5))
    np.testing.assert_array_equal(got, dq[:, :150] * 0.5)


def test_backward_kernel_inputs():
    """lse2 = lse * log2(e), +inf where a row sees nothing and past Tq (P = 0 exactly); delta padded with 0."""
    from pk_jax.attention import LOG2E, kernel_bwd_inputs

    lse = jnp.asarray([[[1.0, -jnp.inf, 2.0]]], jnp.float32)
    lse2, delta = kernel_bwd_inputs(lse, jnp.ones_like(lse))
    assert lse2.shape == delta.shape == (1, 1, 64)
    np.testing.assert_allclose(np.asarray(lse2[0, 0, :3]), [LOG2E, np.inf, 2 * LOG2E], rtol=1e-6)
    assert np.all(np.isposinf(np.asarray(lse2[0, 0, 3:])))
    np.testing.assert_array_equal(np.asarray(delta[0, 0]), [1, 1, 1] + [0] * 61)


def test_kernel_path_backward_binds_its_primitive(monkeypatch):
    """By default the kernel forward's VJP binds pk_attention_bwd (its lowering off CUDA: XLA einsums),
    under vmap too; with PK_JAX_ATTENTION_BWD=xla it does not."""
    q, k, v = inputs(CASES[1], jnp.bfloat16)
    f = lambda q, k, v: jnp.sum(pk_jax.attention(q, k, v, causal=True, implementation="pk").astype(jnp.float32))
    monkeypatch.setenv(BWD_VAR, "xla")
    assert "pk_attention_bwd" not in str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v))
    monkeypatch.delenv(BWD_VAR)
    assert "pk_attention_bwd" in str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v))
    qs, ks, vs = (jnp.stack([x, x * 0.5]) for x in (q, k, v))
    got = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1, 2))))(qs, ks, vs)
    for i in range(2):
        want = jax.grad(f, argnums=(0, 1, 2))(qs[i], ks[i], vs[i])
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g[i], np.float32), np.asarray(w, np.float32), atol=2e-2, rtol=2e-2)


def test_bwd_primitive_dq_f32_keeps_dq_float32_under_vmap():
    """dq_f32 (ring attention's per-step blocks): dq comes back float32, equal to the input-dtype dq before its
    rounding, directly and folded through vmap; dk and dv keep the input dtype."""
    from pk_jax.attention import pk_attention_bwd_p

    b, t, n, d = 2, 48, 4, 64
    q, k, v, do = (rand(20 + i, (b, t, n, d), jnp.bfloat16) for i in range(4))
    lse = jax.random.normal(jax.random.key(30), (b, n, t), jnp.float32) + 4.0
    delta = jax.random.normal(jax.random.key(31), (b, n, t), jnp.float32)
    offsets = jnp.array([0, 0], jnp.int32)
    bind = lambda f32, *a: pk_attention_bwd_p.bind(*a, offsets, scale=0.125, causal=True, dq_f32=f32)
    dq32, dk32, dv32 = bind(True, q, k, v, do, lse, delta)
    dq16, dk16, dv16 = bind(False, q, k, v, do, lse, delta)
    assert dq32.dtype == jnp.float32 and dq16.dtype == jnp.bfloat16 and dk32.dtype == dv32.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dq32.astype(jnp.bfloat16)), np.asarray(dq16))
    np.testing.assert_array_equal(np.asarray(dk32), np.asarray(dk16))
    stacked = lambda x: jnp.stack([x, x])
    dq_v, _, _ = jax.vmap(lambda *a: bind(True, *a))(*(stacked(x) for x in (q, k, v, do, lse, delta)))
    assert dq_v.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(dq_v[1]), np.asarray(dq32), rtol=1e-6, atol=1e-6)


def test_bench_programs_compiled_ahead(monkeypatch):
    """The attention bench compiles every row's programs on 2 workers before timing (compile_ahead): the rows
    equal one-at-a-time compiles' (checks, errors against the baseline), and they take the programs compiled ahead."""
    from pk_jax.bench import attention as bench, compile_ahead

    run = lambda: bench.run(quick=True, reps=1, cases=["fwd", "fwd_bwd_causal"], seqs=[256])
    monkeypatch.setenv(compile_ahead.WORKERS_VAR, "1")
    serial = run()
    monkeypatch.setenv(compile_ahead.WORKERS_VAR, "2")
    taken = record_taken(monkeypatch)
    ahead = run()
    assert serial and [r["case"] for r in ahead] == [r["case"] for r in serial]
    for a, b in zip(ahead, serial):
        assert a["extra"]["check"] == b["extra"]["check"] == "ok"
        assert a["extra"]["rel_err_vs_baseline"] == b["extra"]["rel_err_vs_baseline"]
    assert sorted({key[-1] for key in taken}) == ["base", "default"]
