"""Where ring (or Ulysses) attention's time goes: one traced call per case, every GPU event of device 0 listed in
time order (stream, start relative to the call's first kernel, duration), so one sees whether the ring shift's
kernel (or the Ulysses exchange) runs under the attention kernel and what the glue between the attention calls costs.

    python scripts/ring_timeline.py [--seq 12288] [--cases fwd_contiguous fwd_causal_zigzag]
    python scripts/ring_timeline.py --op ulysses --seq 2048 --heads 128 --cases fwd fwd_bwd
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from timeline import print_timeline, trace_events  # scripts/timeline.py (this script's directory is on sys.path)

AX = "x"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=12288)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--op", choices=["ring", "ulysses"], default="ring")
    ap.add_argument("--cases", nargs="+", default=["fwd_contiguous", "fwd_causal_zigzag"])
    ap.add_argument("--min-us", type=float, default=20.0, help="list events at least this long (others summed)")
    args = ap.parse_args()
    devices = jax.devices()
    mesh = Mesh(np.array(devices), (AX,))
    shape = (args.batch, args.seq, args.heads, 128)
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16),
                   out_shardings=NamedSharding(mesh, P(None, AX)))
    q, k, v = (make(jax.random.key(i)) for i in range(3))
    for case in args.cases:
        backward = case.startswith("fwd_bwd")
        causal = "causal" in case
        layout = "zigzag" if "zigzag" in case else "contiguous"
        attn = (lambda q, k, v: pk_jax.ulysses_attention(q, k, v, AX, causal=causal)) if args.op == "ulysses" else \
            (lambda q, k, v: pk_jax.ring_attention(q, k, v, AX, causal=causal, layout=layout))
        body = (lambda q, k, v: jax.grad(lambda *a: attn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)) \
            if backward else attn
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, AX), out_specs=P(None, AX), check_vma=False))
        evs = trace_events(lambda: jax.block_until_ready(f(q, k, v)))
        setting = ('chunks ' + os.environ.get('PK_JAX_ULYSSES_CHUNKS', 'default') + ', exchange '
                   + os.environ.get('PK_JAX_ULYSSES_A2A', 'auto')) if args.op == "ulysses" else \
            os.environ.get('PK_JAX_RING_TRANSPORT', 'pk')
        print_timeline(f"{args.op} {case} ({setting})", evs, args.min_us)

if __name__ == "__main__":
    main()
