"""pk_jax.attention(implementation="pk") on one GPU vs a float32 numpy reference: fresh random
inputs, NaN-poisoned outputs, bf16/f16, head_dim 64/128, causal and not, GQA/MQA, odd and unequal
lengths, causal offsets (incl. rows that see no key), the LSE, bit-identical repeats, gradients; both
consumer schedules of the default kernel (in turn, pipelined) and every forward variant
($PK_JAX_ATTENTION_FWD_VARIANT: l2order, pingpong, fa3, fa3n160, fa3n176, read when the program is lowered,
so each test jits its own function with the variable set); l2order, pingpong and fa3 must also give the
default's bits exactly (fa3n160's / fa3n176's wider key blocks change the last bits: the float32 reference is
their check).
A first look at one variant alone (a hang then costs little; the DEBUG build makes barrier waits time out):
  PK_JAX_ATTENTION_FWD_DEBUG=1 timeout 60 python -m pytest tests/gpu/test_attention_gpu.py -m gpu -q -x \
      -k "first_look and pingpong"
Each case also checks that the lowered program holds the pk_attention custom call (no silent fallback)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pk_jax
from pk_jax.attention import FWD_VARIANTS_SAME_BITS

from .attention_reference import attention_f32
from .poison import poison_allocator

MIN_GPUS = 1
_seed = itertools.count(777)

# (B, Tq, N, Tk, K, D, causal, q_offset, kv_offset)
CASES = [
    (2, 256, 4, 256, 4, 64, False, 0, 0),
    (2, 256, 4, 256, 4, 128, False, 0, 0),
    (1, 1024, 8, 1024, 8, 128, True, 0, 0),      # several diagonal / skipped blocks
    (1, 1024, 8, 1024, 1, 64, True, 0, 0),       # MQA
    (2, 512, 16, 512, 2, 128, True, 0, 0),       # GQA 8:1
    (1, 77, 4, 1001, 2, 128, False, 0, 0),       # odd lengths, Tk >> Tq
    (1, 1000, 4, 129, 4, 64, True, 0, 0),        # odd lengths, Tq > Tk (rows past the keys see all)
    (3, 1, 2, 300, 2, 64, False, 0, 0),          # decode-like single query
    (1, 300, 4, 1, 4, 128, True, 0, 0),          # a single key
    (1, 256, 4, 512, 4, 128, True, 512, 0),      # queries after the keys: nothing masked
    (1, 384, 4, 384, 2, 64, True, 0, 200),       # rows 0..199 see no key: out 0, lse -inf
    (2, 640, 4, 512, 4, 128, True, 100, 37),     # diagonal through unaligned blocks
    (1, 4096, 16, 4096, 16, 128, True, 0, 0),    # a large causal case
    (2, 1024, 16, 1024, 8, 128, False, 0, 0),    # 256 tasks: every CTA switches tasks (Q reloaded), no mask
    (2, 1024, 16, 512, 4, 128, True, 0, 600),    # 256 tasks, half of them without a key (O = 0 after a carried task)
]


# The base kernel's two schedules, then the forward variants (pk_jax.attention.FWD_VARIANTS; the default follows the
# shape: default_fwd_variant).
KERNELS = ["in_turn", "pipelined", "l2order", "pingpong", "fa3", "fa3n160", "fa3n176", "fa3w3"]
NEW_VARIANTS = ["l2order", "pingpong", "fa3", "fa3n160", "fa3n176", "fa3w3"]
SAME_BITS_VARIANTS = [v for v in NEW_VARIANTS if v in FWD_VARIANTS_SAME_BITS]


def _select(monkeypatch, kernel):
    """Set the variables the next lowering reads: a schedule of the base kernel, or a variant."""
    if kernel in ("in_turn", "pipelined"):
        monkeypatch.setenv("PK_JAX_ATTENTION_SCHEDULE", kernel)
        monkeypatch.setenv("PK_JAX_ATTENTION_FWD_VARIANT", "base")
    else:
        monkeypatch.delenv("PK_JAX_ATTENTION_SCHEDULE", raising=False)
        monkeypatch.setenv("PK_JAX_ATTENTION_FWD_VARIANT", kernel)


def rand(shape, dtype):
    return jax.random.normal(jax.random.key(next(_seed)), shape, jnp.float32).astype(dtype)


@functools.cache
def _case_data(case, dtype):
    """Inputs and the float32 reference of one case, shared by the kernels' tests (the reference is slow)."""
    b, tq, n, tk, kh, d, causal, qo, ko = case
    q, k, v = rand((b, tq, n, d), dtype), rand((b, tk, kh, d), dtype), rand((b, tk, kh, d), dtype)
    want_out, want_lse = attention_f32(q, k, v, scale=d ** -0.5, causal=causal, q_offset=qo, kv_offset=ko)
    return q, k, v, want_out, want_lse


