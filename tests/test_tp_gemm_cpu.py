"""Fused TP GEMMs on 8 virtual CPU devices. On CPU the ops lower to their jax.lax composition, so the
comparisons here check the plumbing (shapes, sharding and vma typing on 1-D and 2-D meshes, sub-axes,
gradients), not the kernel (tests/gpu/test_tp_gemm_gpu.py does that); plus argument errors and the
autotune cache."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _small_path, autotune


def rand(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def compositions(axis):
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
    return {
        "ag": (lambda a, b: pk_jax.all_gather_matmul(a, b, axis),
               lambda a, b: dot(jax.lax.all_gather(a, axis, tiled=True), b)),
        "rs": (lambda a, b: pk_jax.matmul_reduce_scatter(a, b, axis),
               lambda a, b: jax.lax.psum_scatter(dot(a, b), axis, tiled=True)),
        "ar": (lambda a, b: pk_jax.matmul_all_reduce(a, b, axis),
               lambda a, b: jax.lax.psum(dot(a, b), axis)),
    }


SPECS = {"ag": ((P("x"), P()), P("x")), "rs": ((P(None, "x"), P("x")), P("x")), "ar": ((P(None, "x"), P("x")), P())}


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
@pytest.mark.parametrize("g", [2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_plumbing_matches_composition_1d(op, g, dtype):
    mesh = Mesh(np.array(jax.devices()[:g]), ("x",))
    x, w = rand(1, (256, 128), dtype), rand(2, (128, 64), dtype)
    ours, ref = compositions("x")[op]
    in_specs, out_spec = SPECS[op]
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec))(x, w)
    np.testing.assert_array_equal(np.asarray(run(ours), np.float32), np.asarray(run(ref), np.float32))


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_sub_axis_of_2d_mesh(op):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "tp"))
    x, w = rand(3, (256, 128)), rand(4, (128, 64))
    ours, ref = compositions("tp")[op]
    in_specs, out_spec = SPECS[op]
    in_specs = tuple(P(*[("tp" if a == "x" else a) for a in s]) for s in in_specs)
    out_spec = P(*[("tp" if a == "x" else a) for a in out_spec])
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec))(x, w)
    np.testing.assert_array_equal(np.asarray(run(ours), np.float32), np.asarray(run(ref), np.float32))


def test_return_gathered_and_scatter_dimension_1():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    x, w = rand(5, (256, 128)), rand(6, (128, 64))
    f = jax.jit(jax.shard_map(lambda a, b: pk_jax.all_gather_matmul(a, b, "x", return_gathered=True),
                              mesh=mesh, in_specs=(P("x"), P()), out_specs=(P("x"), P("x"))))
    out, gathered = f(x, w)
    assert out.shape == (4 * 256, 64) and gathered.shape == (4 * 256, 128)
    np.testing.assert_array_equal(np.asarray(gathered[:256], np.float32), np.asarray(x, np.float32))
    g = jax.jit(jax.shard_map(lambda a, b: pk_jax.matmul_reduce_scatter(a, b, "x", scatter_dimension=1),
                              mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=P(None, "x")))
    assert g(x, w).shape == (256, 64)


def test_gradients_match_composition():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    x, w = rand(7, (256, 128), jnp.float32), rand(8, (128, 64), jnp.float32)
    for op in ("ag", "rs", "ar"):
        ours, ref = compositions("x")[op]
        in_specs, out_spec = SPECS[op]
        loss = lambda f: lambda a, b: jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(a, b).sum()
        got = jax.grad(loss(ours), argnums=(0, 1))(x, w)
        want = jax.grad(loss(ref), argnums=(0, 1))(x, w)
        for a, b in zip(got, want):  # the backward is the fused pairing (pk_jax/_tp_vjp.py): other sum orders
            a, b = np.asarray(a), np.asarray(b)
            assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b), (op, np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("call,match", [
    (lambda x, w: pk_jax.all_gather_matmul(x[None], w, "x"), "x must be \\(m, k\\)"),
    (lambda x, w: pk_jax.matmul_all_reduce(x, w.T, "x"), "contraction sizes differ"),
    (lambda x, w: pk_jax.matmul_reduce_scatter(x, w, "x", scatter_dimension=2), "scatter_dimension=2"),
    (lambda x, w: pk_jax.matmul_all_reduce(x, w, "x", num_comm_sms=-1), "num_comm_sms=-1"),
])
def test_errors(call, match):
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x, w = rand(9, (64, 32)), rand(10, (32, 48))
    with pytest.raises(ValueError, match=match):
        jax.shard_map(call, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)(x, w)


def test_unknown_axis_names_the_axis():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x, w = rand(9, (64, 32)), rand(10, (32, 48))
    with pytest.raises(Exception, match="nope"):
        jax.shard_map(lambda a, b: pk_jax.matmul_all_reduce(a, b, "nope"), mesh=mesh, in_specs=(P(), P()),
                      out_specs=P(), check_vma=False)(x, w)


def test_autotune_times_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_time(c):
        calls.append(c)
        return abs(c.num_comm_sms - 12) + c.tile + 2.0  # fastest at 12 SMs with tile 0

    key = autotune.key("matmul_all_reduce", 1, 2, 3, "bfloat16", 4, "GPU X")
    want = autotune.Choice(12, 0)
    assert autotune.choose("matmul_all_reduce", key, fake_time, max_sms=132, tiles=(1, 0)) == want
    assert calls[0] == (autotune.START["matmul_all_reduce"], 1)  # the search starts at the saturation point
    assert {c.tile for c in calls if c.num_comm_sms} == {0, 1}  # every SM count with every tile
    n = len(calls)
    assert autotune.choose("matmul_all_reduce", key, fake_time, max_sms=132) == want
    assert len(calls) == n  # cached: not timed again
    doc = json.loads((tmp_path / "autotune.json").read_text())
    assert (doc["entries"][key]["num_comm_sms"], doc["entries"][key]["tile"]) == want


def test_autotune_cache_is_invalidated_by_version(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    key = autotune.key("all_gather_matmul", 1, 2, 3, "bfloat16", 2, "GPU X")
    (tmp_path / "autotune.json").write_text(json.dumps({"version": "0.0.0-old", "entries": {key: {"num_comm_sms": 99}}}))
    timed = []
    # The stale entry (99) is ignored: the candidates are timed again and the fastest (16) wins.
    choice = autotune.choose("all_gather_matmul", key, lambda c: timed.append(c) or abs(c.num_comm_sms - 16) + 1.0, 132)
    assert choice.num_comm_sms == 16
    assert timed


def test_autotune_disabled_uses_start(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PK_JAX_AUTOTUNE", "0")
    key = autotune.key("matmul_reduce_scatter", 1, 2, 3, "bfloat16", 2, "GPU X")
    assert autotune.choose("matmul_reduce_scatter", key, lambda c: 1 / 0, max_sms=132).num_comm_sms == 16


def test_autotune_picks_the_composition_when_it_is_faster(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    key = autotune.key("matmul_all_reduce", 8, 8, 8, "bfloat16", 2, "GPU X")
    timed = []
    choice = autotune.choose("matmul_all_reduce", key, lambda c: timed.append(c) or (0.5 if c.num_comm_sms == 0 else 1.0),
                             132)
    first_pass = list(dict.fromkeys(timed))  # in order of first timing
    assert choice.num_comm_sms == 0 and first_pass[-1].num_comm_sms == 0  # every fused split is tried first, the composition last


def test_autotune_does_not_cache_when_every_candidate_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    key = autotune.key("all_gather_matmul", 4, 4, 4, "bfloat16", 2, "GPU X")
    choice = autotune.choose("all_gather_matmul", key, lambda c: 1 / 0, max_sms=132)
    assert choice.num_comm_sms == autotune.START["all_gather_matmul"]
    assert key not in autotune.entries()


def test_autotune_intra_sm_is_timed_first_and_can_win(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    key = autotune.key("matmul_all_reduce", 8, 8, 8, "bfloat16", 2, "GPU X", "intra_sm")
    timed = []
    choice = autotune.choose("matmul_all_reduce", key, lambda c: timed.append(c) or (0.5 if c.num_comm_sms < 0 else 1.0),
                             132, intra_sm=True)
    assert choice.num_comm_sms == autotune.INTRA_SM
    first_pass = list(dict.fromkeys(timed))
    assert first_pass[0].num_comm_sms == autotune.INTRA_SM and first_pass[-1].num_comm_sms == 0


def test_autotune_without_composition(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    key = autotune.key("matmul_reduce_scatter", 8, 8, 8, "bfloat16", 2, "GPU X", "no_xla")
    timed = []
    autotune.choose("matmul_reduce_scatter", key, lambda c: timed.append(c) or 1.0, 132, composition=False)
    assert not {0, autotune.INTRA_SM} & {c.num_comm_sms for c in timed}


@pytest.mark.parametrize("fn,kw,match", [
    (pk_jax.matmul_all_reduce, {"schedule": "fast"}, "schedule='fast'"),
    (pk_jax.matmul_all_reduce, {"schedule": "intra_sm"}, "'store_add', 'pull', 'small' or 'xla'"),
    (pk_jax.matmul_all_reduce, {"schedule": "store_add", "deterministic": True}, "deterministic=False"),
    (pk_jax.matmul_all_reduce, {"schedule": "store_add", "num_comm_sms": 8}, "no num_comm_sms"),
    (pk_jax.all_gather_matmul, {"schedule": "store_add"}, "'intra_sm', 'comm_sms', 'small' or 'xla'"),
    (pk_jax.all_gather_matmul, {"schedule": "intra_sm", "num_comm_sms": 4}, "no num_comm_sms"),
], ids=lambda v: getattr(v, "__name__", str(v)))  # stable ids (not addresses): pytest-xdist workers must agree
def test_schedule_errors(fn, kw, match):
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x, w = rand(9, (64, 32)), rand(10, (32, 48))
    with pytest.raises(ValueError, match=match):
        jax.shard_map(lambda a, b: fn(a, b, "x", **kw), mesh=mesh, in_specs=(P(), P()),
                      out_specs=P(), check_vma=False)(x, w)


@pytest.mark.parametrize("schedule", [None, "intra_sm", "comm_sms", "small", "xla"])
def test_ag_schedules_have_the_composition_semantics(schedule):
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    x, w = rand(13, (4 * 64, 96)), rand(14, (96, 80))
    run = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=False)(x, w)
    got = run(lambda a, b: pk_jax.all_gather_matmul(a, b, "x", schedule=schedule))
    want = run(lambda a, b: jax.lax.all_gather(a, "x", tiled=True) @ b)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", [None, "store_add", "pull", "small", "xla"])
def test_every_schedule_has_the_composition_semantics(schedule):
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    x, w = rand(11, (256, 4 * 64)), rand(12, (4 * 64, 96))
    for op, ref in (("matmul_reduce_scatter", lambda a, b: jax.lax.psum_scatter(a @ b, "x", tiled=True)),
                    ("matmul_all_reduce", lambda a, b: jax.lax.psum(a @ b, "x"))):
        fn = getattr(pk_jax, op)
        out_spec = P("x") if op == "matmul_reduce_scatter" else P()
        run = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P(None, "x"), P("x")), out_specs=out_spec,
                                      check_vma=False)(x, w)
        got = run(lambda a, b: fn(a, b, "x", deterministic=False, schedule=schedule))
        np.testing.assert_allclose(np.asarray(got), np.asarray(run(ref)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_short_sizes_take_gemm_plus_small_collective_with_gradients(op, monkeypatch):
    """PK_JAX_SMALL_PATH=1: a decode-sized fused op is our GEMM + a small-path collective (no fused kernel),
    with the composition's values and gradients; a large one stays fused."""
    monkeypatch.setenv("PK_JAX_SMALL_PATH", "1")
    monkeypatch.delenv("PK_JAX_AR_LL128", raising=False)
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    ours, ref = compositions("x")[op]
    in_specs, out_spec = SPECS[op]
    loss = lambda f: jax.shard_map(lambda a, b: f(a, b).astype(jnp.float32) ** 2, mesh=mesh, in_specs=in_specs,
                                   out_specs=out_spec)
    for m, expect_small in ((32, True), (32768, False)):
        x, w = rand(21, (m, 256)), rand(22, (256, 128))
        step = lambda f: jax.value_and_grad(lambda a, b: loss(f)(a, b).sum(), argnums=(0, 1))
        text = str(jax.make_jaxpr(step(ours))(x, w))
        assert ("pk_tp_gemm" not in text) == expect_small, (m, text)
        if expect_small:
            # all_reduce: the LL128 lines (auto's first pick up to 2 MiB); gathers and scatters: the LL one-shot
            want = _small_path.VARIANT_SMALL_LL128 if op == "ar" else _small_path.VARIANT_SMALL
            assert "pk_matmul" in text and f"variant={want}" in text.replace(" ", ""), text
            (v, (dx, dw)), (rv, (rdx, rdw)) = step(ours)(x, w), step(ref)(x, w)
            np.testing.assert_allclose(float(v), float(rv), rtol=1e-2)
            for a, b in ((dx, rdx), (dw, rdw)):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


