"""The pipelined all_reduce (algorithm="small_pipelined", kernels/small_pipelined.cu) on GPUs: sizes from 2
bytes to 8 MiB (odd sizes, partial last vectors, 16-bit tails), f32/bf16/f16, 1-3-D shapes, against a
NumPy float32 rank-order reference bit for bit with poisoned outputs, the same bits as small_chunked and
on a repeat, chains and interleaving with the other small ops, the two-shot schedule and odd knobs (in
fresh processes: the knobs are read once per process), and 1,000 command-buffer replays.

test_first_pipelined_call comes first on purpose: the device stage script runs it alone, bounded
(PK_JAX_TIMEOUT_MS=3000, `timeout 90`), before anything else."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pk_jax

from .devices import gpus
from .test_small_collectives_gpu import assert_bits, group_sizes, random_global, rank_order_sum, run

MIN_GPUS = 2
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SIZES = [2, 4, 6, 12, 18, 100, 1022, 4096, 4098, 16384, 65534, 65536, 262144, 524290, (1 << 20) - 2, 1 << 20,
         (1 << 20) + 6, 2 << 20, (4 << 20) + 2, 8 << 20]
HERE = os.path.dirname(__file__)


def _elems(nbytes: int, dtype) -> int | None:
    item = jnp.dtype(dtype).itemsize
    return nbytes // item if nbytes % item == 0 else None


def _check(g: int, dtype, nbytes: int) -> None:
    mesh = Mesh(np.array(gpus()[:g]), ("x",))
    n = _elems(nbytes, dtype)
    x = random_global((g * n,), dtype, mesh, P("x"))
    got = run(mesh, lambda v: pk_jax.all_reduce(v, "x", algorithm="small_pipelined"), x)
    want = rank_order_sum(np.split(np.asarray(x), g))
    for r, blk in enumerate(np.split(got, g)):
        assert_bits(blk, want, f"member {r}")


def test_first_pipelined_call():
    """One small and one multi-round size on two GPUs: a protocol bug shows here as a bounded timeout."""
    _check(2, jnp.bfloat16, 4098)
    _check(2, jnp.float32, 1 << 20)


@pytest.mark.parametrize("g", group_sizes())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nbytes", SIZES)
def test_all_reduce_sizes(g, dtype, nbytes):
    if _elems(nbytes, dtype) is None:
        pytest.skip("size not a whole number of elements")
    _check(g, dtype, nbytes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("local_shape", [(3, 5, 7), (1, 8192), (16, 8192), (7, 13), (2, 3, 4, 40), (513, 1025)])
def test_same_bits_as_chunked_and_on_a_repeat(dtype, local_shape):
    g = len(gpus())
    mesh = Mesh(np.array(gpus()), ("x",))
    x = random_global((g * local_shape[0],) + local_shape[1:], dtype, mesh, P("x"))
    first = run(mesh, lambda v: pk_jax.all_reduce(v, "x", algorithm="small_pipelined"), x)
    again = run(mesh, lambda v: pk_jax.all_reduce(v, "x", algorithm="small_pipelined"), x)
    chunked = run(mesh, lambda v: pk_jax.all_reduce(v, "x", algorithm="small_chunked"), x)
    assert_bits(again, first, "repeat")
    assert_bits(first, chunked, "vs small_chunked")
    assert_bits(np.split(first, g)[0], rank_order_sum(np.split(np.asarray(x), g)), "vs NumPy")


def test_chains_interleave_with_the_other_small_ops():
    """Parities and epochs cycle through every small op: a jitted chain alternating the pipelined
    all_reduce with LL one-shot, chunk flags and the small all_gather, many calls, outputs checked
    against the same program with psum / lax.all_gather."""
    g = len(gpus())
    mesh = Mesh(np.array(gpus()), ("x",))

    def prog(ours: bool):
        def ar(v, a):
            return pk_jax.all_reduce(v, "x", algorithm=a) if ours else jax.lax.psum(v, "x")

        def step(v):
            a = ar(v, "small_pipelined")
            b = ar(a * 0.25, "small_one_shot")
            c = ar(b * 0.5, "small_pipelined")
            d = ar(c * 0.125, "small_chunked")
            e = (pk_jax.all_gather(d, "x", tiled=True, algorithm="small") if ours
                 else jax.lax.all_gather(d, "x", tiled=True))
            return a, b, c, d, e, ar(e[: d.shape[0]] * 0.5, "small_pipelined")
        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=(P("x"),) * 6, check_vma=False))

    f, ref = prog(True), prog(False)
    # Integers: every sum exact, so psum's order does not matter.
    xs = [jax.device_put(jnp.asarray(np.random.default_rng(i).integers(-4, 5, (g * 96, 130)), jnp.bfloat16),
                         jax.sharding.NamedSharding(mesh, P("x"))) for i in range(3)]
    want = [[np.asarray(o) for o in ref(x)] for x in xs]
    for i in range(200):
        outs = f(xs[i % 3])
        if i % 10 == 0:
            for name, o, w in zip("abcdef", outs, want[i % 3]):
                assert_bits(np.asarray(o), w, f"call {i} output {name}")
    pk_jax.runtime.check()


def _script(mode: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(HERE, "pipelined_check.py"), mode, *args], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, **env,
                               "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")})


@pytest.mark.parametrize("knobs", [
    {"PK_JAX_AR_PIPELINED_SHOTS": "2"},  # two-shot (reduce-scatter + all-gather) on any G
    {"PK_JAX_AR_PIPELINED_LAG": "0", "PK_JAX_AR_PIPELINED_ROUNDS": "3", "PK_JAX_AR_PIPELINED_MIN_CHUNK": "64"},
    {"PK_JAX_AR_PIPELINED_SHOTS": "2", "PK_JAX_AR_PIPELINED_LAG": "0", "PK_JAX_AR_PIPELINED_MIN_CHUNK": "16"},
    {"PK_JAX_AR_PIPELINED_ROUNDS": "16", "PK_JAX_AR_PIPELINED_LAG": "15", "PK_JAX_AR_PIPELINED_MAX_CTAS": "5"},
    {"PK_JAX_AR_PIPELINED_FENCE": "data", "PK_JAX_AR_PIPELINED_ROUNDS": "8", "PK_JAX_AR_PIPELINED_LAG": "1"},
], ids=["two_shot", "lag0", "two_shot_lag0_tiny", "rounds16_lag15", "fence_data"])
def test_schedules_in_fresh_processes(knobs):
    res = _script("sweep", **knobs)
    print(res.stdout[-3000:], res.stderr[-2000:])
    assert res.returncode == 0 and "PASS sweep" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]


def test_1000_command_buffer_replays():
    res = _script("replay", "1000")
    print(res.stdout[-3000:], res.stderr[-2000:])
    assert res.returncode == 0 and "PASS 1000 replays" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
