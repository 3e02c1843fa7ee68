"""DispatchMatmul (kernels/moe_gemm_kernel.cuh, pk_jax/moe/overlap.py) on 2 GPUs: the compiled program holds its
custom call; recv, counts and send_row equal the fused dispatch's bit for bit; gate and up equal the unfused
grouped GEMMs and a float32 NumPy reference of the model's rows (tests/moe_model.py), with NaN-poisoned outputs
(tail rows zero); routings uniform / skewed / an expert without tokens / a member receiving nothing / repeats,
top-k 1..8, drops by capacity and by the R bound, several comm-SM counts; and moe_mlp's output and five
gradients with PK_JAX_MOE_OVERLAP=1 against the float32 reference. Run the first test alone first:
    PK_JAX_TIMEOUT_MS=3000 timeout 90 python -m pytest -x -q tests/gpu/test_moe_overlap_gpu.py::test_overlap_first
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import moe_model  # tests/ is on sys.path
import pk_jax
from moe_checks import check_moe_mlp
from pk_jax.moe import fused, overlap

from .devices import gpus
from .poison import poison_allocator

MIN_GPUS = 2
G = 2
CALL = "pk_moe_dispatch_matmul"


def _problem(local, k, kind, tokens, hidden, ffn, seed, dtype=jnp.bfloat16, g=G):
    e = local * g
    rng = np.random.default_rng(seed)
    ids = moe_model.random_routing(rng, g, tokens, k, e, kind)
    x = (rng.standard_normal((g * tokens, hidden)) / 2).astype(np.float32)
    wg, wu = ((rng.standard_normal((e, hidden, ffn)) / np.sqrt(hidden)).astype(np.float32) for _ in range(2))
    cast = lambda a: jnp.asarray(a, dtype)
    return ids, cast(x), cast(wg), cast(wu)


def _run(ids, x, wg, wu, e, capacity, recv_rows, fused_op: bool, g=G):
    """(recv, counts, send_row, gate, up) per member, concatenated over the members (host arrays)."""
    mesh = Mesh(np.array(gpus()[:g]), ("ep",))

    def member(x, ids, wg, wu):
        if fused_op:
            recv_p, recv_counts, send_row, gate, up = overlap.dispatch_gate_up_rows(
                *_plan_args(x, ids, e, capacity, recv_rows, g), wg, wu, ("ep",), _sizes(x, ids, e, capacity, recv_rows, g),
                overlap.comm_sms())
            return recv_p, overlap.expert_rows(recv_counts, recv_p.shape[0]), send_row, gate, up
        recv, counts, h = pk_jax.moe.dispatch(x, ids, "ep", num_experts=e, capacity=capacity, recv_rows=recv_rows)
        return (recv, counts, h.send_row, pk_jax.moe.grouped_matmul(recv, wg, counts),
                pk_jax.moe.grouped_matmul(recv, wu, counts))

    with fused.override("fused"):
        compiled = jax.jit(jax.shard_map(member, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(
            x, jnp.asarray(ids.reshape(-1, ids.shape[-1])), wg, wu).compile()
    assert (CALL in compiled.as_text()) == fused_op
    poison_allocator(64 << 20, gpus()[:g])
    outs = compiled(x, jnp.asarray(ids.reshape(-1, ids.shape[-1])), wg, wu)
    pk_jax.runtime.check()  # a timeout or a mismatched op is an error here, not a hang
    return [np.asarray(o.astype(jnp.float32) if o.dtype == x.dtype else o) for o in outs]


def _sizes(x, ids, e, capacity, recv_rows, g=G):
    return pk_jax.moe.routing.routing_sizes(g, e, x.shape[0], ids.shape[1], capacity, recv_rows)


def _plan_args(x, ids, e, capacity, recv_rows, g=G):
    lp = pk_jax.moe.routing.plan_local(ids, _sizes(x, ids, e, capacity, recv_rows, g))
    return x, lp.key, lp.pos, lp.order


def _reference(ids, x, w, e, capacity, recv_rows):
    """float64 (G * R, F): each member's received rows (model order) times its experts' matrices."""
    g, tokens = ids.shape[:2]
    # The op's bound: G * min(T K, L C) with a capacity (routing_sizes), not G T K.
    r = pk_jax.moe.routing.routing_sizes(g, e, tokens, ids.shape[2], capacity, recv_rows).recv_rows
    rows, counts, _ = moe_model.dispatch_model(ids, e, capacity, r)
    xs = np.asarray(x, np.float32).reshape(g, tokens, -1)
    w = np.asarray(w, np.float32)
    local = e // g
    out = []
    for d in range(g):
        recv = np.zeros((r, xs.shape[2]), np.float32)
        for i, (s, t, _) in enumerate(rows[d]):
            recv[i] = xs[s, t]
        out.append(moe_model.dense_grouped_matmul(recv, w[d * local:(d + 1) * local], counts[d]))
    return np.concatenate(out), counts


def _check(local, k, kind, capacity=None, recv_rows=None, tokens=48, hidden=128, ffn=320, seed=0, g=G):
    ids, x, wg, wu = _problem(local, k, kind, tokens, hidden, ffn, seed, g=g)
    e = local * g
    got = _run(ids, x, wg, wu, e, capacity, recv_rows, True, g)
    unfused = _run(ids, x, wg, wu, e, capacity, recv_rows, False, g)
    for name, a, b in zip(("recv", "counts", "send_row"), got[:3], unfused[:3]):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: DispatchMatmul vs the fused dispatch")
    r = got[0].shape[0] // g
    for i, (name, w) in enumerate((("gate", wg), ("up", wu))):
        a = got[3 + i]
        assert not np.isnan(a).any(), f"{name}: unwritten (NaN-poisoned) elements"
        np.testing.assert_allclose(a, unfused[3 + i], rtol=1e-2, atol=1e-2, err_msg=f"{name} vs the unfused GEMM")
        want, counts = _reference(ids, x, w, e, capacity, recv_rows)
        scale = max(np.abs(want).max(), 1e-30)
        err = np.abs(a - want).max() / scale
        assert err < 2e-2, f"{name} vs float32 reference: relative error {err:.2e}"
        for d in range(g):  # rows past the received ones: zeros
            used = int(np.sum(counts[d]))
            assert not a[d * r + used:(d + 1) * r].any(), f"{name}: member {d}'s tail rows are not zero"


def test_overlap_first():
    """One small routing, default comm SMs: the kernel runs, agrees and returns (the stage's smoke test)."""
    _check(4, 2, "uniform", tokens=16, hidden=64, ffn=64)
    print("PASS moe overlap first")


ROUTINGS = [  # (local experts, top_k, kind, capacity, recv_rows, tokens)
    (4, 1, "uniform", None, None, 48), (4, 2, "skewed", None, None, 48), (8, 4, "empty_expert", None, None, 48),
    (4, 3, "idle_member", None, None, 48), (4, 5, "repeats", None, None, 48), (8, 6, "uniform", None, None, 48),
    (4, 7, "skewed", None, 120, 48), (8, 8, "uniform", None, None, 48), (4, 4, "skewed", 6, None, 48),
    (8, 8, "skewed", None, None, 400),  # hot experts: many 64-row chunks per (source, expert)
]


@pytest.mark.parametrize("local,k,kind,capacity,recv_rows,tokens", ROUTINGS)
def test_overlap_equals_unfused_and_reference(local, k, kind, capacity, recv_rows, tokens):
    _check(local, k, kind, capacity, recv_rows, tokens=tokens, seed=local * 10 + k)


@pytest.mark.parametrize("local,k,kind,tokens,hidden", [(4, 2, "uniform", 16, 64), (8, 8, "skewed", 200, 128),
                                                        (4, 8, "uniform", 64, 7168)])
def test_overlap_on_every_gpu(local, k, kind, tokens, hidden):
    """The group of every GPU here (4 on a 4-GPU machine; the other tests use 2): a small routing first, then hot
    experts, then the issue's row width."""
    g = len(gpus())
    if g <= G:
        pytest.skip(f"needs more than {G} GPUs (the other tests cover {G})")
    _check(local, k, kind, tokens=tokens, hidden=hidden, ffn=320, seed=local + k, g=g)


@pytest.mark.parametrize("sms", ["1", "8", "24", "64"])
def test_comm_sm_counts(monkeypatch, sms):
    monkeypatch.setenv(overlap.SMS_ENV, sms)
    _check(8, 8, "skewed", tokens=200, seed=int(sms))


def test_issue_row_width():
    """The issue's rows (H 7168: 112 k-blocks, 7 row segments per push) at 256 tokens per member, top-8 of 32
    experts, F 320 (an n tail in each half); the full expert count would need ~15 GB of float32 weights here."""
    _check(16, 8, "uniform", tokens=256, hidden=7168, ffn=320, seed=5)


@pytest.mark.parametrize("kind,k", [("skewed", 4), ("idle_member", 2)])
def test_moe_mlp_overlap_matches_reference(monkeypatch, kind, k):
    monkeypatch.setenv(overlap.ENV, "1")
    check_moe_mlp(gpus(), G, 8, k, kind, jnp.bfloat16, 4e-2, tokens=32, hidden=64, ffn=128, scale=8.0, seed=k)
