"""The fused MoE exchange (pk_jax/moe/fused.py) on virtual CPU devices, through its jax.lax emulation of the
kernels' semantics (PK_JAX_MOE_DISPATCH=fused): the path is taken (its primitives in the jaxpr, forward and
backward), its layout (send_row) is the NumPy model's output order, and every output and gradient equals the
reference path's (dispatch's rows, counts and handle bit for bit), over routings with and without drops,
groups of 2, 4 and 8, and sub-axes of a 2-D mesh. The kernels themselves: tests/gpu/test_moe_fused_gpu.py."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import moe_model  # tests/ is on sys.path
from moe_checks import TOKENS, routed, routing_inputs
import pk_jax
from pk_jax.bench import hlo_checks
from pk_jax.moe import fused, routing

ROOT = Path(__file__).resolve().parents[1]
FUSED_PRIMS = {"pk_moe_dispatch", "pk_moe_send", "pk_moe_combine"}


def _names(impl: str, monkeypatch, g=2, e=8, k=2, capacity=None):
    monkeypatch.setenv(fused.ENV, impl)
    ids = moe_model.random_routing(np.random.default_rng(0), g, TOKENS, k, e, "uniform").reshape(g * TOKENS, k)
    x = np.ones((g * TOKENS, 8), np.float32)
    w = np.ones((g * TOKENS, k), np.float32)

    def member(x, ids, w):
        recv, _, h = pk_jax.moe.dispatch(x, ids, "ep", num_experts=e, capacity=capacity)
        return pk_jax.moe.combine(recv * 2.0, w, h)

    f = jax.shard_map(member, mesh=Mesh(np.array(jax.devices()[:g]), ("ep",)), in_specs=P("ep"), out_specs=P("ep"))
    loss = lambda x, w: jnp.sum(f(x, ids, w) ** 2)
    return hlo_checks.primitive_names(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w).jaxpr)


def test_fused_path_is_taken_forward_and_backward(monkeypatch):
    names = _names("fused", monkeypatch)
    assert FUSED_PRIMS <= names, sorted(names)
    assert not names & hlo_checks.LAX_COLLECTIVES and "pk_collective" not in names, sorted(names)
    ref = _names("reference", monkeypatch)
    assert not FUSED_PRIMS & ref and "pk_collective" in ref
    # auto: the fused kernels only where the extension serves GPUs; on CPU the reference exchange
    assert not FUSED_PRIMS & _names("auto", monkeypatch)


def test_unknown_setting_is_refused(monkeypatch):
    monkeypatch.setenv(fused.ENV, "fast")
    with pytest.raises(ValueError, match="PK_JAX_MOE_DISPATCH"):
        fused.implementation()


def test_max_experts_matches_the_control_block():
    text = (ROOT / "kernels/pk/control_block.h").read_text()
    assert int(re.search(r"kMoeMaxExperts = (\d+);", text).group(1)) == fused.MAX_EXPERTS


def test_unsupported_routings_take_the_reference_path(monkeypatch):
    sizes = routing.routing_sizes(2, 2 * fused.MAX_EXPERTS, TOKENS, 2, None, None)
    assert not fused.supported(sizes, 8, jnp.float32)
    sizes = routing.routing_sizes(2, 8, TOKENS, 2, None, None)
    assert fused.supported(sizes, 8, jnp.bfloat16) and not fused.supported(sizes, 8, jnp.int32)
    assert not fused.supported(routing.routing_sizes(1, 8, TOKENS, 2, None, None), 8, jnp.float32)
    monkeypatch.setenv(fused.ENV, "fused")
    names = _names("fused", monkeypatch, g=1)  # a group of one exchanges nothing: the reference path
    assert not FUSED_PRIMS & names


CASES = [  # (G, experts, top_k, routing, capacity, recv_rows)
    (2, 8, 1, "uniform", None, None),
    (2, 16, 5, "empty_expert", None, None),
    (4, 8, 8, "uniform", None, None),
    (4, 64, 6, "idle_member", None, None),
    (4, 16, 3, "repeats", None, None),
    (8, 64, 8, "skewed", None, None),
    (2, 16, 4, "skewed", 1, None),
    (4, 8, 2, "skewed", 2, None),
    (8, 16, 2, "skewed", 3, None),
    (4, 16, 2, "skewed", None, 10),
    (2, 8, 3, "skewed", 2, 9),
]


def _run(impl, monkeypatch, g, e, k, kind, capacity, recv_rows, seed):
    monkeypatch.setenv(fused.ENV, impl)
    sizes = routing.routing_sizes(g, e, TOKENS, k, capacity, recv_rows)
    inputs = routing_inputs(g, e, k, kind, seed, sizes.recv_rows)
    return routed(jax.devices(), g, inputs, e, capacity, recv_rows), inputs, sizes


@pytest.mark.parametrize("g,e,k,kind,capacity,recv_rows", CASES)
def test_fused_equals_reference(monkeypatch, g, e, k, kind, capacity, recv_rows):
    got, _, _ = _run("fused", monkeypatch, g, e, k, kind, capacity, recv_rows, seed=g + k)
    want, _, _ = _run("reference", monkeypatch, g, e, k, kind, capacity, recv_rows, seed=g + k)
    for name in ("recv", "counts", "received"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in ("out", "dx", "dweights", "dx_dispatch"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("g,e,k,kind,capacity,recv_rows", [c for c in CASES if c[0] <= 4])
def test_send_row_is_the_model_order(monkeypatch, g, e, k, kind, capacity, recv_rows):
    """Each kept assignment's (destination, row) is where the NumPy model puts it; dropped ones are -1, and the
    handle's reference fields are those of the reference path."""
    monkeypatch.setenv(fused.ENV, "fused")
    sizes = routing.routing_sizes(g, e, TOKENS, k, capacity, recv_rows)
    ids = moe_model.random_routing(np.random.default_rng(g * 31 + k), g, TOKENS, k, e, kind)
    x = np.zeros((g * TOKENS, 8), np.float32)

    def member(x, ids, impl):
        _, _, h = pk_jax.moe.dispatch(x, ids, "ep", num_experts=e, capacity=capacity, recv_rows=recv_rows)
        fields = (h.send_assignment, h.assignment_slot, h.recv_source_row, h.expert_counts, h.received[None],
                  h.sent[None])
        return fields + ((h.send_row,) if impl == "fused" else ())

    def run(impl):
        monkeypatch.setenv(fused.ENV, impl)
        f = jax.jit(jax.shard_map(lambda x, ids: member(x, ids, impl), mesh=Mesh(np.array(jax.devices()[:g]), ("ep",)),
                                  in_specs=P("ep"), out_specs=P("ep")))
        return [np.asarray(a).reshape(g, -1) for a in f(x, ids.reshape(g * TOKENS, k))]

    got, want = run("fused"), run("reference")
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"handle field {i}")
    rows, _, arrived = moe_model.dispatch_model(ids, e, capacity, sizes.recv_rows)
    expect = np.full((g, TOKENS * k), -1)
    for d in range(g):
        for i, (s, t, c) in enumerate(rows[d]):
            expect[s, t * k + c] = d * sizes.recv_rows + i
    np.testing.assert_array_equal(got[-1], expect)
    assert (got[-1] >= 0).sum() == arrived.sum()