def test_schedule_small_refuses_what_the_small_path_cannot_carry():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x, w = rand(23, (2048, 512)), rand(24, (512, 1024))  # a 2 MiB partial: past the 1 MiB cap
    with pytest.raises(ValueError, match="schedule='small' serves"):
        jax.shard_map(lambda a, b: pk_jax.matmul_all_reduce(a, b, "x", schedule="small"), mesh=mesh,
                      in_specs=(P(None, "x"), P("x")), out_specs=P(), check_vma=False)(x, w)


def test_autotune_times_in_turns_and_retimes_the_closest_contenders(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    key = autotune.key("all_gather_matmul", 8, 8, 8, "bfloat16", 2, "GPU X")
    count, timed = {}, []

    def noisy(c):  # 16 SMs looks best in the first pass, then is slow: the finalists' medians reject it
        count[c] = count.get(c, 0) + 1
        timed.append(c)
        if c.num_comm_sms == 16:
            return 0.5 if count[c] <= autotune.WARMUP + autotune.REPS else 2.0
        return 1.0 + c.num_comm_sms / 100 if c.num_comm_sms else 5.0
    choice = autotune.choose("all_gather_matmul", key, noisy, 132)
    assert choice.num_comm_sms == 8
    assert count[autotune.Choice(16)] == autotune.WARMUP + autotune.REPS + autotune.FINALIST_REPS  # a finalist
    assert count[autotune.Choice(0)] == autotune.WARMUP + autotune.REPS  # not a finalist
    n = len(count)
    turns = timed[n * autotune.WARMUP:n * (autotune.WARMUP + autotune.REPS)]
    assert [set(turns[i:i + n]) for i in range(0, len(turns), n)] == [set(count)] * autotune.REPS  # all in turns
    assert len({turns[i] for i in range(0, len(turns), n)}) == min(n, autotune.REPS)  # each turn starts elsewhere


def test_autotune_off_starts_ag_with_comm_sms(tmp_path, monkeypatch):
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PK_JAX_AUTOTUNE", "0")
    for op, want in (("all_gather_matmul", autotune.START["all_gather_matmul"]),
                     ("matmul_reduce_scatter", autotune.INTRA_SM)):
        key = autotune.key(op, 1, 2, 3, "bfloat16", 2, "GPU X", "intra_sm")
        assert autotune.choose(op, key, lambda c: 1 / 0, 132, intra_sm=True).num_comm_sms == want


@pytest.mark.skipif(not pk_jax.extension_available(), reason="pk_jax CUDA extension not built")
def test_all_reduce_relays_over_more_than_two_members(monkeypatch):
    """The launch's choice of the AR store-add relay (a host function; no GPU needed)."""
    from pk_jax import _ext

    monkeypatch.delenv("PK_JAX_AR_RELAY", raising=False)
    assert [_ext.ext.tp_all_reduce_relays(g) for g in (2, 3, 4, 8)] == [False, True, True, True]
    monkeypatch.setenv("PK_JAX_AR_RELAY", "1")
    assert _ext.ext.tp_all_reduce_relays(2)


def _eqns(jaxpr, name: str) -> list:
    """The equations of primitive `name` in `jaxpr` and the jaxprs nested in its equations."""
    found = []
    for e in jaxpr.eqns:
        found += [e] if e.primitive.name == name else []
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _eqns(inner, name)
    return found


@pytest.mark.parametrize("op", ["matmul_reduce_scatter", "matmul_all_reduce"])
@pytest.mark.parametrize("cached", [autotune.INTRA_SM, 16, None])
def test_cached_store_add_is_traced_without_the_partial(tmp_path, monkeypatch, op, cached):
    """A later trace of an autotuned RS/AR whose cached choice is store-add has a (0, n) second output;
    other choices (and no choice yet) keep the (m, n) partial product the pull kernel writes."""
    from pk_jax import tp_gemm

    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the lookup is for GPU runs
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    m, k, n = 256, 64, 128  # local x (m, k): 128 rows per member, as the kernel needs
    x, w = rand(21, (m, 2 * k)).astype(jnp.bfloat16), rand(22, (2 * k, n)).astype(jnp.bfloat16)
    if cached is not None:
        spec = tp_gemm.TpSpec(op, ("x",), 2, None, True, may_intra_sm=True)
        key = tp_gemm._cache_key(spec, m, n, k, jnp.bfloat16, jax.devices()[0].device_kind)
        (tmp_path / "autotune.json").write_text(json.dumps(
            {"version": pk_jax.__version__, "entries": {key: {"num_comm_sms": cached, "tile": 0, "ms": {}}}}))
    fn = getattr(pk_jax, op)
    out_spec = P("x") if op == "matmul_reduce_scatter" else P()
    f = jax.shard_map(lambda a, b: fn(a, b, "x", deterministic=False), mesh=mesh, in_specs=(P(None, "x"), P("x")),
                      out_specs=out_spec, check_vma=False)
    (eqn,) = _eqns(jax.make_jaxpr(f)(x, w).jaxpr, "pk_tp_gemm")
    assert eqn.outvars[1].aval.shape == ((0, n) if cached == autotune.INTRA_SM else (m, n))
    assert eqn.params["spec"].intra_sm == (cached == autotune.INTRA_SM)


# transpose_w: w stored (n, k) (e.g. a weight read for an input gradient); the composition is x @ wᵀ.
SPECS_W_NK = {"ag": ((P("x"), P()), P("x")), "rs": ((P(None, "x"), P(None, "x")), P("x")),
              "ar": ((P(None, "x"), P(None, "x")), P())}
OPS_W_NK = {"ag": lambda a, b: pk_jax.all_gather_matmul(a, b, "x", transpose_w=True),
            "rs": lambda a, b: pk_jax.matmul_reduce_scatter(a, b, "x", transpose_w=True),
            "ar": lambda a, b: pk_jax.matmul_all_reduce(a, b, "x", transpose_w=True)}


def _float32_reference(op: str, x: np.ndarray, w_nk: np.ndarray, g: int) -> np.ndarray:
    """The op's global result in float32 numpy (x, w_nk global): RS/AR sum the members' k slices, so
    their (restacked) result is the whole product; AG gives every member the whole product, stacked."""
    product = x.astype(np.float32) @ w_nk.astype(np.float32).T
    return np.tile(product, (g, 1)) if op == "ag" else product


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
@pytest.mark.parametrize("g", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_transpose_w_matches_float32_reference(op, g, dtype):
    mesh = Mesh(np.array(jax.devices()[:g]), ("x",))
    x, w_nk = rand(31, (256, 128), dtype), rand(32, (64, 128), dtype)  # w stored (n, k)
    in_specs, out_spec = SPECS_W_NK[op]
    got = jax.jit(jax.shard_map(OPS_W_NK[op], mesh=mesh, in_specs=in_specs, out_specs=out_spec))(x, w_nk)
    want = _float32_reference(op, np.asarray(x, np.float32), np.asarray(w_nk, np.float32), g)
    assert got.shape == want.shape and got.dtype == jnp.dtype(dtype)
    # RS/AR round each member's partial to the input dtype before the sum (as the composition does).
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=3e-2, atol=0.25)


def test_transpose_w_scatter_dimension_1_and_return_gathered():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    x, w_nk = rand(33, (256, 128)), rand(34, (64, 128))
    g = jax.jit(jax.shard_map(lambda a, b: pk_jax.matmul_reduce_scatter(a, b, "x", scatter_dimension=1,
                                                                         transpose_w=True),
                              mesh=mesh, in_specs=(P(None, "x"), P(None, "x")), out_specs=P(None, "x")))
    want = np.asarray(x, np.float32) @ np.asarray(w_nk, np.float32).T
    np.testing.assert_allclose(np.asarray(g(x, w_nk), np.float32), want, rtol=3e-2, atol=0.25)
    f = jax.jit(jax.shard_map(lambda a, b: pk_jax.all_gather_matmul(a, b, "x", return_gathered=True,
                                                                     transpose_w=True),
                              mesh=mesh, in_specs=(P("x"), P()), out_specs=(P("x"), P("x"))))
    out, gathered = f(x, w_nk)
    assert out.shape == (4 * 256, 64) and gathered.shape == (4 * 256, 128)
    np.testing.assert_allclose(np.asarray(out[:256], np.float32), want, rtol=3e-2, atol=0.25)
    np.testing.assert_array_equal(np.asarray(gathered[:256], np.float32), np.asarray(x, np.float32))


def test_transpose_w_gradients_match_composition():
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    x, w_nk = rand(35, (256, 128), jnp.float32), rand(36, (64, 128), jnp.float32)
    dot_t = lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32)
    refs = {"ag": lambda a, b: dot_t(jax.lax.all_gather(a, "x", tiled=True), b),
            "rs": lambda a, b: jax.lax.psum_scatter(dot_t(a, b), "x", tiled=True),
            "ar": lambda a, b: jax.lax.psum(dot_t(a, b), "x")}
    for op in ("ag", "rs", "ar"):
        in_specs, out_spec = SPECS_W_NK[op]
        loss = lambda f: lambda a, b: jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec)(a, b).sum()
        got = jax.grad(loss(OPS_W_NK[op]), argnums=(0, 1))(x, w_nk)
        want = jax.grad(loss(refs[op]), argnums=(0, 1))(x, w_nk)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call,match", [
    (lambda x, w: pk_jax.matmul_all_reduce(x, w, "x", transpose_w=True), r"w\(32, 48\)\[1\] = 48 .*\(n, k\)"),
    (lambda x, w: pk_jax.all_gather_matmul(x, w[None], "x", transpose_w=True), r"w \(n, k\) \(transpose_w=True\)"),
    (lambda x, w: pk_jax.matmul_reduce_scatter(x, w, "x", scatter_dimension=1, transpose_w=True), "contraction"),
])
def test_transpose_w_errors(call, match):
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    x, w = rand(9, (64, 32)), rand(10, (32, 48))
    with pytest.raises(ValueError, match=match):
        jax.shard_map(call, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)(x, w)


def test_transpose_w_has_its_own_cache_key():
    from pk_jax import tp_gemm

    plain = tp_gemm.TpSpec("matmul_all_reduce", ("x",), 2, None, True)
    nk = tp_gemm.TpSpec("matmul_all_reduce", ("x",), 2, None, True, transpose_w=True)
    assert tp_gemm._cache_key(plain, 256, 128, 64, jnp.bfloat16, "H") != tp_gemm._cache_key(nk, 256, 128, 64, jnp.bfloat16, "H")
    assert "w_nk" in tp_gemm._cache_key(nk, 256, 128, 64, jnp.bfloat16, "H")
