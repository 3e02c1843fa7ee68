"""pk_jax.grouped_matmul on one GPU (the pk_grouped_matmul kernel: forward, dx and the ragged-K dw) vs a
float32 NumPy reference: fresh random inputs, NaN-poisoned outputs; uniform, skewed (a few hot experts),
empty experts, sum(group_sizes) < m and > m, groups shorter than a tile, odd sizes, 1..256 experts,
bf16 and f16, k and n off the tile grid; rows past the sum NaN in x and dy (never read into a result);
bit-identical repeats; the kernel is what runs (the custom call is in the HLO). Every test runs under
each schedule variant (PK_JAX_GROUPED_VARIANT: default, then pk_jax.moe.grouped_matmul.VARIANTS), or only
under the one set in the environment when pytest starts (e.g. PK_JAX_GROUPED_VARIANT=dyn)."""

from __future__ import annotations

import importlib
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pk_jax

from .poison import poison_allocator

MIN_GPUS = 1
_seed = itertools.count(9001)
gm = importlib.import_module("pk_jax.moe.grouped_matmul")
_only = os.environ.get(gm.VARIANT_ENV)
VARIANTS = [_only] if _only is not None else ["default", *gm.VARIANTS]


@pytest.fixture(params=VARIANTS, autouse=True)
def variant(request, monkeypatch):
    """The schedule variant of the test (read when `run` traces: one jitted function per variant)."""
    gm.variant_bits(request.param)  # a bad name fails here, not in a trace
    monkeypatch.setenv(gm.VARIANT_ENV, request.param)
    return request.param


