"""Where ring attention's time goes: one traced call per case, every GPU event of device 0 listed in time
order (stream, start relative to the call's first kernel, duration), so one sees whether the ring shift's
kernel runs under the attention kernel and what the glue between the attention calls costs.

    python scripts/ring_timeline.py [--seq 12288] [--cases fwd_contiguous fwd_causal_zigzag] [--transport pk]
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax

AX = "x"


def trace_events(run) -> list[tuple[str, str, float, float]]:
    """(line, event name, start us, duration us) of device 0's GPU events during one run()."""
    from jax.profiler import ProfileData

    run()
    d = tempfile.mkdtemp(prefix="pk_ring_")
    jax.profiler.start_trace(d)
    run()
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    out = []
    for plane in ProfileData.from_file(files[0]).planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        for line in plane.lines:
            for e in line.events:
                out.append((line.name, e.name, e.start_ns / 1e3, e.duration_ns / 1e3))
    out.sort(key=lambda t: t[2])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=12288)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--cases", nargs="+", default=["fwd_contiguous", "fwd_causal_zigzag"])
    ap.add_argument("--min-us", type=float, default=20.0, help="list events at least this long (others summed)")
    args = ap.parse_args()
    devices = jax.devices()
    g = len(devices)
    mesh = Mesh(np.array(devices), (AX,))
    shape = (args.batch, args.seq, 16, 128)
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16),
                   out_shardings=NamedSharding(mesh, P(None, AX)))
    q, k, v = (make(jax.random.key(i)) for i in range(3))
    for case in args.cases:
        backward = case.startswith("fwd_bwd")
        causal = "causal" in case
        layout = "zigzag" if "zigzag" in case else "contiguous"
        attn = lambda q, k, v: pk_jax.ring_attention(q, k, v, AX, causal=causal, layout=layout)
        body = (lambda q, k, v: jax.grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)) \
            if backward else attn
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, AX), out_specs=P(None, AX), check_vma=False))
        evs = trace_events(lambda: jax.block_until_ready(f(q, k, v)))
        if not evs:
            print(f"{case}: no GPU events traced")
            continue
        t0 = evs[0][2]
        end = max(s + d for _, _, s, d in evs)
        print(f"== {case} ({os.environ.get('PK_JAX_RING_TRANSPORT', 'pk')}): {len(evs)} events, span {end - t0:9.1f} us")
        small = {}
        for line, name, s, d in evs:
            if d >= args.min_us:
                print(f"  {line[:22]:<22} {s - t0:10.1f} +{d:9.1f} us  {name[:90]}")
            else:
                small[line] = small.get(line, 0.0) + d
        for line, tot in small.items():
            print(f"  {line[:22]:<22} events < {args.min_us} us: {tot:9.1f} us in all")


if __name__ == "__main__":
    main()
