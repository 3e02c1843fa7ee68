"""The attention backward kernel (pk_attention_bwd, kernels/attention_bwd_kernel.cuh) on one GPU:
jax.grad through pk_jax.attention(implementation="pk") vs the gradients of a float32 reference
(tests/gpu/attention_reference.py), NaN-poisoned outputs, bf16/f16, head_dim 64/128, causal and not,
GQA 8:1 and MQA, odd and unequal lengths, causal offsets (incl. rows that see no key and a key block
no row sees), a cotangent on the LSE; repeated calls (dK and dV bit-identical; dQ is summed by
float32 bulk reduce-adds in a run-dependent order, so only its closeness is asserted and whether its
bits repeated is printed). Each case checks that the lowered program holds both custom calls.
The backward variants ($PK_JAX_ATTENTION_BWD_VARIANT: dqfirst, l2order_dqfirst, read at lowering) run a
subset of the cases against the float32 reference and must give base's dK and dV bits; a first look at one
alone (the DEBUG build's waits time out instead of hanging):
  PK_JAX_ATTENTION_BWD_DEBUG=1 timeout 60 python -m pytest tests/gpu/test_attention_bwd_gpu.py -m gpu -q -x \
      -k "bwd_first_look and l2order_dqfirst"
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pk_jax
from pk_jax.attention import (BWD_HEAD_SPLIT_VAR, BWD_VAR, BWD_VARIANT_VAR, BWD_VARIANTS, DEFAULT_BWD_VARIANT,
                               backward_kernel_enabled)

from .attention_reference import attention_f32
from .poison import poison_allocator

MIN_GPUS = 1
pytestmark = pytest.mark.skipif(not backward_kernel_enabled(), reason=f"{BWD_VAR}=xla: the backward kernel is off")
_seed = itertools.count(4242)

# (B, Tq, N, Tk, K, D, causal, q_offset, kv_offset)
CASES = [
    (2, 256, 4, 256, 4, 64, False, 0, 0),
    (2, 256, 4, 256, 4, 128, False, 0, 0),
    (1, 1024, 8, 1024, 8, 128, True, 0, 0),      # skipped and diagonal block pairs
    (1, 1024, 8, 1024, 1, 64, True, 0, 0),       # MQA
    (2, 512, 16, 512, 2, 128, True, 0, 0),       # GQA 8:1
    (1, 77, 4, 1001, 2, 128, False, 0, 0),       # odd lengths, Tk >> Tq
    (1, 1000, 4, 129, 4, 64, True, 0, 0),        # odd lengths, Tq > Tk
    (3, 1, 2, 300, 2, 64, False, 0, 0),          # a single query
    (1, 300, 4, 1, 4, 128, True, 0, 0),          # a single key
    (1, 256, 4, 512, 4, 128, True, 512, 0),      # queries after the keys: nothing masked
    (1, 384, 4, 384, 2, 64, True, 0, 200),       # rows 0..199 see no key; the last key block partly unseen
    (1, 200, 2, 400, 2, 128, True, 0, 100),      # keys 100.. : key blocks 1, 2 and 3 partly / wholly unseen
    (2, 640, 4, 512, 4, 128, True, 100, 37),     # diagonal through unaligned blocks
    (1, 2048, 16, 2048, 2, 64, True, 0, 0),      # larger, GQA
    (2, 1024, 16, 2048, 16, 128, False, 0, 0),   # 512 tasks: every CTA switches key blocks (K and V reloaded)
    (2, 2048, 16, 2048, 8, 64, True, 0, 0),      # 256 causal tasks, claimed from the task counter, GQA
]


def rand(shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(next(_seed)), shape, jnp.float32).astype(dtype)


def _ids(case):
    b, tq, n, tk, kh, d, causal, qo, ko = case
    return f"B{b}-Tq{tq}-N{n}-Tk{tk}-K{kh}-D{d}-{'causal' if causal else 'full'}-off{qo}_{ko}"


def _loss(attn, w_out, w_lse):
    def f(q, k, v):
        out, lse = attn(q, k, v)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows that see nothing: lse = -inf, no gradient
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)
    return f


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_gradients_match_f32_reference(case, dtype):
    b, tq, n, tk, kh, d, causal, qo, ko = case
    q, k, v = rand((b, tq, n, d), dtype), rand((b, tk, kh, d), dtype), rand((b, tk, kh, d), dtype)
    w_out, w_lse = rand((b, tq, n, d)), rand((b, n, tq))
    scale = d ** -0.5
    ours = _loss(lambda q, k, v: pk_jax.attention(q, k, v, causal=causal, return_lse=True, q_offset=qo, kv_offset=ko,
                                                  implementation="pk"), w_out, w_lse)
    ref = _loss(lambda q, k, v: attention_f32(q, k, v, scale=scale, causal=causal, q_offset=qo, kv_offset=ko, xp=jnp),
                w_out, w_lse)
    f = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))
    text = f.lower(q, k, v).as_text()
    assert "pk_attention_bwd" in text and "pk_attention" in text, "the kernel path was not taken"
    poison_allocator(8 * (q.size + k.size) * 2)
    got = [np.asarray(x, np.float32) for x in f(q, k, v)]
    want = [np.asarray(x) for x in jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))]
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-2
    errs = []
    for name, g, w, x in zip("qkv", got, want, (q, k, v)):
        assert g.shape == x.shape
        assert not np.isnan(g).any(), f"NaN in d{name}: elements never written or 0 * inf"
        top = float(np.max(np.abs(w))) or 1.0
        err = float(np.linalg.norm(g - w) / (np.linalg.norm(w) or 1.0))
        errs.append(err)
        np.testing.assert_allclose(g, w, atol=tol * top, rtol=tol, err_msg=f"d{name} (rel norm err {err:.2e})")
        assert err < tol, f"d{name}: relative norm error {err:.2e}"
    # Repeats: dK and dV bit-identical; dQ close (its float32 reduce-adds land in any order).
    again = [np.asarray(x, np.float32) for x in f(q, k, v)]
    assert np.array_equal(again[1], got[1]) and np.array_equal(again[2], got[2]), "dk / dv differ on a repeat"
    np.testing.assert_allclose(again[0], got[0], atol=1e-2 * float(np.max(np.abs(want[0])) or 1.0), rtol=1e-2)
    same_dq = np.array_equal(again[0], got[0])
    print(f"PASS attention bwd {_ids(case)} {jnp.dtype(dtype).name}: rel err dq {errs[0]:.2e} dk {errs[1]:.2e} "
          f"dv {errs[2]:.2e}; dq bits {'repeat' if same_dq else 'DIFFER (reduce order)'}")


BWD_NEW_VARIANTS = [v for v in BWD_VARIANTS if v != DEFAULT_BWD_VARIANT]
# Full and causal, D 64 / 128, GQA, a partly unseen key block, unaligned offsets.
BWD_VARIANT_CASES = [CASES[0], CASES[1], CASES[2], CASES[4], CASES[11], CASES[12], CASES[13]]


def _grads(case, dtype, seed_inputs):
    b, tq, n, tk, kh, d, causal, qo, ko = case
    q, k, v, w_out, w_lse = seed_inputs
    ours = _loss(lambda q, k, v: pk_jax.attention(q, k, v, causal=causal, return_lse=True, q_offset=qo, kv_offset=ko,
                                                  implementation="pk"), w_out, w_lse)
    f = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))  # lowered below, under the variable the caller set
    assert "pk_attention_bwd" in f.lower(q, k, v).as_text(), "the kernel path was not taken"
    return [np.asarray(x, np.float32) for x in f(q, k, v)]


def _variant_inputs(case, dtype):
    b, tq, n, tk, kh, d, causal, qo, ko = case
    return (rand((b, tq, n, d), dtype), rand((b, tk, kh, d), dtype), rand((b, tk, kh, d), dtype),
            rand((b, tq, n, d)), rand((b, n, tq)))


@pytest.mark.parametrize("variant", BWD_NEW_VARIANTS)
def test_bwd_first_look(variant, monkeypatch):
    """The smallest case with one backward variant: the first thing to run of a new variant (under timeout 60)."""
    case = CASES[0]
    inputs = _variant_inputs(case, jnp.bfloat16)
    monkeypatch.setenv(BWD_VARIANT_VAR, variant)
    got = _grads(case, jnp.bfloat16, inputs)
    monkeypatch.setenv(BWD_VARIANT_VAR, DEFAULT_BWD_VARIANT)
    want = _grads(case, jnp.bfloat16, inputs)
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2]), "dk / dv differ from base"
    np.testing.assert_allclose(got[0], want[0], atol=1e-2 * float(np.max(np.abs(want[0])) or 1.0), rtol=1e-2)
    print(f"PASS attention bwd first look {variant}")


@pytest.mark.parametrize("variant", BWD_NEW_VARIANTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", BWD_VARIANT_CASES, ids=[_ids(c) for c in BWD_VARIANT_CASES])
def test_bwd_variant_matches_reference_and_base_bits(case, dtype, variant, monkeypatch):
    """A backward variant: gradients within the float32 reference's tolerance, dK and dV bit-identical to base
    (same operations per element, only the task order / issue order differ), dQ close to base's."""
    b, tq, n, tk, kh, d, causal, qo, ko = case
    inputs = _variant_inputs(case, dtype)
    q, k, v, w_out, w_lse = inputs
    monkeypatch.setenv(BWD_HEAD_SPLIT_VAR, "1")  # base and dqfirst have no head split: compare the orders alone
    monkeypatch.setenv(BWD_VARIANT_VAR, variant)
    poison_allocator(8 * (q.size + k.size) * 2)
    got = _grads(case, dtype, inputs)
    monkeypatch.setenv(BWD_VARIANT_VAR, DEFAULT_BWD_VARIANT)
    base = _grads(case, dtype, inputs)
    ref = _loss(lambda q, k, v: attention_f32(q, k, v, scale=d ** -0.5, causal=causal, q_offset=qo, kv_offset=ko,
                                              xp=jnp), w_out, w_lse)
    want = [np.asarray(x) for x in jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))]
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-2
    for name, g, w in zip("qkv", got, want):
        assert not np.isnan(g).any(), f"NaN in d{name}"
        err = float(np.linalg.norm(g - w) / (np.linalg.norm(w) or 1.0))
        assert err < tol, f"d{name}: relative norm error {err:.2e}"
    assert np.array_equal(got[1], base[1]) and np.array_equal(got[2], base[2]), "dk / dv differ from base"
    np.testing.assert_allclose(got[0], base[0], atol=1e-2 * float(np.max(np.abs(base[0])) or 1.0), rtol=1e-2)
    print(f"PASS attention bwd {variant} {_ids(case)} {jnp.dtype(dtype).name}: base's dk / dv bits")


