"""The attention kernels writing into ring attention's float32 states in place, on one GPU.
Forward (pk_attention_accumulate, kernels/attention_kernel.cuh accumulate_rows): a block written (mode 1) into
rows of a float32 state, then a second key range merged into them (mode 2), against the float32 reference of
attention over both key ranges; rows outside the window keep their poison; rows that see no key (causal offsets)
get LSE -inf and O 0 in both modes; bf16 / f16, head_dim 64 / 128, GQA, odd lengths; two runs give the same bits.
Backward (pk_attention_bwd_accumulate: the dQ conversion adding into the state): dQ rows, dK, dV against the
XLA composition; rows outside the window keep their bits. First look (a broken epilogue should fail, not hang:
the kernel's waits are those of the forward):
    timeout 60 python -m pytest tests/gpu/test_attention_accumulate_gpu.py -m gpu -q -x -k first_look
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pk_jax.attention import DEFAULT_FWD_VARIANT, FWD_VARIANT_VAR, FWD_VARIANTS
from pk_jax.context.block_accumulate import accumulate

from .attention_reference import attention_f32

MIN_GPUS = 1
_seed = itertools.count(777)
POISON = 12345.0

# (B, Tq, N, Tk per half, K, D, causal, q_offset, kv_offset of the first half, rows before the window, state rows)
CASES = [
    (1, 128, 2, 128, 2, 64, False, 0, 0, 0, 128),              # first look: one tile, the whole state
    (2, 256, 4, 256, 4, 128, False, 0, 0, 64, 384),
    (1, 200, 8, 300, 1, 128, False, 0, 0, 17, 300),            # odd lengths, MQA, a window not tile-aligned
    (2, 384, 16, 384, 2, 64, True, 384, 0, 0, 768),            # causal: the second half crosses the diagonal
    (1, 256, 4, 256, 4, 128, True, 0, 200, 128, 512),          # rows 0..199 see no key of the first half
]


def rand(shape, dtype):
    return jax.random.normal(jax.random.key(next(_seed)), shape, jnp.float32).astype(dtype)


def _ids(c):
    return "B{}-Tq{}-N{}-Tk{}-K{}-D{}-{}-off{}_{}-at{}-of{}".format(*c[:6], "causal" if c[6] else "full", *c[7:])


@pytest.mark.parametrize("variant", [DEFAULT_FWD_VARIANT] + [v for v in FWD_VARIANTS if v != DEFAULT_FWD_VARIANT])
def test_first_look(variant, monkeypatch):
    """Every forward variant (read at lowering): the storer idles in accumulate mode whatever its barrier
    protocol; the default variant first."""
    monkeypatch.setenv(FWD_VARIANT_VAR, variant)
    check(CASES[0], jnp.bfloat16)
    check(CASES[4], jnp.bfloat16)  # causal, rows that see no key, a window inside the state


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_write_then_merge_matches_f32_reference(case, dtype):
    check(case, dtype)


def check(case, dtype):
    b, tq, n, tk, kh, d, causal, qo, ko, start, rows = case
    q = rand((b, tq, n, d), dtype)
    k, v = rand((b, 2 * tk, kh, d), dtype), rand((b, 2 * tk, kh, d), dtype)
    scale = d ** -0.5
    acc = jnp.full((b, rows, n, d), POISON, jnp.float32)
    lse = jnp.full((b, n, rows), POISON, jnp.float32)
    off = lambda first: jnp.asarray([qo, ko if first else ko + tk], jnp.int32)

    @jax.jit
    def run(q, k, v, acc, lse):
        acc, lse = accumulate(q, k[:, :tk], v[:, :tk], off(True), acc, lse, row_start=start, merge=False,
                              scale=scale, causal=causal)
        written = (acc, lse)
        return written, accumulate(q, k[:, tk:], v[:, tk:], off(False), acc, lse, row_start=start, merge=True,
                                   scale=scale, causal=causal)

    hlo = run.lower(q, k, v, acc, lse).compile().as_text()
    assert "pk_attention_accumulate" in hlo, "the kernel, not the XLA lowering"
    (w_acc, w_lse), (m_acc, m_lse) = run(q, k, v, acc, lse)
    o1, l1 = attention_f32(q, k[:, :tk], v[:, :tk], scale=scale, causal=causal, q_offset=qo, kv_offset=ko)
    o2, l2 = attention_f32(q, k, v, scale=scale, causal=causal, q_offset=qo, kv_offset=ko)
    win = slice(start, start + tq)
    for name, got, want, got_lse, want_lse in (("write", w_acc, o1, w_lse, l1), ("merge", m_acc, o2, m_lse, l2)):
        got, got_lse = np.asarray(got), np.asarray(got_lse)
        assert (got[:, :start] == POISON).all() and (got[:, start + tq:] == POISON).all(), f"{name}: rows outside"
        assert (got_lse[:, :, :start] == POISON).all() and (got_lse[:, :, start + tq:] == POISON).all()
        o, lz = got[:, win], got_lse[:, :, win]
        seen = np.isfinite(want_lse)
        np.testing.assert_array_equal(np.isfinite(lz), seen, err_msg=f"{name}: rows that see no key")
        assert (o.transpose(0, 2, 1, 3)[~seen] == 0).all(), f"{name}: O of rows that see no key"
        np.testing.assert_allclose(lz[seen], want_lse[seen], atol=2e-3, rtol=1e-3, err_msg=f"{name}: lse")
        err = np.abs(o - want).max() / max(np.abs(want).max(), 1e-30)
        assert err < 2e-2, f"{name}: max error {err:.2e} relative to max |ref|"
    again = run(q, k, v, acc, lse)[1]
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(m_acc), err_msg="same bits on a second run")


@pytest.mark.parametrize("in_place", [False, True], ids=["convert", "in_place"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_backward_adds_dq_into_rows(case, dtype, in_place):
    """accumulate_bwd (pk_attention_bwd_accumulate): dK, dV of the pair and its dQ added into rows of a float32
    state holding random values, against the XLA composition (block_accumulate.reference_bwd) on the same
    inputs; rows outside the window keep their bits. in_place ($PK_JAX_RING_MERGE=dq-direct): q and dO are arrays
    of the state's rows, read in place (the rows past the window that the last query block reads are other rows'
    data: they must add exact zeros), and the kernel adds dQ into the state by TMA tensor reduce."""
    from pk_jax.context.block_accumulate import accumulate_bwd, reference_bwd

    b, tq, n, tk, kh, d, causal, qo, ko, start, rows = case
    q_rows, do_rows = rand((b, rows, n, d), dtype), rand((b, rows, n, d), dtype)
    q, do = q_rows[:, start:start + tq], do_rows[:, start:start + tq]
    k, v = rand((b, tk, kh, d), dtype), rand((b, tk, kh, d), dtype)
    scale = d ** -0.5
    off = jnp.asarray([qo, ko], jnp.int32)
    out, lse = attention_f32(q, k, v, scale=scale, causal=causal, q_offset=qo, kv_offset=ko)
    lse = jnp.swapaxes(jnp.asarray(lse), 1, 2)                       # (B, Tq, N), as ring attention keeps it
    delta = jnp.sum(jnp.asarray(out) * do.astype(jnp.float32), -1)   # (B, Tq, N)
    state = rand((b, rows, n, d), jnp.float32)
    kw = dict(row_start=start, scale=scale, causal=causal)
    ours = jax.jit(lambda *a: accumulate_bwd(*a, **kw, in_place=in_place))
    q_in, do_in = (q_rows, do_rows) if in_place else (q, do)
    assert "pk_attention_bwd_accumulate" in ours.lower(q_in, k, v, do_in, lse, delta, off, state).compile().as_text()
    got = [np.asarray(x, np.float32) for x in ours(q_in, k, v, do_in, lse, delta, off, state)]
    ref = jax.jit(lambda q, k, v, do, lse, delta, off, st: reference_bwd(
        q, k, v, do, jnp.swapaxes(lse, 1, 2), jnp.swapaxes(delta, 1, 2), off, st, **kw))
    want = [np.asarray(x, np.float32) for x in ref(q, k, v, do, lse, delta, off, state)]
    st = np.asarray(state)
    np.testing.assert_array_equal(got[0][:, :start], st[:, :start], err_msg="rows before the window")
    np.testing.assert_array_equal(got[0][:, start + tq:], st[:, start + tq:], err_msg="rows after the window")
    for name, a, w in (("dq rows", got[0][:, start:start + tq] - st[:, start:start + tq],
                        want[0][:, start:start + tq] - st[:, start:start + tq]), ("dk", got[1], want[1]),
                       ("dv", got[2], want[2])):
        err = np.abs(a - w).max() / max(np.abs(w).max(), 1e-30)
        assert err < 3e-2, f"{name}: max error {err:.2e} relative to max |ref|"
