"""Replays a jitted program holding the fused MoE exchange (dispatch, combine and their VJPs) REPLAYS times
inside an XLA command buffer (CUDA graph) and checks every replay against the reference exchange's result.
Run as a script (XLA_FLAGS must be set before jax starts):

    python tests/gpu/moe_replay.py [REPLAYS]

Prints whether the optimized HLO holds a command-buffer computation (information, not a verdict: see
tests/gpu/small_replay.py), one `FAIL ...` line per bad replay, and `PASS <n> replays` when every replay matched.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                           " --xla_gpu_graph_min_graph_size=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax.moe import fused  # noqa: E402


def main(replays: int) -> int:
    gpus = jax.devices("gpu")
    g, t, h, k, e = len(gpus), 96, 256, 4, 8 * len(gpus)
    mesh = Mesh(np.array(gpus), ("ep",))

    def step(x, ids, w):
        def layer(x, w):
            recv, _, hd = pk_jax.moe.dispatch(x, ids, "ep", num_experts=e, capacity=40)
            return pk_jax.moe.combine(recv * 2.0, w, hd), recv

        (out, recv), vjp = jax.vjp(layer, x, w)
        dx, dw = vjp((out, jnp.zeros_like(recv)))
        return recv, out, dx, dw

    rng = np.random.default_rng(0)
    inputs = []
    for i in range(3):  # different routings per replay: the layout changes between launches of one graph
        scores = rng.standard_normal((g * t, e))
        scores[:, i] += 1.5 * i
        ids = jnp.asarray(np.argsort(-scores, axis=-1)[:, :k], jnp.int32)
        inputs.append((jnp.asarray(rng.standard_normal((g * t, h)), jnp.bfloat16), ids,
                       jnp.asarray(rng.uniform(0.1, 1.0, (g * t, k)), jnp.float32)))
    prog = lambda: jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    with fused.override("reference"):
        ref = prog()
        want = [[np.asarray(o, np.float32) for o in ref(*a)] for a in inputs]
    with fused.override("fused"):
        f = prog().lower(*inputs[0]).compile()  # every routing has the same shapes: one executable
        hlo = f.as_text()
    print(f"command_buffer computation in optimized HLO: {'yes' if 'command_buffer' in hlo else 'no'}", flush=True)
    assert "pk_moe_dispatch" in hlo
    bad = 0
    for i in range(replays):
        j = i % len(inputs)
        for name, o, w_ in zip(("recv", "out", "dx", "dw"), f(*inputs[j]), want[j]):
            o = np.asarray(o, np.float32)
            ok = np.array_equal(o, w_) if name == "recv" else np.allclose(o, w_, rtol=2e-2, atol=2e-2)
            if not ok:
                bad += 1
                print(f"FAIL replay {i} output {name}: max |diff| {np.max(np.abs(o - w_)):.3g}", flush=True)
        if bad > 20:
            break
    pk_jax.runtime.check()
    if bad == 0:
        print(f"PASS {replays} replays", flush=True)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
