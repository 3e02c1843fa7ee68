"""The backward pass of the fused ops on GPUs: the compiled jax.grad program of each fused op holds no
float32 GEMM and calls our kernels (the forward's fused kind, then its pairing: AG -> a GEMM+RS kind and
a pk_matmul for dw; RS -> an AG+GEMM kind and a pk_matmul; AR -> two pk_matmul); the gradients match a
float32 reference; the MLP block's gradients too. Autotuning off with an empty cache, so the schedule is
the fused starting point (never the composition) and the kinds are known."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.bench import hlo_checks
from pk_jax.bench import llama_layer as L

MIN_GPUS = 2
G = 2
OPS = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter", "ar": "matmul_all_reduce"}


@pytest.fixture(autouse=True)
def untuned(monkeypatch, tmp_path):
    monkeypatch.setenv("PK_JAX_AUTOTUNE", "0")
    monkeypatch.setenv("PK_JAX_CACHE_DIR", str(tmp_path))


def rand(seed, shape, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(jnp.bfloat16)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def case(op: str, transpose_w: bool, m: int = 256, k: int = 512, n: int = 384):
    """(shard_map'd op, x, w, ct, float32 reference); local x (m, k), w (k, n) as stored (n, k) if transposed."""
    mesh = Mesh(np.array(jax.devices("gpu")[:G]), ("tp",))
    stored = lambda rows, cols: (cols, rows) if transpose_w else (rows, cols)
    prod = lambda a, b: a @ (b.T if transpose_w else b)
    w_cols = P("tp") if transpose_w else P(None, "tp")
    w_rows = P(None, "tp") if transpose_w else P("tp")
    if op == "ag":
        x, w = rand(1, (G * m, k)), rand(2, stored(k, G * n), k ** -0.5)
        fn = lambda a, b: pk_jax.all_gather_matmul(a, b, "tp", transpose_w=transpose_w)
        specs, out = (P("tp"), w_cols), P(None, "tp")
    else:
        x, w = rand(1, (m, G * k)), rand(2, stored(G * k, n), (G * k) ** -0.5)
        specs = (P(None, "tp"), w_rows)
        if op == "rs":
            fn, out = lambda a, b: pk_jax.matmul_reduce_scatter(a, b, "tp", transpose_w=transpose_w), P("tp")
        else:
            fn, out = lambda a, b: pk_jax.matmul_all_reduce(a, b, "tp", transpose_w=transpose_w), P()
    f = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out, check_vma=True)
    ct = rand(3, jax.eval_shape(f, x, w).shape)
    return f, x, w, ct, prod


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_backward_runs_fused_kernels_in_bf16(op, transpose_w):
    f, x, w, ct, prod = case(op, transpose_w)
    def train_step(a, b, c):  # y stays live (a loss needs it): without it XLA drops RS's/AR's forward kernel
        y, vjp = jax.vjp(f, a, b)
        return y, *vjp(c)

    step = jax.jit(train_step)
    compiled = step.lower(x, w, ct).compile().as_text()
    problems = hlo_checks.fused_vjp_problems(compiled, OPS[op])
    assert not problems, "\n".join(problems)
    kinds = hlo_checks.custom_call_kinds(compiled, "pk_tp_gemm")
    n_matmul = len(hlo_checks.custom_call_kinds(compiled, "pk_matmul"))
    gemms = hlo_checks.gemms(compiled)
    _, dx, dw = step(x, w, ct)
    pk_jax.runtime.check()
    ref_dx, ref_dw = jax.vjp(prod, x.astype(jnp.float32), w.astype(jnp.float32))[1](ct.astype(jnp.float32))
    assert rel_err(dx, ref_dx) < 1e-2 and rel_err(dw, ref_dw) < 1e-2, (rel_err(dx, ref_dx), rel_err(dw, ref_dw))
    print(f"PASS {op} transpose_w={transpose_w}: kinds {kinds}, {n_matmul} pk_matmul, {len(gemms)} other GEMMs "
          f"(none f32), dx err {rel_err(dx, ref_dx):.1e}, dw err {rel_err(dw, ref_dw):.1e}")


def test_mlp_block_gradients_on_gpus():
    shape = L.LayerShape("mlp", d_model=1024, d_ff=4096, n_heads=8, n_kv_heads=8)
    mesh = Mesh(np.array(jax.devices("gpu")[:G]), ("tp",))
    specs = L.param_specs(shape, "tp", mlp_only=True)
    params = L.init_params(jax.random.key(0), shape, jnp.bfloat16, True,
                           {k: NamedSharding(mesh, s) for k, s in specs.items()})
    x, ct = rand(4, (G * 512, shape.d_model)), rand(5, (G * 512, shape.d_model))
    f = L.sharded(shape, L.PK_OPS, mesh, "tp", mlp_only=True)
    step = jax.jit(lambda p, a, c: jax.vjp(f, p, a)[1](c))
    compiled = step.lower(params, x, ct).compile().as_text()
    bad = hlo_checks.float32_gemms(hlo_checks.gemms(compiled), results_too=False)
    assert not bad, "float32 GEMMs in the MLP block's backward:\n" + hlo_checks.describe(bad)
    kinds = hlo_checks.custom_call_kinds(compiled, "pk_tp_gemm")
    assert len(kinds) == 4, f"AG and RS forward, RS and AG backward: kinds {kinds}"
    d_params, dx = step(params, x, ct)
    pk_jax.runtime.check()
    ref = jax.jit(lambda p, a, c: jax.vjp(lambda p, a: L.reference_layer(p, a, shape, G, True), p, a)[1](c))
    ref_params, ref_dx = ref(params, x, ct.astype(jnp.float32))
    errs = {"x": rel_err(dx, ref_dx), **{k: rel_err(d_params[k], ref_params[k]) for k in d_params}}
    assert max(errs.values()) < 2e-2, errs
    print(f"PASS mlp_block grads on {G} GPUs: kinds {kinds}, errors {errs}")
