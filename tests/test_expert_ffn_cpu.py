"""pk_jax.moe.expert_ffn (moe_mlp's experts on the rows in use) on CPU, where every pass runs its reference path:
forward and gradients against the float32 NumPy model (tests/moe_model.py), the two-product grouped GEMM's and
SwiGLU's reference semantics, and moe_mlp with the FFN composed from grouped_matmul and jax.nn (the A/B switch)
against the default."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_model  # tests/ is on sys.path
from moe_checks import check_moe_mlp

ffn = importlib.import_module("pk_jax.moe.expert_ffn")
gm = importlib.import_module("pk_jax.moe.grouped_matmul")


def _inputs(seed, m, h, f, e):
    keys = jax.random.split(jax.random.key(seed), 5)
    x, dy = jax.random.normal(keys[0], (m, h)), jax.random.normal(keys[1], (m, h))
    wg, wu = (jax.random.normal(k, (e, h, f)) / np.sqrt(h) for k in keys[2:4])
    wd = jax.random.normal(keys[4], (e, f, h)) / np.sqrt(f)
    return x, wg, wu, wd, dy


@pytest.mark.parametrize("sizes", [[5, 0, 9, 3], [0, 0, 0, 0], [20, 1, 2, 3]], ids=["tail", "empty", "over"])
def test_expert_ffn_matches_float32_model(sizes):
    m, h, f = 17, 16, 24
    x, wg, wu, wd, dy = _inputs(len(sizes) + sum(sizes), m, h, f, len(sizes))
    gs = jnp.asarray(sizes, jnp.int32)
    y, vjp = jax.vjp(lambda *p: ffn.expert_ffn(p[0], gs, *p[1:]), x, wg, wu, wd)
    got = (y, *vjp(dy))
    want = moe_model.swiglu_experts_reference(*(np.asarray(t) for t in (x, wg, wu, wd)), np.asarray(sizes),
                                              np.asarray(dy))
    for name, g, w in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-5, err_msg=name)


def test_grouped_sum_reference_is_one_product_per_group():
    m, k1, k2, n, e = 12, 8, 16, 8, 3
    keys = jax.random.split(jax.random.key(3), 4)
    a, a2 = jax.random.normal(keys[0], (m, k1)), jax.random.normal(keys[1], (m, k2))
    b, b2 = jax.random.normal(keys[2], (e, n, k1)), jax.random.normal(keys[3], (e, n, k2))
    gs = jnp.asarray([4, 0, 5], jnp.int32)
    got = jax.jit(lambda *t: ffn.grouped_sum_p.bind(*t, mode=gm.INPUT_GRAD, variant=0))(a, b, a2, b2, gs)
    want = (moe_model.dense_grouped_matmul(np.asarray(a), np.asarray(b).transpose(0, 2, 1), np.asarray(gs))
            + moe_model.dense_grouped_matmul(np.asarray(a2), np.asarray(b2).transpose(0, 2, 1), np.asarray(gs)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_swiglu_reference_matches_jax_nn():
    keys = jax.random.split(jax.random.key(5), 3)
    g, u, d = (jax.random.normal(k, (6, 8)) * 3 for k in keys)
    gs = jnp.asarray([6], jnp.int32)
    h, vjp = jax.vjp(lambda a, b: jax.nn.silu(a) * b, g, u)
    np.testing.assert_allclose(np.asarray(ffn.swiglu_p.bind(g, u, gs)), np.asarray(h), rtol=1e-6, atol=1e-6)
    for got, want in zip(ffn.swiglu_bwd_p.bind(g, u, d, gs), vjp(d)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_mode_switch(monkeypatch):
    monkeypatch.setenv(ffn.MODE_ENV, "compose")
    assert ffn.composed()
    monkeypatch.setenv(ffn.MODE_ENV, "rows")
    assert not ffn.composed()
    monkeypatch.setenv(ffn.MODE_ENV, "fast")
    with pytest.raises(ValueError, match=ffn.MODE_ENV):
        ffn.composed()


def test_moe_mlp_composed_matches_reference(monkeypatch):
    """The A/B baseline (grouped_matmul + jax.nn) still meets the float32 reference (G 2, uniform)."""
    monkeypatch.setenv(ffn.MODE_ENV, "compose")
    check_moe_mlp(jax.devices(), 2, 8, 2, "uniform", jnp.float32, 1e-4, tokens=8, hidden=16, ffn=24, scale=4,
                  seed=11)
