"""moe_mlp's experts on the rows in use (pk_jax/moe/expert_ffn.py) on one GPU vs float32 NumPy: the two-product
grouped GEMM (pk_grouped_matmul_sum), SwiGLU forward / backward on the rows in use (pk_swiglu_rows), and the whole
FFN with its gradients. Fresh random inputs, NaN-poisoned outputs; rows past sum(counts) are NaN in every input
(never read into a result) and unspecified in the outputs, so only the rows in use are compared; the weight
gradients are compared whole. Bit-identical repeats; the kernels are what run (custom calls in the HLO)."""

from __future__ import annotations

import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_model  # tests/ is on sys.path

from .poison import poison_allocator
from .test_grouped_matmul_gpu import close, group_sizes, rand

MIN_GPUS = 1
_seed = itertools.count(7301)
ffn = importlib.import_module("pk_jax.moe.expert_ffn")
gm = importlib.import_module("pk_jax.moe.grouped_matmul")


def _nan_tail(a, used):
    return a.at[used:].set(jnp.nan) if used < a.shape[0] else a


SUM_CASES = [  # (m, k1, k2, n, E, kind): k off the 64-row k-block, n off the tile, a tail of unused rows
    (4096, 512, 512, 384, 8, "short"), (3000, 200, 72, 264, 13, "odd"), (2048, 128, 1408, 512, 64, "skewed"),
    (1024, 64, 64, 1096, 4, "empty"), (4096, 1408, 1408, 2048, 16, "uniform"),
]


@pytest.mark.parametrize("mode", [gm.FORWARD, gm.INPUT_GRAD], ids=["forward", "input_grad"])
@pytest.mark.parametrize("m,k1,k2,n,e,kind", SUM_CASES, ids=[f"{c[0]}x{c[1]}+{c[2]}x{c[3]}-E{c[4]}-{c[5]}"
                                                             for c in SUM_CASES])
def test_grouped_sum_matches_reference(mode, m, k1, k2, n, e, kind):
    rng = np.random.default_rng(next(_seed))
    gs = group_sizes(kind, m, e, rng)
    used = min(int(gs.sum()), m)
    wshape = (lambda k: (e, n, k)) if mode == gm.INPUT_GRAD else (lambda k: (e, k, n))
    a, a2 = _nan_tail(rand((m, k1), jnp.bfloat16), used), _nan_tail(rand((m, k2), jnp.bfloat16), used)
    b, b2 = rand(wshape(k1), jnp.bfloat16, 1 / np.sqrt(k1)), rand(wshape(k2), jnp.bfloat16, 1 / np.sqrt(k2))
    af, a2f, bf, b2f = (np.asarray(t, np.float32) for t in (a, a2, b, b2))
    if mode == gm.INPUT_GRAD:
        bf, b2f = bf.transpose(0, 2, 1), b2f.transpose(0, 2, 1)
    want = np.zeros((m, n), np.float32)
    for g, lo, hi in moe_model.group_segments(gs, m):
        want[lo:hi] = af[lo:hi] @ bf[g] + a2f[lo:hi] @ b2f[g]
    poison_allocator(4 * m * n * 4, jax.devices("gpu")[:1])
    f = jax.jit(lambda *t: ffn.grouped_sum_p.bind(*t, mode=mode, variant=ffn.NO_TAIL))
    got = f(a, b, a2, b2, jnp.asarray(gs))
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    close(f"sum mode {mode} ({kind})", np.asarray(got, np.float32)[:used], want[:used], 2e-2)
    again = f(a, b, a2, b2, jnp.asarray(gs))
    assert np.array_equal(np.asarray(got.view(jnp.uint16))[:used], np.asarray(again.view(jnp.uint16))[:used])
    assert "pk_grouped_matmul_sum" in f.lower(a, b, a2, b2, jnp.asarray(gs)).as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rows,cols,kind", [(4096, 1408, "short"), (1000, 72, "odd"), (513, 8, "empty")])
