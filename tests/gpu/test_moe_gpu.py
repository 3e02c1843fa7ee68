"""Expert parallelism on GPUs, the checks of tests/test_moe_cpu.py: dispatch/combine and their VJPs
against the NumPy routing model (uniform, skewed, empty expert, idle member, repeated ids; top-k 1..8;
8..64 experts; groups of 2, 4 and all GPUs), capacity and recv_rows drops; grouped_matmul on the GPU
reference path (the tiled pair scan) and its gradients against float64; moe_mlp and its gradients against
a float32 single-GPU reference, float32 and bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# moe_checks lives in tests/ (on sys.path)
import pk_jax
from moe_checks import TOKENS, check_moe_mlp, check_routing, grouped_refs

from .devices import gpus

MIN_GPUS = 2


def group_sizes() -> list[int]:
    n = len(gpus())
    return sorted({2, max(n, 2)} | ({4} if n >= 4 else set()))


ROUTING = [  # (experts per member, top_k, routing); E = experts per member * G, so 8..64 at G = 2..8
    (4, 1, "uniform"), (4, 2, "skewed"), (8, 8, "empty_expert"), (2, 3, "idle_member"), (8, 4, "repeats"),
]


@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("local,top_k,kind", ROUTING)
def test_dispatch_combine_match_numpy_model(g, local, top_k, kind):
    received, arrived = check_routing(gpus(), g, local * g, top_k, kind, seed=g)
    assert arrived.all() and received.sum() == g * TOKENS * top_k
    print(f"PASS moe dispatch/combine G={g} E={local * g} K={top_k} {kind}")


@pytest.mark.parametrize("g", group_sizes())
def test_capacity_and_recv_rows_drops(g):
    _, arrived = check_routing(gpus(), g, 4 * g, 2, "skewed", capacity=2, seed=1)
    assert not arrived.all()
    received, arrived = check_routing(gpus(), g, 4 * g, 2, "skewed", recv_rows=10, seed=2)
    assert arrived.sum() == np.minimum(received, 10).sum()
    print(f"PASS moe drops G={g}")


@pytest.mark.parametrize("m,k,n,e", [(1000, 256, 192, 8), (4096, 512, 256, 64)])
def test_grouped_matmul_gpu_path_and_gradients(m, k, n, e):
    rng = np.random.default_rng(m)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((e, k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    gs = np.diff(np.concatenate([[0], np.sort(rng.integers(0, m - 7, e - 1)), [m - 7]])).astype(np.int32)
    gs[0] += gs[1]
    gs[1] = 0  # an empty group; 7 rows past the sum
    want = grouped_refs(x, w, gs, dy)
    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(lambda x, w: pk_jax.grouped_matmul(x, w, jnp.asarray(gs)), x, w)
        got = (out, *vjp(dy))
    for name, a, b in zip(("out", "dx", "dw"), got, want):
        err = np.abs(np.asarray(a) - b).max() / np.abs(b).max()
        assert err < 1e-4, f"grouped_matmul {name}: relative error {err:.2e}"
    print(f"PASS grouped_matmul m={m} k={k} n={n} E={e}")


@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-3), (jnp.bfloat16, 4e-2)])
def test_moe_mlp_and_gradients_match_float32_reference(g, dtype, tol):
    check_moe_mlp(gpus(), g, 4 * g, 2, "skewed", dtype, tol, tokens=64, hidden=128, ffn=256, scale=16, seed=g)
    print(f"PASS moe_mlp G={g} {jnp.dtype(dtype).name}")
