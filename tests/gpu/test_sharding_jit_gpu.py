"""Plain-jit users on GPUs: a two-layer MLP written with NamedShardings and with_sharding_constraint
only (no shard_map) compiles to our fused `pk_tp_gemm` custom calls through
`pk_jax.sharding.matmul`, forward and backward, and matches a float32 reference. Prints one
PASS/FAIL line per check. Run: python3 -m pytest tests/gpu/test_sharding_jit_gpu.py -v -s -rs"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import pk_jax.nn as nn
import pk_jax.sharding as pks

MIN_GPUS = 2
BF16_TOL = 2e-2  # max abs error relative to the largest reference magnitude
_seed = itertools.count(4242)


def _mesh(data: int, tp: int) -> Mesh:
    devices = np.array(jax.devices("gpu")[:data * tp]).reshape(data, tp)
    return Mesh(devices, ("data", "tp"), axis_types=(AxisType.Auto,) * 2)


def _normal(shape, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(next(_seed)), shape, jnp.float32)).astype(jnp.bfloat16)


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _fused_calls(compiled_text: str) -> int:
    return compiled_text.count('"pk_tp_gemm"')  # custom_call_target="pk_tp_gemm"


def _report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


@pytest.fixture(autouse=True)
def no_timing_in_the_partitioner(monkeypatch):
    """The fused ops autotune at lowering, which here runs inside XLA's partitioner callback; these
    tests take the untimed default schedule (test_autotune_inside_the_partitioner times)."""
    monkeypatch.setenv("PK_JAX_AUTOTUNE", "0")


def _mlp_case(mesh: Mesh, tokens: int, d: int, f: int):
    x_spec = NamedSharding(mesh, P(("data", "tp"), None))        # sequence parallel (and data parallel)
    h_spec = NamedSharding(mesh, P("data", "tp"))                 # column-parallel hidden
    specs = (x_spec, NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P("tp", None)))
    args = [jax.device_put(a, s) for a, s in zip(
        (_normal((tokens, d)), _normal((d, f), d**-0.5), _normal((f, d), f**-0.5)), specs)]

    def mlp(x, w1, w2):
        h = jax.lax.with_sharding_constraint(pks.matmul(x, w1), h_spec)
        return jax.lax.with_sharding_constraint(pks.matmul(jax.nn.gelu(h), w2), x_spec)

    def reference(x, w1, w2):
        x, w1, w2 = (a.astype(jnp.float32) for a in (x, w1, w2))
        return jax.nn.gelu(x @ w1) @ w2

    return mlp, reference, specs, args


@pytest.mark.parametrize("data", [1, 2])
def test_two_layer_mlp_forward_compiles_to_fused_calls(data):
    if len(jax.devices("gpu")) < 2 * data:
        pytest.skip(f"needs {2 * data} GPUs for a {data} x 2 mesh")
    mesh = _mesh(data, 2)
    mlp, reference, specs, args = _mlp_case(mesh, tokens=2048 * data, d=1024, f=4096)
    pks.decisions.clear()
    fn = jax.jit(mlp, in_shardings=specs)
    calls = _fused_calls(fn.lower(*args).compile().as_text())
    names = sorted(d.name for _, d in pks.decisions)
    err = _rel(fn(*args), reference(*args))
    ok = calls >= 2 and names == ["all_gather_matmul", "matmul_reduce_scatter"] and err < BF16_TOL
    _report(f"mlp forward {data}x2", ok, f"pk_tp_gemm calls {calls}, lowerings {names}, rel err {err:.2e}")
    assert ok


def test_two_layer_mlp_gradients_compile_to_fused_calls():
    mesh = _mesh(1, 2)
    mlp, reference, specs, args = _mlp_case(mesh, tokens=2048, d=1024, f=4096)
    loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2))
    pks.decisions.clear()
    fn = jax.jit(jax.grad(loss(mlp), argnums=(0, 1, 2)), in_shardings=specs)
    calls = _fused_calls(fn.lower(*args).compile().as_text())
    roles = sorted({(r, d.name) for r, d in pks.decisions})
    grads = fn(*args)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(*args)
    errs = [_rel(g, w) for g, w in zip(grads, want)]
    # forward AG + RS, backward dx: AG (of dy) + RS; the weight gradients gather k and run locally
    ok = calls >= 4 and ("dx", "matmul_reduce_scatter") in roles and max(errs) < 3 * BF16_TOL
    _report("mlp gradients 1x2", ok, f"pk_tp_gemm calls {calls}, lowerings {roles}, rel errs "
            f"{', '.join(f'{e:.2e}' for e in errs)}")
    assert ok


def test_row_parallel_all_reduce_compiles_to_fused_call():
    mesh = _mesh(1, 2)
    x = jax.device_put(_normal((1024, 2048)), NamedSharding(mesh, P(None, "tp")))
    w = jax.device_put(_normal((2048, 1024), 2048**-0.5), NamedSharding(mesh, P("tp", None)))
    replicated = NamedSharding(mesh, P())
    pks.decisions.clear()
    fn = jax.jit(lambda x, w: jax.lax.with_sharding_constraint(pks.matmul(x, w), replicated))
    calls = _fused_calls(fn.lower(x, w).compile().as_text())
    err = _rel(fn(x, w), x.astype(jnp.float32) @ w.astype(jnp.float32))
    names = [d.name for _, d in pks.decisions]
    ok = calls == 1 and names == ["matmul_all_reduce"] and err < BF16_TOL
    _report("row-parallel all-reduce", ok, f"pk_tp_gemm calls {calls}, lowerings {names}, rel err {err:.2e}")
    assert ok


def test_nn_parallel_mlp_under_plain_jit():
    mesh = _mesh(1, 2)
    x = jax.device_put(_normal((2, 1024, 1024)), NamedSharding(mesh, P("data", "tp", None)))
    w1 = jax.device_put(_normal((1024, 2048), 1024**-0.5), NamedSharding(mesh, P(None, "tp")))
    w2 = jax.device_put(_normal((2048, 1024), 2048**-0.5), NamedSharding(mesh, P("tp", None)))
    fn = jax.jit(lambda x, a, b: nn.parallel_mlp(x, a, b, axis_name="tp", sequence_parallel=True, data_axis="data",
                                                 mesh=mesh))
    calls = _fused_calls(fn.lower(x, w1, w2).compile().as_text())
    f32 = [a.astype(jnp.float32) for a in (x, w1, w2)]
    err = _rel(fn(x, w1, w2), jax.nn.gelu(f32[0] @ f32[1]) @ f32[2])
    ok = calls >= 2 and err < BF16_TOL
    _report("pk_jax.nn.parallel_mlp", ok, f"pk_tp_gemm calls {calls}, rel err {err:.2e}")
    assert ok


_AUTOTUNED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
    import pk_jax.sharding as pks
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "tp"), axis_types=(AxisType.Auto,) * 2)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (4096, 1024)).astype(jnp.bfloat16),
                       NamedSharding(mesh, P("tp", None)))
    w = jax.device_put((jax.random.normal(jax.random.key(1), (1024, 4096)) / 32).astype(jnp.bfloat16),
                       NamedSharding(mesh, P(None, "tp")))
    fn = jax.jit(lambda x, w: jax.lax.with_sharding_constraint(pks.matmul(x, w), NamedSharding(mesh, P(None, "tp"))))
    calls = fn.lower(x, w).compile().as_text().count('"pk_tp_gemm"')
    want = x.astype(jnp.float32) @ w.astype(jnp.float32)
    err = float(jnp.max(jnp.abs(fn(x, w).astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
    print(("PASS" if calls == 1 and err < 2e-2 else "FAIL") + f" autotuned in the partitioner: calls {calls}, "
          f"rel err {err:.2e}", flush=True)
""")


def test_autotune_inside_the_partitioner(tmp_path):
    """The autotuner compiles and times candidate programs from inside XLA's partitioner callback;
    in a subprocess with a fresh cache and a time limit, so a hang shows as a failure, not a stall."""
    env = dict(os.environ, PK_JAX_AUTOTUNE="1", PK_JAX_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", _AUTOTUNED], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    print(proc.stdout.strip() or f"FAIL autotuned in the partitioner: rc {proc.returncode}\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stderr[-3000:]
