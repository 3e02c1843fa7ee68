"""scripts/attention_timeline.py (and the programs scripts/attention_power.py times) on CPU: the per-kernel sums of a
trace, and the bench-shaped program of --count input sets (pk_jax.attention's XLA fallback here) giving one
(out, dq, dk, dv) per set that matches jax.vjp of the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import attention_timeline  # noqa: E402


def test_per_kernel_sums_by_name_longest_first():
    evs = [("s", "fwd", 0.0, 5.0), ("s", "bwd", 5.0, 20.0), ("s", "fwd", 25.0, 7.0), ("s", "memset", 32.0, 1.0)]
    assert attention_timeline.per_kernel(evs) == [("bwd", 1, 20.0), ("fwd", 2, 12.0), ("memset", 1, 1.0)]


def test_program_runs_one_vjp_per_input_set():
    shape = (1, 64, 2, 64)
    sets = attention_timeline.input_sets(shape, 2)
    assert len(sets) == 2 and all(len(s) == 4 and s[0].shape == shape and s[0].dtype == jnp.bfloat16 for s in sets)
    assert not np.array_equal(np.asarray(sets[0][0]), np.asarray(sets[1][0]))  # fresh values per set
    outs = attention_timeline.program("pk", causal=True, grads=True)(sets)
    assert len(outs) == 2
    for (q, k, v, d_out), got in zip(sets, outs):
        ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
        out, vjp = jax.vjp(ref, q, k, v)
        for g, w in zip(got, (out, *vjp(d_out))):
            err = np.linalg.norm(np.asarray(g, np.float32) - np.asarray(w, np.float32))
            assert err <= 2e-2 * np.linalg.norm(np.asarray(w, np.float32))
    fwd_only = attention_timeline.program("pk", causal=False, grads=False)(sets)
    assert [o.shape for o in fwd_only] == [shape, shape]