@pytest.mark.parametrize("axis", ["ep", ("dp", "ep")])
def test_fused_on_a_2d_mesh_sub_axis(monkeypatch, axis):
    """Dispatch / combine over one axis of a (dp=2, ep=4) mesh and over both: outputs and gradients equal the
    reference path's."""
    dp, ep, e, k, t, h = 2, 4, 16, 2, 6, 8
    g = ep if axis == "ep" else dp * ep
    rng = np.random.default_rng(5)
    ids = moe_model.random_routing(rng, dp * ep, t, k, e if axis == "ep" else 2 * e, "skewed").reshape(-1, k)
    x = rng.standard_normal((dp * ep * t, h)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, (dp * ep * t, k)).astype(np.float32)
    grid = Mesh(np.array(jax.devices()[:dp * ep]).reshape(dp, ep), ("dp", "ep"))
    num = e if axis == "ep" else 2 * e
    assert num % g == 0

    def member(x, ids, w):
        recv, counts, hd = pk_jax.moe.dispatch(x, ids, axis, num_experts=num, capacity=3)
        return pk_jax.moe.combine(recv * 3.0 + 1.0, w, hd), recv, counts

    def run(impl):
        monkeypatch.setenv(fused.ENV, impl)
        f = jax.shard_map(member, mesh=grid, in_specs=P(("dp", "ep")), out_specs=P(("dp", "ep")))
        loss = lambda x, w: jnp.sum(f(x, ids, w)[0] ** 2)
        return jax.jit(lambda x, w: (f(x, ids, w), jax.grad(loss, (0, 1))(x, w)))(x, w)

    (out, recv, counts), grads = run("fused")
    (out_r, recv_r, counts_r), grads_r = run("reference")
    np.testing.assert_array_equal(recv, recv_r)
    np.testing.assert_array_equal(counts, counts_r)
    np.testing.assert_allclose(out, out_r, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, grads_r):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_fused_16bit_rows_equal_reference(monkeypatch, dtype):
    """16-bit rows: dispatch moves bits, combine and the backward's scaled send round once from float32."""
    g, e, k, t, h = 4, 16, 3, 10, 6

    def run(impl):
        monkeypatch.setenv(fused.ENV, impl)
        rng = np.random.default_rng(9)
        ids = moe_model.random_routing(rng, g, t, k, e, "uniform").reshape(-1, k)
        x = jnp.asarray(rng.standard_normal((g * t, h)), dtype)
        w = jnp.asarray(rng.uniform(0.1, 1.0, (g * t, k)), jnp.float32)

        def member(x, ids, w):
            recv, _, hd = pk_jax.moe.dispatch(x, ids, "ep", num_experts=e)
            return pk_jax.moe.combine(recv * 1.5, w, hd), recv

        f = jax.shard_map(member, mesh=Mesh(np.array(jax.devices()[:g]), ("ep",)), in_specs=P("ep"), out_specs=P("ep"))
        loss = lambda x, w: jnp.sum(f(x, ids, w)[0].astype(jnp.float32) ** 2)
        return jax.jit(lambda x, w: (f(x, ids, w), jax.grad(loss, (0, 1))(x, w)))(x, w)

    (out, recv), grads = run("fused")
    (out_r, recv_r), grads_r = run("reference")
    np.testing.assert_array_equal(np.asarray(recv, np.float32), np.asarray(recv_r, np.float32))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_r, np.float32), rtol=1e-2, atol=1e-2)
    for a, b in zip(grads, grads_r):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


