"""The pipelined all_reduce (algorithm="small_pipelined") checked in a fresh process, where its knobs
(PK_JAX_AR_PIPELINED_*, read once per process) and XLA's command-buffer flags (read at start-up) can be
set from outside. Run as a script:

    python tests/gpu/pipelined_check.py sweep            # sizes x dtypes vs NumPy, bit for bit
    python tests/gpu/pipelined_check.py replay [REPLAYS]  # REPLAYS replays of one command buffer

sweep prints `PASS sweep <cases>`; replay prints whether the optimized HLO holds a command-buffer
computation, one `FAIL ...` line per bad replay and `PASS <n> replays`. Either prints the schedule the
kernel runs with (pk_jax/_pipelined_schedule.py) for the sizes it checks.
"""

from __future__ import annotations

import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "sweep"
if MODE == "replay":  # custom calls and fusions into command buffers from the first command on
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                               " --xla_gpu_graph_min_graph_size=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax import _ext  # noqa: E402
from pk_jax import _pipelined_schedule as sched  # noqa: E402
from poison import poison_allocator  # noqa: E402 - tests/gpu is this script's directory

SWEEP_BYTES = [4, 6, 100, 4098, 65534, 262144, 524290, (1 << 20) + 6, 3 << 20, 8 << 20]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def rank_order_sum(blocks: list[np.ndarray]) -> np.ndarray:
    acc = np.zeros(blocks[0].shape, np.float32)
    for b in blocks:
        acc = (acc + b.astype(np.float32)).astype(np.float32)
    return acc.astype(blocks[0].dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> int:
    """Elements whose bits differ (0: identical)."""
    return int((a.view(f"u{a.dtype.itemsize}") != b.view(f"u{b.dtype.itemsize}")).sum())


def program(mesh: Mesh, chain: int = 1):
    def body(v):
        for _ in range(chain):
            v = pk_jax.all_reduce(v, "x", algorithm="small_pipelined")
        return v
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def describe(nbytes: int, g: int) -> str:
    sms = _ext.ext.num_sms(0) if _ext.available() else 132
    return f"{nbytes} B over {g}: {sched.geometry(nbytes, g, sms, sched.knobs_from_env())}"


def sweep(mesh: Mesh) -> int:
    g = mesh.size
    bad = cases = 0
    for dt in DTYPES:
        item = jnp.dtype(dt).itemsize
        for nbytes in SWEEP_BYTES:
            if nbytes % item:
                continue
            n = nbytes // item
            x = jax.jit(lambda k: jax.random.normal(k, (g * n,), jnp.float32).astype(dt),
                        out_shardings=NamedSharding(mesh, P("x")))(jax.random.key(nbytes + item))
            poison_allocator(max(nbytes, 1 << 20) * 2)  # an output element never written shows as NaN
            got = np.asarray(program(mesh)(x))
            pk_jax.runtime.check()
            want = rank_order_sum(np.split(np.asarray(x), g))
            cases += 1
            for r, blk in enumerate(np.split(got, g)):
                diff = same_bits(blk, want)
                if diff:
                    bad += 1
                    print(f"FAIL {jnp.dtype(dt).name} {nbytes} B member {r}: {diff} of {n} differ ({describe(nbytes, g)})",
                          flush=True)
    if bad == 0:
        print(f"PASS sweep {cases}", flush=True)
    return int(bad > 0)


def replay(mesh: Mesh, replays: int) -> int:
    g = mesh.size
    dt = jnp.bfloat16
    sizes = [(8, 250), (1, 3), (512, 1025)]  # 4000 B, 6 B, ~1 MiB (odd)

    def step(a, b, c):
        return tuple(pk_jax.all_reduce(v, "x", algorithm="small_pipelined") for v in (a * 0.5, b, c))

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=(P("x"),) * 3, check_vma=False))
    make = lambda shape, k: jax.jit(  # noqa: E731
        lambda key: jax.random.randint(key, (g * shape[0], shape[1]), -4, 5).astype(dt),
        out_shardings=NamedSharding(mesh, P("x")))(jax.random.key(k))
    inputs = [[make(s, 10 * i + j) for j, s in enumerate(sizes)] for i in range(4)]
    hlo = f.lower(*inputs[0]).compile().as_text()
    print(f"command_buffer computation in optimized HLO: {'yes' if 'command_buffer' in hlo else 'no'}", flush=True)
    np_dt = np.dtype(ml_dtypes.bfloat16)
    wants = []
    for xs in inputs:
        blocks = [np.split(np.asarray(x), g) for x in xs]
        blocks[0] = [(b.astype(np.float32) * 0.5).astype(np_dt) for b in blocks[0]]
        wants.append([np.concatenate([rank_order_sum(bl)] * g) for bl in blocks])
    bad = 0
    for i in range(replays):
        k = i % len(inputs)
        for name, o, w in zip("abc", f(*inputs[k]), wants[k]):
            diff = same_bits(np.asarray(o), w)
            if diff:
                bad += 1
                print(f"FAIL replay {i} output {name}: {diff} of {w.size} elements differ", flush=True)
        if bad > 20:
            break
    pk_jax.runtime.check()
    if bad == 0:
        print(f"PASS {replays} replays", flush=True)
    return int(bad > 0)


def main() -> int:
    gpus = jax.devices("gpu")
    mesh = Mesh(np.array(gpus), ("x",))
    for nbytes in (4, 1 << 20, 8 << 20):
        print("schedule:", describe(nbytes, mesh.size), flush=True)
    if MODE == "replay":
        return replay(mesh, int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
    return sweep(mesh)


if __name__ == "__main__":
    sys.exit(main())