def _kernel_fn(case):
    b, tq, n, tk, kh, d, causal, qo, ko = case
    return jax.jit(lambda q, k, v: pk_jax.attention(q, k, v, causal=causal, return_lse=True, q_offset=qo,
                                                     kv_offset=ko, implementation="pk"))


def _ids(case):
    b, tq, n, tk, kh, d, causal, qo, ko = case
    return f"B{b}-Tq{tq}-N{n}-Tk{tk}-K{kh}-D{d}-{'causal' if causal else 'full'}-off{qo}_{ko}"


@pytest.mark.parametrize("kernel", NEW_VARIANTS)
def test_first_look(kernel, monkeypatch):
    """The smallest case with one variant: the first thing to run of a new variant (under `timeout 60`)."""
    _select(monkeypatch, kernel)
    case = CASES[0]
    q, k, v, want_out, want_lse = _case_data(case, jnp.bfloat16)
    out, lse = _kernel_fn(case)(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-3, rtol=1e-3)
    print(f"PASS attention first look {kernel}")


@pytest.mark.parametrize("schedule", KERNELS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_matches_f32_reference(case, dtype, schedule, monkeypatch):
    _select(monkeypatch, schedule)  # read when the program is lowered, below
    b, tq, n, tk, kh, d, causal, qo, ko = case
    q, k, v, want_out, want_lse = _case_data(case, dtype)
    f = _kernel_fn(case)
    assert "pk_attention" in f.lower(q, k, v).as_text(), "the kernel path was not taken"
    poison_allocator(4 * (q.size + b * n * tq) * 2)
    out, lse = f(q, k, v)
    out32, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert not np.isnan(out32).any(), "NaN in out: rows never written"
    assert not np.isnan(lse).any(), "NaN in lse: rows never written"
    atol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    err = np.max(np.abs(out32 - want_out))
    np.testing.assert_allclose(out32, want_out, atol=atol, rtol=2e-2, err_msg=f"out max abs err {err:.3e}")
    np.testing.assert_allclose(lse, want_lse, atol=2e-3, rtol=1e-3)
    # Bit-identical on a repeat (no atomics, fixed reduction order).
    out2, lse2 = f(q, k, v)
    assert np.array_equal(np.asarray(out2, np.float32), out32) and np.array_equal(np.asarray(lse2), lse)
    print(f"PASS attention {_ids(case)} {jnp.dtype(dtype).name} {schedule}: max abs err {err:.2e}")


@pytest.mark.parametrize("variant", SAME_BITS_VARIANTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_variants_give_the_default_bits(variant, dtype, monkeypatch):
    """Every variant computes each output element with the default's operations in the default's order
    (only the task order, the barriers and the GEMM issue order differ): identical out and lse."""
    for case in CASES:
        q, k, v, _, _ = _case_data(case, dtype)
        _select(monkeypatch, "in_turn")
        want_out, want_lse = _kernel_fn(case)(q, k, v)
        _select(monkeypatch, variant)
        out, lse = _kernel_fn(case)(q, k, v)
        assert np.array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32)), f"out {_ids(case)}"
        assert np.array_equal(np.asarray(lse), np.asarray(want_lse), equal_nan=True), f"lse {_ids(case)}"
    print(f"PASS attention {variant} {jnp.dtype(dtype).name}: the default's bits on every case")