# GQA / MQA: causal and not, D 64 / 128, odd lengths, offsets with unseen rows and keys, the task counter.
HEAD_SPLIT_CASES = [CASES[3], CASES[4], CASES[5], CASES[10], CASES[13], CASES[15]]


@pytest.mark.parametrize("variant", [DEFAULT_BWD_VARIANT, "w3"])
@pytest.mark.parametrize("split", [2, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", HEAD_SPLIT_CASES, ids=[_ids(c) for c in HEAD_SPLIT_CASES])
def test_bwd_head_split_matches_reference(case, dtype, split, variant, monkeypatch):
    """$PK_JAX_ATTENTION_BWD_HEAD_SPLIT: a kv head's query heads over `split` tasks (cut to a divisor of the group),
    dK / dV summed in float32 scratch: gradients within the float32 reference's tolerance, dK / dV close to the
    unsplit kernel's, and with two tasks per kv head (two adds onto zero commute) bit-identical on a repeat."""
    b, tq, n, tk, kh, d, causal, qo, ko = case
    inputs = _variant_inputs(case, dtype)
    q, k, v, w_out, w_lse = inputs
    monkeypatch.setenv(BWD_VARIANT_VAR, variant)
    monkeypatch.setenv(BWD_HEAD_SPLIT_VAR, "1")
    whole = _grads(case, dtype, inputs)
    monkeypatch.setenv(BWD_HEAD_SPLIT_VAR, str(split))
    poison_allocator(8 * (q.size + k.size) * 2)
    got = _grads(case, dtype, inputs)
    again = _grads(case, dtype, inputs)
    ref = _loss(lambda q, k, v: attention_f32(q, k, v, scale=d ** -0.5, causal=causal, q_offset=qo, kv_offset=ko,
                                              xp=jnp), w_out, w_lse)
    want = [np.asarray(x) for x in jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))]
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-2
    errs = []
    for name, g, w, u in zip("qkv", got, want, whole):
        assert not np.isnan(g).any(), f"NaN in d{name}: elements never written or 0 * inf"
        err = float(np.linalg.norm(g - w) / (np.linalg.norm(w) or 1.0))
        errs.append(err)
        assert err < tol, f"d{name}: relative norm error {err:.2e}"
        top = float(np.max(np.abs(u))) or 1.0
        np.testing.assert_allclose(g, u, atol=1e-2 * top, rtol=1e-2, err_msg=f"d{name} vs the unsplit kernel")
    tasks = np.gcd(split, n // kh)
    same = np.array_equal(again[1], got[1]) and np.array_equal(again[2], got[2])
    if tasks <= 2:
        assert same, "dk / dv differ on a repeat"
    print(f"PASS attention bwd head split {tasks} {variant} {_ids(case)} {jnp.dtype(dtype).name}: rel err "
          f"dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}; dk / dv bits {'repeat' if same else 'DIFFER (add order)'}")


def test_vmap_of_grad_folds_into_one_call():
    q, k, v = (rand((2, 1, 300, 4, 128), jnp.bfloat16) for _ in range(3))
    loss = lambda q, k, v: jnp.sum(pk_jax.attention(q, k, v, causal=True, implementation="pk").astype(jnp.float32))
    got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
    ref = lambda q, k, v: jnp.sum(attention_f32(q, k, v, scale=128 ** -0.5, causal=True, xp=jnp)[0])
    for i in range(2):
        want = jax.grad(ref, argnums=(0, 1, 2))(q[i].astype(jnp.float32), k[i].astype(jnp.float32),
                                                v[i].astype(jnp.float32))
        for g, w in zip(got, want):
            top = float(jnp.max(jnp.abs(w)))
            np.testing.assert_allclose(np.asarray(g[i], np.float32), np.asarray(w), atol=3e-2 * top, rtol=3e-2)
    print("PASS attention bwd under vmap")


DQ_CONVERT_CASES = [CASES[0], CASES[1], CASES[5], CASES[6], CASES[7], CASES[12]]  # D 64 / 128, odd and single rows


@pytest.mark.parametrize("dq_f32", [False, True], ids=["dq_input_dtype", "dq_f32"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", DQ_CONVERT_CASES, ids=[_ids(c) for c in DQ_CONVERT_CASES])
def test_dq_convert_kernel_gives_xla_conversion_bits(case, dtype, dq_f32):
    """The handler's dQ conversion kernel (kernels/attention_bwd_dq.cu) equals pk_jax.attention.dq_from_chunks
    (the XLA conversion) bit for bit on the same call's accumulator, in the input dtype and in float32 (ring
    attention's dq_f32), every row written (outputs NaN-poisoned first)."""
    import jax.ffi

    from pk_jax.attention import BWD_VARIANTS, bwd_variant, dq_from_chunks, kernel_bwd_inputs

    b, tq, n, tk, kh, d, causal, qo, ko = case
    q, dout = rand((b, tq, n, d), dtype), rand((b, tq, n, d), dtype)
    k, v = rand((b, tk, kh, d), dtype), rand((b, tk, kh, d), dtype)
    lse, delta = rand((b, n, tq)) + 3.0, rand((b, n, tq))
    scale = d ** -0.5
    dq_dtype = jnp.float32 if dq_f32 else dtype

    @jax.jit
    def call(q, k, v, dout, lse, delta):
        lse2, delta2 = kernel_bwd_inputs(lse, delta)
        out_types = (jax.ShapeDtypeStruct(q.shape, dq_dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                     jax.ShapeDtypeStruct(v.shape, v.dtype),
                     jax.ShapeDtypeStruct((b, n, lse2.shape[-1], d), jnp.float32))
        dq, _, _, acc = jax.ffi.ffi_call("pk_attention_bwd", out_types)(
            q, k, v, dout, lse2, delta2, jnp.array([qo, ko], jnp.int32), scale=np.float32(scale),
            causal=np.int32(causal), reserve_sms=np.int32(0), variant=np.int32(BWD_VARIANTS.index(bwd_variant())),
            convert_dq=np.int32(1))
        return dq, dq_from_chunks(acc, tq, scale).astype(dq_dtype)

    poison_allocator(8 * (q.size + k.size) * 4)
    got, want = (np.asarray(x, np.float32) for x in call(q, k, v, dout, lse, delta))
    assert got.shape == (b, tq, n, d)
    assert not np.isnan(got).any(), "dq rows the conversion kernel never wrote"
    assert np.array_equal(got, want), f"max |diff| {np.max(np.abs(got - want)):.3e}"
    print(f"PASS dq conversion kernel {_ids(case)} {jnp.dtype(dtype).name} -> {jnp.dtype(dq_dtype).name}: same bits")