def test_swiglu_rows_forward_backward(rows, cols, kind, dtype):
    rng = np.random.default_rng(next(_seed))
    gs = group_sizes(kind, rows, 8, rng)
    used = min(int(gs.sum()), rows)
    gate, up, dh = (_nan_tail(rand((rows, cols), dtype, 3.0), used) for _ in range(3))
    g, u, d = (np.asarray(t, np.float32)[:used] for t in (gate, up, dh))
    s = 1 / (1 + np.exp(-g))
    poison_allocator(4 * rows * cols * 2 * 3, jax.devices("gpu")[:1])
    fwd = jax.jit(lambda *t: ffn.swiglu_p.bind(*t))
    bwd = jax.jit(lambda *t: ffn.swiglu_bwd_p.bind(*t))
    h = fwd(gate, up, jnp.asarray(gs))
    dg, du = bwd(gate, up, dh, jnp.asarray(gs))
    for name, got, want in (("hidden", h, g * s * u), ("d_gate", dg, d * u * s * (1 + g * (1 - s))),
                            ("d_up", du, d * g * s)):
        assert got.shape == (rows, cols) and got.dtype == dtype
        close(f"{name} ({kind}, {jnp.dtype(dtype).name})", np.asarray(got, np.float32)[:used], want, 1e-2)


FFN_CASES = [  # (R, H, F, L, kind)
    (4096, 512, 384, 8, "short"), (3000, 264, 1096, 13, "odd"), (2048, 256, 128, 64, "skewed"),
    (1024, 128, 256, 4, "empty"),
]


@pytest.mark.parametrize("r,h,f,e,kind", FFN_CASES, ids=[f"R{c[0]}-H{c[1]}-F{c[2]}-L{c[3]}-{c[4]}" for c in FFN_CASES])
def test_expert_ffn_matches_reference(r, h, f, e, kind):
    rng = np.random.default_rng(next(_seed))
    gs = group_sizes(kind, r, e, rng)
    used = min(int(gs.sum()), r)
    x, dy = _nan_tail(rand((r, h), jnp.bfloat16), used), _nan_tail(rand((r, h), jnp.bfloat16), used)
    wg, wu = rand((e, h, f), jnp.bfloat16, 1 / np.sqrt(h)), rand((e, h, f), jnp.bfloat16, 1 / np.sqrt(h))
    wd = rand((e, f, h), jnp.bfloat16, 1 / np.sqrt(f))
    want = moe_model.swiglu_experts_reference(*(np.asarray(t, np.float32) for t in (x, wg, wu, wd)), gs,
                                              np.asarray(dy, np.float32))

    def fwd_bwd(x, wg, wu, wd, gs, dy):
        y, vjp = jax.vjp(lambda *p: ffn.expert_ffn(p[0], gs, *p[1:]), x, wg, wu, wd)
        return (y, *vjp(dy))

    run = jax.jit(fwd_bwd)
    hlo = run.lower(x, wg, wu, wd, jnp.asarray(gs), dy).compile().as_text()
    for name in ("pk_swiglu_rows", "pk_swiglu_rows_bwd", "pk_grouped_matmul_sum"):
        assert name in hlo, f"{name} should run"
    poison_allocator(4 * r * max(h, f) * 2 * 8, jax.devices("gpu")[:1])
    got = run(x, wg, wu, wd, jnp.asarray(gs), dy)
    rows_in_use = (True, True, False, False, False)
    for name, g, ref, cut in zip(("y", "d_x", "d_w_gate", "d_w_up", "d_w_down"), got, want, rows_in_use):
        gf = np.asarray(g, np.float32)
        close(f"{name} ({kind})", gf[:used] if cut else gf, ref[:used] if cut else ref, 3e-2)
    again = run(x, wg, wu, wd, jnp.asarray(gs), dy)
    for g, a, cut in zip(got, again, rows_in_use):
        g, a = np.asarray(g.view(jnp.uint16)), np.asarray(a.view(jnp.uint16))
        assert np.array_equal(g[:used] if cut else g, a[:used] if cut else a), "repeats must be bit-identical"
