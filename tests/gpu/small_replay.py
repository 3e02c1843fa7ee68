"""Replays a jitted program holding small-path collectives REPLAYS times inside an XLA command buffer
(CUDA graph) and checks every replay. Run as a script (XLA_FLAGS must be set before jax starts):

    python tests/gpu/small_replay.py [REPLAYS]

Prints whether the optimized HLO holds a command-buffer computation (XLA's HLO-level
CommandBufferScheduling; a thunk-level conversion would not show there, so this line is information,
not a verdict), one `FAIL ...` line per bad replay, and `PASS <n> replays` when every replay matched.
XLA's defaults (jax 0.11) already record FUSION, CUBLAS(LT), CUSTOM_CALL, CUDNN commands into command
buffers from 5 commands on; the flags below make it so from 1 command on, for fusions and custom calls.
"""

from __future__ import annotations

import os
import sys

# Custom calls (ours are marked command-buffer compatible) and fusions into command buffers, from
# the first command on (jax 0.11's default minimum graph size would leave a short program out).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                           " --xla_gpu_graph_min_graph_size=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402


def rank_order_sum(blocks: list[np.ndarray], dtype) -> np.ndarray:
    acc = np.zeros(blocks[0].shape, np.float32)
    for b in blocks:
        acc = (acc + b.astype(np.float32)).astype(np.float32)
    return acc.astype(dtype)


def main(replays: int) -> int:
    gpus = jax.devices("gpu")
    g = len(gpus)
    mesh = Mesh(np.array(gpus), ("x",))
    dt = jnp.bfloat16

    def step(v):  # small AR (one-shot), a fusion, small AG, small RS, small two-shot AR
        a = pk_jax.all_reduce(v, "x", algorithm="small_one_shot")
        b = pk_jax.all_gather(a * 0.5, "x", tiled=True, algorithm="small")
        c = pk_jax.reduce_scatter(b, "x", tiled=True, algorithm="small")
        d = pk_jax.all_reduce(c, "x", algorithm="small_two_shot")
        return a, b, c, d

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=(P("x"),) * 4, check_vma=False))
    local = (8, 250)  # 4000 B per member: odd sizes for no one; 2000 words split over G
    make = jax.jit(lambda k: jax.random.normal(k, (g * local[0], local[1]), jnp.float32).astype(dt),
                   out_shardings=NamedSharding(mesh, P("x")))
    xs = [make(jax.random.key(i)) for i in range(4)]
    hlo = f.lower(xs[0]).compile().as_text()
    in_buffer = "command_buffer" in hlo
    print(f"command_buffer computation in optimized HLO: {'yes' if in_buffer else 'no'}", flush=True)
    want = []
    np_dt = np.dtype(dt)
    for x in xs:
        blocks = np.split(np.asarray(x), g)
        a = rank_order_sum(blocks, np_dt)
        b = np.concatenate([(a.astype(np.float32) * 0.5).astype(np_dt)] * g)
        c_blocks = [np.split(b, g)[r] for r in range(g)]
        c = [rank_order_sum([blk] * g, np_dt) for blk in c_blocks]  # every member holds the same b
        d = rank_order_sum(c, np_dt)
        want.append((a, b, c, d))
    bad = 0
    for i in range(replays):
        k = i % len(xs)
        outs = [np.asarray(o) for o in f(xs[k])]
        a, b, c, d = want[k]
        exp = (np.concatenate([a] * g), np.concatenate([b] * g), np.concatenate(c), np.concatenate([d] * g))
        for name, o, e in zip("abcd", outs, exp):
            if not np.array_equal(o.view(np.uint16), e.view(np.uint16)):
                bad += 1
                n = int((o.view(np.uint16) != e.view(np.uint16)).sum())
                print(f"FAIL replay {i} output {name}: {n} of {o.size} elements differ", flush=True)
        if bad > 20:
            break
    pk_jax.runtime.check()
    if bad == 0:
        print(f"PASS {replays} replays", flush=True)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000))
