"""The fused MoE exchange's kernels (kernels/moe_dispatch.cu) against the reference exchange on GPUs: the
compiled program holds the fused custom calls (and no XLA collective); dispatch's rows, counts and handle are
the reference's bit for bit, combine and both VJPs match, over routings with and without drops (capacity,
recv_rows), groups of 2, 4 and all GPUs, float32 / bfloat16 / float16, row sizes that take 16-byte, 4-byte and
2-byte vectors, the issue's shape (hidden 7168, 256 experts, top-8) at a few hundred tokens, a sub-axis of a
2-D mesh, many calls interleaved with other pk_jax collectives (epochs), and command-buffer replays
(tests/gpu/moe_replay.py, a fresh process). tests/gpu/test_moe_gpu.py runs the NumPy-model checks, which
take the fused path by default on GPUs."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import moe_model  # tests/ is on sys.path
import pk_jax
from pk_jax.moe import fused

from .devices import gpus
from .poison import poison_allocator

MIN_GPUS = 2
FUSED_CALLS = ("pk_moe_dispatch", "pk_moe_combine", "pk_moe_send")
XLA_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
                   "collective-permute")


def group_sizes() -> list[int]:
    n = len(gpus())
    return sorted({2, max(n, 2)} | ({4} if n >= 4 else set()))


def _program(mesh, axis, e, capacity, recv_rows):
    def member(x, ids, w, cot, d_recv):
        def layer(x, w):
            recv, counts, h = pk_jax.moe.dispatch(x, ids, axis, num_experts=e, capacity=capacity, recv_rows=recv_rows)
            y = recv * jnp.asarray(1.5, recv.dtype) + jnp.asarray(0.25, recv.dtype)
            return (pk_jax.moe.combine(y, w, h), recv), (counts, h.received[None], h.send_assignment,
                                                         h.recv_source_row)

        (out, recv), vjp, aux = jax.vjp(layer, x, w, has_aux=True)
        dx, dw = vjp((cot, jnp.zeros_like(recv)))
        dx_dispatch, _ = vjp((jnp.zeros_like(out), d_recv))
        return (recv, *aux, out, dx, dw, dx_dispatch)

    spec = P(tuple(mesh.axis_names))
    return jax.jit(jax.shard_map(member, mesh=mesh, in_specs=spec, out_specs=spec))


def _compare(mesh, axis, g, e, k, kind, dtype, *, tokens=12, hidden=8, capacity=None, recv_rows=None, seed=0):
    n = mesh.devices.size
    rng = np.random.default_rng(seed)
    ids = moe_model.random_routing(rng, n, tokens, k, e, kind).reshape(n * tokens, k)
    x = jnp.asarray(rng.standard_normal((n * tokens, hidden)), dtype)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (n * tokens, k)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((n * tokens, hidden)), dtype)
    sizes = pk_jax.moe.routing.routing_sizes(g, e, tokens, k, capacity, recv_rows)
    d_recv = jnp.asarray(rng.standard_normal((n * sizes.recv_rows, hidden)), dtype)
    args = (x, ids, w, cot, d_recv)
    results = {}
    for impl in ("fused", "reference"):
        with fused.override(impl):
            compiled = _program(mesh, axis, e, capacity, recv_rows).lower(*args).compile()
        text = compiled.as_text()
        present = [c for c in FUSED_CALLS if c in text]
        assert present == (list(FUSED_CALLS) if impl == "fused" else []), (impl, present)
        assert not [c for c in XLA_COLLECTIVES if f" {c}(" in text or f" {c}-start(" in text], impl
        results[impl] = [np.asarray(o, np.float32) for o in compiled(*args)]
    pk_jax.runtime.check()
    got, want = results["fused"], results["reference"]
    names = ("recv", "counts", "received", "send_assignment", "recv_source_row", "out", "dx", "dw", "dx_dispatch")
    tol = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2
    for name, a, b in zip(names, got, want):
        if name in ("out", "dx", "dw", "dx_dispatch"):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
    return got


def _dispatch_only(g, e, k, kind, capacity, recv_rows, dtype, tokens, hidden, seed):
    """recv, counts and send_row of one dispatch with the deduplicated kernels, the kernels before dedup and
    the reference exchange (host float32 / int arrays)."""
    mesh = Mesh(np.array(gpus()[:g]), ("ep",))
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(moe_model.random_routing(rng, g, tokens, k, e, kind).reshape(g * tokens, k))
    x = jnp.asarray(rng.standard_normal((g * tokens, hidden)), dtype)

    def member(x, ids):
        recv, counts, h = pk_jax.moe.dispatch(x, ids, "ep", num_experts=e, capacity=capacity, recv_rows=recv_rows)
        return recv, counts, h.received[None]

    out = {}
    for name, impl, dedup in (("dedup", "fused", True), ("old", "fused", False), ("reference", "reference", True)):
        with fused.override(impl), fused.override_dedup(dedup):
            f = jax.jit(jax.shard_map(member, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
            out[name] = [np.asarray(o.astype(jnp.float32) if o.dtype == dtype else o) for o in f(x, ids)]
    pk_jax.runtime.check()
    return out


def test_dedup_dispatch_first():
    """The deduplicated dispatch (and its fill launch) alone, one small routing where tokens pick several experts
    of one member: recv bit for bit as the kernels before dedup and the reference exchange. Run it first:
    PK_JAX_TIMEOUT_MS=3000 timeout 120 python -m pytest -x -q \
        tests/gpu/test_moe_fused_gpu.py::test_dedup_dispatch_first"""
    out = _dispatch_only(2, 8, 4, "uniform", None, None, jnp.float32, 16, 64, 0)
    for name in ("old", "reference"):
        for i, (a, b) in enumerate(zip(out["dedup"], out[name])):
            np.testing.assert_array_equal(a, b, err_msg=f"output {i} vs {name}")
    print("PASS moe dedup dispatch first")


DEDUP_CASES = [  # (experts per member, top_k, routing, capacity, recv_rows, tokens)
    (4, 1, "uniform", None, None, 12), (4, 2, "skewed", None, None, 12), (8, 8, "empty_expert", None, None, 12),
    (2, 3, "idle_member", None, None, 12), (4, 5, "repeats", None, None, 12), (4, 6, "uniform", None, None, 12),
    (4, 7, "repeats", None, 30, 12), (4, 3, "skewed", 2, None, 12), (4, 4, "skewed", None, 10, 12),
    (16, 8, "uniform", None, None, 300),
]


@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("local,k,kind,capacity,recv_rows,tokens", DEDUP_CASES)
def test_dedup_equals_old_kernels(g, local, k, kind, capacity, recv_rows, tokens):
    """Every routing kind, top-k 1..8, drops by capacity and by the R bound (a token's primary at a member is then
    not always its first choice there): the same rows, zeros, counts as before dedup and as the reference."""
    out = _dispatch_only(g, local * g, k, kind, capacity, recv_rows, jnp.bfloat16, tokens, 72, g * 10 + k)
    for name in ("old", "reference"):
        for i, (a, b) in enumerate(zip(out["dedup"], out[name])):
            np.testing.assert_array_equal(a, b, err_msg=f"output {i} vs {name}")


def test_partials_combine_first():
    """Combine by pushed partials (kernels/moe_partials.cu) alone, G = 2, top-4 bf16 rows (partials pay): equal to the
    pull kernel (PK_JAX_MOE_DEDUP=0) up to float32 reassociation, and the same bits on a second run. Run it first:
    PK_JAX_TIMEOUT_MS=3000 timeout 120 python -m pytest -x -q \
        tests/gpu/test_moe_fused_gpu.py::test_partials_combine_first"""
    g, e, k, t, h = 2, 8, 4, 16, 64
    mesh = Mesh(np.array(gpus()[:g]), ("ep",))
    rng = np.random.default_rng(4)
    ids = jnp.asarray(moe_model.random_routing(rng, g, t, k, e, "uniform").reshape(g * t, k))
    x = jnp.asarray(rng.standard_normal((g * t, h)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (g * t, k)), jnp.float32)

    def member(x, ids, w):
        recv, _, hd = pk_jax.moe.dispatch(x, ids, "ep", num_experts=e)
        return pk_jax.moe.combine(recv * jnp.asarray(1.5, recv.dtype), w, hd)

    outs = {}
    for dedup in (True, False):
        with fused.override("fused"), fused.override_dedup(dedup):
            f = jax.jit(jax.shard_map(member, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
            text = f.lower(x, ids, w).as_text()
            assert f"partials = {int(dedup)}" in text, text[-2000:]
            outs[dedup] = [np.asarray(f(x, ids, w), np.float32) for _ in range(2)]
    pk_jax.runtime.check()
    np.testing.assert_array_equal(outs[True][0], outs[True][1])  # deterministic
    np.testing.assert_allclose(outs[True][0], outs[False][0], rtol=2e-2, atol=2e-2)
    print("PASS moe partials combine first")


CASES = [  # (experts per member, top_k, routing, capacity, recv_rows)
    (4, 1, "uniform", None, None), (4, 2, "skewed", None, None), (8, 8, "empty_expert", None, None),
    (2, 3, "idle_member", None, None), (8, 4, "repeats", None, None), (4, 2, "skewed", 2, None),
    (4, 2, "skewed", None, 10),
]


@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("local,k,kind,capacity,recv_rows", CASES)
def test_fused_equals_reference(g, local, k, kind, capacity, recv_rows):
    mesh = Mesh(np.array(gpus()[:g]), ("ep",))
    _compare(mesh, "ep", g, local * g, k, kind, jnp.float32, capacity=capacity, recv_rows=recv_rows, seed=g + k)
    print(f"PASS moe fused == reference G={g} L={local} K={k} {kind} cap={capacity} R={recv_rows}")


@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "old"])
def test_zero_tail_off_changes_only_the_tail(g, dedup):
    """dispatch(zero_tail=False): the rows in use, counts, combine's output and both VJPs equal the default's bit
    for bit (the tail of recv and of combine's d y is left unwritten: NaN-poisoned memory there)."""
    mesh = Mesh(np.array(gpus()[:g]), ("ep",))
    rng = np.random.default_rng(40 + g)
    tokens, k, e, hidden = 64, 4, 4 * g, 64
    ids = jnp.asarray(moe_model.random_routing(rng, g, tokens, k, e, "skewed").reshape(g * tokens, k))
    x = jnp.asarray(rng.standard_normal((g * tokens, hidden)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (g * tokens, k)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((g * tokens, hidden)), jnp.bfloat16)

    def member(x, ids, w, cot, zero_tail):
        def layer(x, w):
            recv, counts, h = pk_jax.moe.dispatch(x, ids, "ep", num_experts=e, zero_tail=zero_tail)
            return pk_jax.moe.combine(recv * jnp.asarray(1.5, recv.dtype), w, h), (recv, counts)

        out, vjp, (recv, counts) = jax.vjp(layer, x, w, has_aux=True)
        return (recv, counts, out, *vjp(cot))

    results = {}
    for zero_tail in (True, False):
        f = jax.jit(jax.shard_map(functools.partial(member, zero_tail=zero_tail), mesh=mesh, in_specs=P("ep"),
                                  out_specs=P("ep")))
        poison_allocator(64 << 20, gpus()[:g])
        with fused.override("fused"), fused.override_dedup(dedup):
            results[zero_tail] = [np.asarray(o.astype(jnp.float32)) for o in f(x, ids, w, cot)]
    pk_jax.runtime.check()
    (recv_a, counts_a, *rest_a), (recv_b, counts_b, *rest_b) = results[True], results[False]
    np.testing.assert_array_equal(counts_a, counts_b)
    r, local = recv_a.shape[0] // g, e // g
    for m in range(g):
        lo, used = m * r, int(counts_a[m * local:(m + 1) * local].sum())
        assert not recv_a[lo + used:lo + r].any(), "the default zeroes recv's tail"
        np.testing.assert_array_equal(recv_a[lo:lo + used], recv_b[lo:lo + used], err_msg=f"recv rows of member {m}")
    for name, a, b in zip(("out", "dx", "dw"), rest_a, rest_b):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("dtype,hidden", [(jnp.bfloat16, 64), (jnp.float16, 5), (jnp.bfloat16, 6),
                                          (jnp.float32, 3), (jnp.float32, 12)])
def test_dtypes_and_vector_widths(dtype, hidden):
    """16-byte vectors (64 bf16, 12 f32 rows: 48 B), 4-byte (3 f32: 12 B; 6 bf16: 12 B) and 2-byte (5 f16: 10 B)."""
    mesh = Mesh(np.array(gpus()[:2]), ("ep",))
    _compare(mesh, "ep", 2, 8, 2, "uniform", dtype, hidden=hidden, seed=hidden)


def test_issue_shape_hidden_7168_256_experts_top8():
    g = 2  # the outputs come back to the host as float32: ~0.5 GB at G = 2
    mesh = Mesh(np.array(gpus()[:g]), ("ep",))
    got = _compare(mesh, "ep", g, 256, 8, "uniform", jnp.bfloat16, tokens=256, hidden=7168, seed=3)
    assert got[2].sum() == g * 256 * 8  # every row arrived


def test_sub_axis_of_a_2d_mesh():
    if len(gpus()) < 4:
        pytest.skip("needs 4 GPUs for a (2, 2) mesh")
    mesh = Mesh(np.array(gpus()[:4]).reshape(2, 2), ("dp", "ep"))
    _compare(mesh, "ep", 2, 8, 2, "skewed", jnp.float32, capacity=3, seed=7)
    _compare(mesh, ("dp", "ep"), 4, 16, 2, "uniform", jnp.float32, seed=8)


def test_many_calls_interleaved_with_collectives():
    """50 dispatch/combine calls between all_gather and all_reduce calls (the OpProtocol epochs are shared):
    the same results every time."""
    g = 2
    mesh = Mesh(np.array(gpus()[:g]), ("ep",))
    rng = np.random.default_rng(1)
    ids = moe_model.random_routing(rng, g, 64, 4, 16, "skewed").reshape(g * 64, 4)
    x = jnp.asarray(rng.standard_normal((g * 64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (g * 64, 4)), jnp.float32)

    def step(x, ids, w):
        a = pk_jax.all_gather(x, "ep", tiled=True)
        recv, _, h = pk_jax.moe.dispatch(x, ids, "ep", num_experts=16)
        out = pk_jax.moe.combine(recv, w, h)
        return recv, out, pk_jax.all_reduce(out, "ep"), a[:1]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    with fused.override("fused"):
        first = [np.asarray(o, np.float32) for o in f(x, ids, w)]
    for _ in range(50):
        for a, b in zip(f(x, ids, w), first):
            np.testing.assert_array_equal(np.asarray(a, np.float32), b)
    pk_jax.runtime.check()


def test_command_buffer_replays():
    """In a fresh process (XLA flags are read at start-up): see tests/gpu/moe_replay.py."""
    script = os.path.join(os.path.dirname(__file__), "moe_replay.py")
    res = subprocess.run([sys.executable, script, "200"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")})
    print(res.stdout[-4000:], res.stderr[-2000:])
    assert res.returncode == 0 and "PASS 200 replays" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
