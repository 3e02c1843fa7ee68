"""RowSum (pk_jax/context/row_sum.py): parts at static rows summed in one pass, against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_bad_part_shape_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        RowSum.empty((1, 8, 2)).add(jnp.ones((1, 4, 3)), 0)
