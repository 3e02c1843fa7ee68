"""pk_jax.sdpa.dot_product_attention: cuDNN by default on a GPU backend, XLA where cuDNN refuses or off GPUs.

jax 0.11.2's own implementation=None is always XLA's unfused attention; these tests fake the GPU backend and
record which implementation each call asks jax for."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pk_jax import sdpa


def _qkv(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (2, 16, 4, 32), jnp.float32) for k in keys]


@pytest.fixture
def asked(monkeypatch):
    """The implementations jax.nn.dot_product_attention was called with; "cudnn" raises what jax raises for a
    call cuDNN does not take."""
    calls: list[str | None] = []
    real = jax.nn.dot_product_attention

    def fake(q, k, v, *, scale=None, is_causal=False, implementation=None):
        calls.append(implementation)
        if implementation == "cudnn":
            raise NotImplementedError("head dim 32 not supported\nmore")
        return real(q, k, v, scale=scale, is_causal=is_causal, implementation=implementation)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    return calls


def test_cpu_backend_runs_xla_unchanged(asked):
    q, k, v = _qkv()
    got = sdpa.dot_product_attention(q, k, v, is_causal=True)
    assert asked == [None]
    s = np.einsum("bqnh,bknh->bnqk", np.asarray(q), np.asarray(k)) / np.sqrt(32)
    s = np.where(np.tril(np.ones((16, 16), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bnqk,bknh->bqnh", p / p.sum(-1, keepdims=True), np.asarray(v))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5)


def test_gpu_backend_asks_cudnn_first_then_xla_with_a_warning(asked, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    sdpa._note_xla.cache_clear()
    q, k, v = _qkv(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = sdpa.dot_product_attention(q, k, v)
    assert asked == ["cudnn", None]
    assert out.shape == q.shape
    msgs = [str(w.message) for w in seen]
    assert any("cuDNN attention refused" in m and "head dim 32" in m and "more" not in m for m in msgs), msgs


def test_explicit_implementation_is_passed_through(asked, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q, k, v = _qkv(2)
    sdpa.dot_product_attention(q, k, v, implementation="xla")
    assert asked == ["xla"]