def test_gradients_through_kernel_forward():
    q, k, v = rand((1, 512, 8, 128), jnp.bfloat16), rand((1, 640, 2, 128), jnp.bfloat16), rand((1, 640, 2, 128), jnp.bfloat16)
    w = rand(q.shape, jnp.float32)

    def ours(q, k, v):
        return jnp.sum(pk_jax.attention(q, k, v, causal=True, kv_offset=128, implementation="pk").astype(jnp.float32) * w)

    def ref(q, k, v):
        return jnp.sum(attention_f32(q, k, v, scale=128 ** -0.5, causal=True, kv_offset=128, xp=jnp)[0] * w)

    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, r in zip("qkv", got, want):
        scale = float(jnp.max(jnp.abs(r)))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r), atol=3e-2 * scale, rtol=3e-2,
                                   err_msg=f"d{name}")
    print("PASS attention gradients (kernel forward and backward)")


def test_vmap_and_traced_offsets():
    q, k, v = (rand((2, 1, 300, 4, 64), jnp.bfloat16) for _ in range(3))
    f = jax.jit(jax.vmap(lambda q, k, v, o: pk_jax.attention(q, k, v, causal=True, q_offset=o, implementation="pk"),
                         in_axes=(0, 0, 0, None)))
    for off in (0, 150):
        out = np.asarray(f(q, k, v, jnp.int32(off)), np.float32)
        for i in range(2):
            want, _ = attention_f32(q[i], k[i], v[i], scale=0.125, causal=True, q_offset=off)
            np.testing.assert_allclose(out[i], want, atol=2e-2, rtol=2e-2)
    print("PASS attention vmap + traced offsets")


# fa3n160 without a causal mask works on Tk's last 160-key block with wgmmas as wide as its keys rounded up to 32
# (kernels/attention.cu short_tail_keys): 32, 64, 96 and 128 keys exactly, masked (Tk 321: 1 key -> 32, Tk 1001:
# 41 -> 64), none (Tk 470: 150 keys), and the bench's Tk 4096 (96). 256 tasks, so every CTA carries a short P V
# from one task into the next.
SHORT_TAIL_TKS = [352, 384, 416, 448, 321, 1001, 470, 4096]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("tk", SHORT_TAIL_TKS)
def test_short_last_block_gives_the_full_blocks_bits(tk, dtype, monkeypatch):
    """The short last block drops only masked scores (exp2 -> 0) and zero products from the full-width one
    ($PK_JAX_ATTENTION_FWD_TAIL=0, read at every launch): identical out and lse, matching the float32 reference."""
    b, tq, n = 2, 1000, 16
    case = (b, tq, n, tk, 4, 128, False, 0, 0)
    q, k, v, want_out, want_lse = _case_data(case, dtype)
    _select(monkeypatch, "fa3n160")
    f = _kernel_fn(case)
    monkeypatch.setenv("PK_JAX_ATTENTION_FWD_TAIL", "0")
    full_out, full_lse = f(q, k, v)
    monkeypatch.delenv("PK_JAX_ATTENTION_FWD_TAIL")
    poison_allocator(4 * (q.size + b * n * tq) * 2)
    out, lse = f(q, k, v)
    out32, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert not np.isnan(out32).any() and not np.isnan(lse).any(), "rows never written"
    atol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    np.testing.assert_allclose(out32, want_out, atol=atol, rtol=2e-2)
    np.testing.assert_allclose(lse, want_lse, atol=2e-3, rtol=1e-3)
    assert np.array_equal(out32, np.asarray(full_out, np.float32)), "out differs from the full-width last block's"
    assert np.array_equal(lse, np.asarray(full_lse)), "lse differs from the full-width last block's"
    print(f"PASS attention short last block Tk {tk} {jnp.dtype(dtype).name}")
