"""Dispatch + first grouped GEMM fused (pk_jax/moe/overlap.py, kernels/moe_gemm_kernel.cuh) on CPU: the index math
both sides of an arrival count agree on (overlap.comm_items / landed_rows / expected_arrivals, the mirror of
kernels/moe_arrivals.cuh and the kernel's comm CTAs) against the dispatch layout of the NumPy model, and the
primitive's fallback semantics (its jax.lax emulation, PK_JAX_MOE_DISPATCH=fused) equal to moe_mlp's unfused path,
output and all five gradients, bit for bit (16-bit operands: the kernel's). The kernel itself:
tests/gpu/test_moe_overlap_gpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import moe_model  # tests/ is on sys.path
import pk_jax
from pk_jax.bench import hlo_checks
from pk_jax.moe import expert_ffn, fused, overlap, routing

ROUTINGS = [  # (G, E, K, kind, capacity, recv_rows): drops by capacity and by the R bound included
    (2, 8, 2, "uniform", None, None),
    (2, 8, 4, "skewed", None, 40),
    (3, 6, 2, "empty_expert", 3, None),
    (4, 8, 1, "idle_member", None, None),
    (4, 16, 8, "repeats", None, 150),
]


def _counts(ids: np.ndarray, num_experts: int, capacity) -> np.ndarray:
    """(G, E) every member's kept rows per global expert (routing.plan_local's counts)."""
    g = ids.shape[0]
    keep = np.stack([moe_model.capacity_keep(ids[s], capacity) for s in range(g)])
    return np.stack([np.bincount(ids[s][keep[s]], minlength=num_experts) for s in range(g)])


@pytest.mark.parametrize("g,e,k,kind,capacity,recv_rows", ROUTINGS)
def test_arrival_counts_match_the_dispatch_layout(g, e, k, kind, capacity, recv_rows):
    """What the senders' chunks add at each receiver equals what its GEMM waits for, and that is the number of
    rows of (source, expert) in the model's output order below R; every row tile of an expert lies inside the
    rows counted for it."""
    tokens = 20
    ids = moe_model.random_routing(np.random.default_rng(g * 10 + k), g, tokens, k, e, kind)
    r = recv_rows or g * tokens * k
    local = e // g
    counts = _counts(ids, e, capacity)
    signals = overlap.arrival_signals(counts, r)
    rows, model_counts, _ = moe_model.dispatch_model(ids, e, capacity, r)
    for d in range(g):
        recv_counts = counts[:, d * local:(d + 1) * local]
        expected = overlap.expected_arrivals(recv_counts, r)
        np.testing.assert_array_equal(signals[d], expected, err_msg=f"receiver {d}: signals vs the GEMM's waits")
        # the model's rows of (source, local expert) at receiver d
        model = np.zeros((g, local), np.int64)
        for s, t, kk in rows[d]:
            model[s, ids[s, t, kk] % local] += 1
        np.testing.assert_array_equal(expected, model, err_msg=f"receiver {d}: waits vs the model's rows")
        sizes = np.asarray(overlap.expert_rows(jnp.asarray(recv_counts), r))
        np.testing.assert_array_equal(sizes, model_counts[d])
        np.testing.assert_array_equal(expected.sum(axis=0), sizes)  # the tiles of expert l cover exactly these


@pytest.mark.parametrize("g,e,k,kind,capacity,recv_rows", ROUTINGS[:3])
def test_comm_chunks_cover_each_expert_once(g, e, k, kind, capacity, recv_rows):
    """A member's chunks are its kept rows of every (local expert, destination) pair, consecutive positions once
    each, local expert major (peers first) so that all members' experts complete in the GEMM's order."""
    ids = moe_model.random_routing(np.random.default_rng(3), g, 200, k, e, kind)  # > CHUNK_ROWS rows per expert
    counts = _counts(ids, e, capacity)
    local = e // g
    for s in range(g):
        items = overlap.comm_items(counts[s], s, g)
        seen: dict[tuple[int, int], int] = {}
        order = []
        for l, dest, p0, n in items:
            assert p0 == seen.get((l, dest), 0) and 0 < n <= overlap.CHUNK_ROWS
            seen[(l, dest)] = p0 + n
            order.append(l)
        assert order == sorted(order)
        for l in range(local):
            for dest in range(g):
                assert seen.get((l, dest), 0) == counts[s, dest * local + l]


def test_settings_name_the_variable(monkeypatch):
    monkeypatch.setenv(overlap.SMS_ENV, "0")
    with pytest.raises(ValueError, match=overlap.SMS_ENV):
        overlap.comm_sms()
    monkeypatch.setenv(overlap.SMS_ENV, "24")
    assert overlap.comm_sms() == 24
    monkeypatch.delenv(overlap.SMS_ENV)
    assert overlap.comm_sms() == overlap.DEFAULT_COMM_SMS
    monkeypatch.delenv(overlap.ENV, raising=False)
    assert not overlap.enabled()


def _mlp(monkeypatch, on: bool, g: int, e: int, k: int, kind: str, capacity, dtype, names: bool = False):
    monkeypatch.setenv(fused.ENV, "fused")
    monkeypatch.setenv(overlap.ENV, "1" if on else "0")
    tokens, hidden, ffn = 8, 16, 24
    rng = np.random.default_rng(g + k)
    ids = moe_model.random_routing(rng, g, tokens, k, e, kind).reshape(g * tokens, k)
    x = rng.standard_normal((g * tokens, hidden)).astype(dtype)
    wts = rng.uniform(0.1, 1.0, (g * tokens, k)).astype(dtype)
    wg, wu = (rng.standard_normal((e, hidden, ffn)).astype(dtype) / 4 for _ in range(2))
    wd = rng.standard_normal((e, ffn, hidden)).astype(dtype) / 4
    cot = rng.standard_normal((g * tokens, hidden)).astype(dtype)
    layer = jax.shard_map(lambda ids, x, wt, a, b, c: pk_jax.moe.moe_mlp(x, ids, wt, a, b, c, "ep", capacity=capacity),
                          mesh=Mesh(np.array(jax.devices()[:g]), ("ep",)), in_specs=P("ep"), out_specs=P("ep"))

    def program(ids, *params):
        out, vjp = jax.vjp(lambda *p: layer(ids, *p), *params)
        return (out, *vjp(cot))

    params = (ids, x, wts, wg, wu, wd)
    if names:
        return hlo_checks.primitive_names(jax.make_jaxpr(program)(*params).jaxpr)
    return [np.asarray(o) for o in jax.jit(program)(*params)]


def test_moe_mlp_takes_the_fused_primitive_only_when_enabled(monkeypatch):
    on = _mlp(monkeypatch, True, 2, 8, 2, "uniform", None, jnp.bfloat16, names=True)
    off = _mlp(monkeypatch, False, 2, 8, 2, "uniform", None, jnp.bfloat16, names=True)
    assert "pk_moe_dispatch_matmul" in on and "pk_moe_dispatch" not in on, sorted(on)
    assert "pk_moe_dispatch_matmul" not in off and "pk_moe_dispatch" in off, sorted(off)
    assert "pk_moe_combine" in on  # the backward: dispatch's transpose, as the unfused path


@pytest.mark.parametrize("g,e,k,kind,capacity,dtype", [
    (2, 8, 2, "skewed", None, jnp.bfloat16),
    (2, 4, 4, "idle_member", 2, jnp.float16),
    (4, 8, 8, "repeats", None, jnp.bfloat16),
])
def test_fallback_equals_unfused_moe_mlp(monkeypatch, g, e, k, kind, capacity, dtype):
    # the overlap path composes SwiGLU and the down GEMM after its gate / up: the unfused path composed alike
    monkeypatch.setenv(expert_ffn.MODE_ENV, "compose")
    assert "pk_moe_dispatch_matmul" in _mlp(monkeypatch, True, g, e, k, kind, capacity, dtype, names=True)
    got = _mlp(monkeypatch, True, g, e, k, kind, capacity, dtype)
    want = _mlp(monkeypatch, False, g, e, k, kind, capacity, dtype)
    for name, a, b in zip(("out", "dx", "dweights", "dw_gate", "dw_up", "dw_down"), got, want):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: the fused primitive's semantics vs moe_mlp's")


def test_unsupported_layers_keep_the_unfused_path(monkeypatch):
    monkeypatch.setenv(overlap.ENV, "1")
    monkeypatch.setenv(fused.ENV, "fused")
    sizes = routing.routing_sizes(2, 8, 16, 2, None, None)
    assert overlap.use_overlap(sizes, 16, 24, jnp.bfloat16)
    assert not overlap.supported(sizes, 16, 24, jnp.float32)   # the kernel multiplies 16-bit operands
    assert not overlap.supported(sizes, 12, 24, jnp.bfloat16)  # H not a multiple of 8
    assert not overlap.supported(sizes, 16, 20, jnp.bfloat16)  # F not a multiple of 8
    monkeypatch.setenv(fused.ENV, "reference")
    assert not overlap.use_overlap(sizes, 16, 24, jnp.bfloat16)
