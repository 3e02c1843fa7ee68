"""RowSum (pk_jax/context/row_sum.py) and LseParts (lse_parts.py): parts at static rows summed / merged in one
pass, against NumPy and the block-by-block merge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pk_jax.context.lse_parts import LseParts
from pk_jax.context.row_sum import RowSum


def _parts(seed: int):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((2, 10, 3)).astype(np.float32)
    parts = [(rng.standard_normal((2, n, 3)).astype(np.float32), a) for n, a in ((4, 0), (10, 0), (3, 6), (5, 5))]
    return base, parts


@pytest.mark.parametrize("with_base", [True, False])
@pytest.mark.parametrize("max_parts", [1, 2, 4])
def test_total_equals_numpy_sum(with_base, max_parts):
    base, parts = _parts(1)
    s = RowSum.of(jnp.asarray(base), max_parts) if with_base else RowSum.empty(base.shape, max_parts)
    ref = base.copy() if with_base else np.zeros_like(base)
    for p, a in parts:
        s = s.add(jnp.asarray(p, jnp.bfloat16), a)
        ref[:, a:a + p.shape[1]] += np.asarray(jnp.asarray(p, jnp.bfloat16).astype(jnp.float32))
        assert len(s.parts) <= max_parts
    np.testing.assert_allclose(np.asarray(s.array()), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s.total(jnp.bfloat16).astype(jnp.float32)), ref, rtol=1e-2, atol=1e-2)
    assert s.total(jnp.bfloat16).dtype == jnp.bfloat16


def test_traced_start_adds_at_once_and_jit_carries_it():
    base, parts = _parts(2)
    p, _ = parts[2]

    @jax.jit
    def f(start, base, p):
        s = RowSum.of(base).add(jnp.ones((2, 10, 3)), 0)
        s = s.add(p, start)  # traced: folded into the base now
        assert not s.parts
        return s

    got = f(jnp.int32(4), jnp.asarray(base), jnp.asarray(p))
    ref = base + 1
    ref[:, 4:7] += p
    np.testing.assert_allclose(np.asarray(got.array()), ref, rtol=1e-6)


def test_exact_dtype_only_for_disjoint_parts_without_base():
    a = jnp.ones((1, 4, 2), jnp.bfloat16)
    assert RowSum.empty((1, 8, 2)).add(a, 0).add(a, 4).exact_dtype() == jnp.bfloat16
    assert RowSum.empty((1, 8, 2)).add(a, 0).add(a, 2).exact_dtype() == jnp.float32  # overlap: a rounded sum
    assert RowSum.of(jnp.zeros((1, 8, 2))).add(a, 0).exact_dtype() == jnp.float32
    one = RowSum.empty((1, 8, 2)).add(a, 2)
    np.testing.assert_array_equal(np.asarray(one.total(one.exact_dtype()).astype(jnp.float32))[0, :, 0],
                                  [0, 0, 1, 1, 1, 1, 0, 0])


def test_bad_part_shape_or_rows_are_refused():
    with pytest.raises(ValueError, match="does not fit"):
        RowSum.empty((1, 8, 2)).add(jnp.ones((1, 4, 3)), 0)
    for start in (6, -2):
        with pytest.raises(ValueError, match="not within"):
            RowSum.empty((1, 8, 2)).add(jnp.ones((1, 4, 2)), start)
        with pytest.raises(ValueError, match="not within"):
            LseParts.empty((1, 8, 2, 3)).add(jnp.ones((1, 4, 2, 3)), jnp.zeros((1, 4, 2)), start)
    assert RowSum.empty((1, 8, 2)).add(jnp.ones((1, 4, 2)), np.int64(4)).starts == (4,)  # NumPy ints are static


def test_lse_parts_merge_equals_sequential_merges():
    """LseParts (one pass) against online_softmax.merge applied block by block; rows no block covers: out 0, lse
    -inf; a base alone comes back as it is."""
    from pk_jax.context.online_softmax import merge

    rng = np.random.default_rng(3)
    shape = (2, 10, 3, 4)
    blocks = [(rng.standard_normal((2, n, 3, 4)).astype(np.float32), rng.standard_normal((2, n, 3)).astype(np.float32), a)
              for n, a in ((10, 0), (4, 0), (3, 6), (10, 0))]
    out = jnp.zeros(shape)
    lse = jnp.full(shape[:3], -jnp.inf)
    s = LseParts.empty(shape, max_parts=2)
    for o, l, a in blocks:
        m = merge(out[:, a:a + o.shape[1]], lse[:, a:a + o.shape[1]], jnp.asarray(o), jnp.asarray(l))
        out, lse = out.at[:, a:a + o.shape[1]].set(m[0]), lse.at[:, a:a + o.shape[1]].set(m[1])
        s = s.add(jnp.asarray(o), jnp.asarray(l), a)
    got_out, got_lse = s.result()
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(lse), rtol=1e-5, atol=1e-6)
    part = LseParts.empty(shape).add(jnp.ones((2, 4, 3, 4)), jnp.zeros((2, 4, 3)), 2)
    o, l = part.result()
    assert np.all(np.asarray(o)[:, :2] == 0) and np.all(np.isneginf(np.asarray(l)[:, 6:]))
    flushed = part.flush()
    assert flushed.result()[0] is flushed.base[0]