def group_sizes(kind: str, m: int, e: int, rng) -> np.ndarray:
    """E sizes of the given kind; they sum to m except 'short' (m - 37, at least 0), 'tiny' and 'over'."""
    if kind == "uniform":
        sizes = np.full(e, m // e)
        sizes[: m - sizes.sum()] += 1
    elif kind == "skewed":  # a few hot experts hold ~80% of the rows
        hot = rng.choice(e, size=min(3, e), replace=False)
        weights = np.full(e, 0.2 / e)
        weights[hot] += 0.8 / len(hot)
        sizes = rng.multinomial(m, weights / weights.sum())
    elif kind == "empty":  # half the experts empty (the first one too)
        sizes = np.zeros(e, np.int64)
        full = rng.choice(e, size=max(1, e // 2), replace=False)
        full = full[full != 0] if len(full) > 1 else full
        sizes[full] = rng.multinomial(m, np.ones(len(full)) / len(full))
    elif kind == "short":
        total = max(0, m - 37)
        sizes = np.diff(np.concatenate([[0], np.sort(rng.integers(0, total + 1, e - 1)), [total]]))
    elif kind == "tiny":  # every group shorter than a tile (1..40 rows); the rest of m unused
        sizes = rng.integers(1, 41, e)
        sizes = np.minimum(sizes, np.maximum(0, m - np.concatenate([[0], np.cumsum(sizes)[:-1]])))
    elif kind == "odd":
        sizes = 2 * rng.integers(0, max(1, m // e), e) + 1
        while sizes.sum() > m:
            sizes = np.maximum(1, sizes // 2) | 1
    elif kind == "over":  # the sum passes m: cut at m (the last groups lose rows)
        sizes = np.full(e, m // e + 3)
    else:
        raise ValueError(kind)
    return sizes.astype(np.int32)


def reference(x, w, gs, dy):
    """float32 forward, dx and dw of ragged_dot (rows past the sum: zero output, zero dx)."""
    m, n, e = x.shape[0], w.shape[2], w.shape[0]
    out, dx, dw = np.zeros((m, n), np.float32), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g in range(e):
        end = min(start + int(gs[g]), m)
        out[start:end] = x[start:end] @ w[g]
        dx[start:end] = dy[start:end] @ w[g].T
        dw[g] = x[start:end].T @ dy[start:end]
        start = end
    return out, dx, dw, start


def rand(shape, dtype, scale=1.0):
    return (jax.random.normal(jax.random.key(next(_seed)), shape, jnp.float32) * scale).astype(dtype)


def _forward_and_vjp(x, w, gs, dy):
    out, vjp = jax.vjp(lambda a, b: pk_jax.grouped_matmul(a, b, gs), x, w)
    return (out, *vjp(dy))


_jitted = {}


def runner():
    """The jitted forward + VJP for the current PK_JAX_GROUPED_VARIANT (traced under it)."""
    spec = os.environ.get(gm.VARIANT_ENV, "")
    if spec not in _jitted:
        _jitted[spec] = jax.jit(lambda *a: _forward_and_vjp(*a))
    return _jitted[spec]


def run(*args):
    return runner()(*args)


def close(name, got, want, tol):
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all(), f"{name}: unwritten (NaN-poisoned), non-finite or unmasked elements"
    scale = np.abs(want).max() + 1e-6
    err = np.abs(got - want).max() / scale
    assert err < tol, f"{name}: max error {err:.2e} of the largest magnitude"
    if np.linalg.norm(want) > 0:
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol / 2, f"{name}: norm error"


def check(m, k, n, e, kind, dtype=jnp.bfloat16, nan_tail=True):
    rng = np.random.default_rng(next(_seed))
    gs = group_sizes(kind, m, e, rng)
    x, w, dy = rand((m, k), dtype), rand((e, k, n), dtype, 1 / np.sqrt(k)), rand((m, n), dtype)
    used = min(int(gs.sum()), m)
    if nan_tail and used < m:  # rows past the sum: never part of a result
        x, dy = x.at[used:].set(jnp.nan), dy.at[used:].set(jnp.nan)
    xf, wf, dyf = (np.asarray(a, np.float32) for a in (x, w, dy))
    want = reference(xf, wf, gs, dyf)
    poison_allocator(4 * (2 * m * max(n, k) + e * k * n) * 2, jax.devices("gpu")[:1])
    got = run(x, w, jnp.asarray(gs), dy)
    for name, g, ref, shape in zip(("out", "dx", "dw"), got, want, ((m, n), (m, k), (e, k, n))):
        assert g.shape == shape and g.dtype == dtype, f"{name}: {g.shape} {g.dtype}"
        close(f"{name} ({kind}, m={m} k={k} n={n} E={e}, {jnp.dtype(dtype).name})", g, ref, 2e-2)
    out, dx, dw = (np.asarray(a, np.float32) for a in got)
    assert not out[used:].any() and not dx[used:].any(), "rows past sum(group_sizes) must be zero"
    empty = np.flatnonzero(np.diff(np.minimum(np.concatenate([[0], np.cumsum(gs)]), m)) == 0)
    assert not dw[empty].any(), "experts without rows must get dw = 0"
    return x, w, gs, dy


CASES = [  # (m, k, n, E, kind)
    # first: the bench's losing shape in small (E 64, n 1408 = 5.5 x 256: every variant's paths, dw included)
    (4096, 512, 1408, 64, "uniform"),
    (4096, 512, 384, 8, "uniform"), (4096, 512, 384, 8, "skewed"), (4096, 512, 384, 16, "empty"),
    (4096, 512, 384, 8, "short"), (3000, 256, 256, 64, "tiny"), (4099, 264, 200, 13, "odd"),
    (1000, 128, 136, 4, "over"), (2048, 1024, 512, 1, "uniform"), (2048, 64, 128, 1, "short"),
    (2048, 256, 128, 256, "uniform"), (8192, 256, 256, 256, "skewed"), (1024, 128, 64, 256, "tiny"),
    (4096, 1408, 1024, 64, "skewed"), (2048, 200, 72, 7, "odd"), (16, 64, 64, 3, "short"),
    (3000, 264, 1096, 13, "odd"),  # n tail 72 (variant narrow: m64n128 wgmmas; n128: 9 x 128)
]


def case_id(case) -> str:
    m, k, n, e, kind = case
    return f"{m}x{k}x{n}-E{e}-{kind}"


@pytest.mark.parametrize("m,k,n,e,kind", CASES, ids=[case_id(c) for c in CASES])
def test_bf16(m, k, n, e, kind):
    check(m, k, n, e, kind)


F16_CASES = [(4096, 512, 384, 8, "skewed"), (3000, 256, 256, 64, "tiny"), (2048, 200, 72, 7, "odd")]


@pytest.mark.parametrize("m,k,n,e,kind", F16_CASES, ids=[case_id(c) for c in F16_CASES])
def test_f16(m, k, n, e, kind):
    check(m, k, n, e, kind, dtype=jnp.float16)


def test_all_rows_in_one_expert_and_none_used():
    check(2048, 256, 256, 32, "skewed")
    x, w, dy = rand((512, 128), jnp.bfloat16), rand((4, 128, 128), jnp.bfloat16), rand((512, 128), jnp.bfloat16)
    out, dx, dw = run(x, w, jnp.zeros(4, jnp.int32), dy)
    assert not np.asarray(out, np.float32).any() and not np.asarray(dx, np.float32).any()
    assert not np.asarray(dw, np.float32).any()
    gs = jnp.asarray([0, 512, 0, 0], jnp.int32)
    out = np.asarray(run(x, w, gs, dy)[0], np.float32)
    close("one expert", out, np.asarray(x, np.float32) @ np.asarray(w[1], np.float32), 2e-2)


def test_kernel_runs_and_repeats_bit_identical():
    rng = np.random.default_rng(7)
    m, k, n, e = 4096, 1024, 512, 16
    gs = jnp.asarray(group_sizes("skewed", m - 100, e, rng))
    x, w, dy = rand((m, k), jnp.bfloat16), rand((e, k, n), jnp.bfloat16, 1 / 32), rand((m, n), jnp.bfloat16)

    hlo = runner().lower(x, w, gs, dy).as_text()
    assert hlo.count("pk_grouped_matmul") >= 3, "forward, dx and dw should each be a pk_grouped_matmul call"
    first = [np.asarray(a.view(jnp.uint16)) for a in run(x, w, gs, dy)]
    for _ in range(3):
        again = [np.asarray(a.view(jnp.uint16)) for a in run(x, w, gs, dy)]
        assert all(np.array_equal(a, b) for a, b in zip(first, again))


def test_unsupported_falls_back_with_same_semantics():
    rng = np.random.default_rng(3)
    gs = group_sizes("short", 100, 4, rng)
    x, w = rand((100, 12), jnp.bfloat16), rand((4, 12, 16), jnp.bfloat16)  # k = 12: not a multiple of 8
    gm._note_fallback.cache_clear()  # it warns once per reason: every variant's instance of this test expects it
    with pytest.warns(UserWarning, match="multiples of 8"):
        out = pk_jax.grouped_matmul(x, w, jnp.asarray(gs))
    want = reference(np.asarray(x, np.float32), np.asarray(w, np.float32), gs, np.zeros((100, 16), np.float32))[0]
    close("fallback", out, want, 2e-2)