def _lower_for_cuda_here(monkeypatch) -> None:
    """The fused path lowerable for CUDA without a GPU: a stand-in group table of 2 devices (skips when the
    extension, which registers the CUDA lowering, is not built)."""
    from pk_jax import _ext, runtime

    if not _ext.available():
        pytest.skip("the CUDA lowering is registered only with the extension")
    table = type("Table", (), {"mesh_ids": (0, 1), "mesh_shape": (2,), "group_axes": (0,)})
    monkeypatch.setattr(runtime, "lowering_group", lambda ctx, axis: (table, None))
    monkeypatch.setenv(fused.ENV, "fused")


@pytest.mark.parametrize("dedup", [True, False])
def test_cuda_lowering_of_dispatch(monkeypatch, dedup):
    """The fused path lowered for CUDA (a stand-in group table: no GPU here): pk_moe_dispatch has one more
    result than the primitive, the src_of scratch (R int32) the deduplicated kernels need, and the dedup
    attribute follows fused.override_dedup (PK_JAX_MOE_DEDUP)."""
    _lower_for_cuda_here(monkeypatch)
    g, e, k = 2, 8, 2
    sizes = routing.routing_sizes(g, e, TOKENS, k, None, None)

    def member(x, ids):
        recv, counts, h = pk_jax.moe.dispatch(x, ids, "ep", num_experts=e)
        return recv, counts, h.send_row

    f = jax.jit(jax.shard_map(member, mesh=Mesh(np.array(jax.devices()[:g]), ("ep",)), in_specs=P("ep"),
                              out_specs=P("ep"), check_vma=False))
    with fused.override_dedup(dedup):
        text = f.trace(jax.ShapeDtypeStruct((g * TOKENS, 8), jnp.float32),
                       jax.ShapeDtypeStruct((g * TOKENS, k), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "@pk_moe_dispatch(" in line)
    assert f"dedup = {int(dedup)} : i32" in call, call
    assert f"tensor<{sizes.recv_rows}xi32>)" in call.split("->")[-1], call  # the scratch: the last result


def test_dedup_setting(monkeypatch):
    monkeypatch.delenv(fused.DEDUP_ENV, raising=False)
    assert fused.dedup()
    monkeypatch.setenv(fused.DEDUP_ENV, "0")
    assert not fused.dedup()
    with fused.override_dedup(True):
        assert fused.dedup()
    monkeypatch.delenv(fused.DEDUP_ENV)  # auto: the measured rules
    assert fused.dispatch_dedup(2, 8) and fused.dispatch_dedup(2, 4) and not fused.dispatch_dedup(2, 2)
    assert not fused.combine_partials(2, 8, 2)  # partials only when forced
    monkeypatch.setenv(fused.DEDUP_ENV, "1")
    assert fused.dispatch_dedup(2, 2) and fused.combine_partials(2, 8, 2) and not fused.combine_partials(8, 8, 2)


@pytest.mark.parametrize("dedup,k,want", [(True, 4, 1), (False, 4, 0), (True, 1, 0)])
def test_cuda_lowering_of_combine(monkeypatch, dedup, k, want):
    """Combine lowered for CUDA (stand-in group table): pushed partials where they pay (G = 2, top-4: yes; top-1:
    no) and dedup is on, with a (G - 1) * T * H float32 scratch; else the pull kernel with a 1-float one."""
    _lower_for_cuda_here(monkeypatch)
    g, e, h = 2, 8, 16

    def member(x, ids, w):
        recv, _, hd = pk_jax.moe.dispatch(x, ids, "ep", num_experts=e)
        return pk_jax.moe.combine(recv, w, hd)

    f = jax.jit(jax.shard_map(member, mesh=Mesh(np.array(jax.devices()[:g]), ("ep",)), in_specs=P("ep"),
                              out_specs=P("ep"), check_vma=False))
    with fused.override_dedup(dedup):
        text = f.trace(jax.ShapeDtypeStruct((g * TOKENS, h), jnp.bfloat16), jax.ShapeDtypeStruct((g * TOKENS, k), jnp.int32),
                       jax.ShapeDtypeStruct((g * TOKENS, k), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "@pk_moe_combine(" in line)
    assert f"partials = {want} : i32" in call, call
    scratch = (g - 1) * TOKENS * h if want else 1
    assert f"tensor<{scratch}xf32>)" in call.split("->")[-1], call
    assert fused.partials_pay(2, 8, 2) and not fused.partials_pay(8, 8, 2) and fused.partials_pay(2, 8, 4)
