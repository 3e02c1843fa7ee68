"""Where the MoE layer's time goes: device 0's GPU events of one traced call per program, at the DeepSeek-V3
per-GPU shape (T 4096 per GPU, H 7168, E 256, top-8, F 2048, uniform routing), built as `bench moe` builds them:
    moe_mlp fwd, moe_mlp fwd+bwd (issue 27's >= 20x the JAX composition: which kernels, how much glue);
    dispatch_gemm fused, the grouped GEMM alone, dispatch then GEMM (the fused one is 1.3x the GEMM alone);
    dispatch, combine: the exchanges alone (--shape 4096 4096 8 2 128: E 8 top-2, 376 GB/s at G 2, target 336).

    python scripts/moe_timeline.py [--programs mlp_fwd ... dispatch combine] [--min-us 20] [--small]
                                   [--shape T H E K F]

--small: tiny shapes (T 64, H 64, E 8, top-2, F 128), the plumbing only (no GPU events on CPU).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pk_jax.bench import moe
from timeline import print_timeline, trace_events  # scripts/timeline.py (this script's directory is on sys.path)

PROGRAMS = ("mlp_fwd", "mlp_fwd_bwd", "fused", "alone", "unfused", "dispatch", "combine")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
    ap.add_argument("--min-us", type=float, default=20.0, help="list events at least this long (others summed)")
    ap.add_argument("--small", action="store_true", help="tiny shapes: the plumbing only")
    ap.add_argument("--shape", nargs=5, type=int, metavar=("T", "H", "E", "K", "F"), default=None,
                    help="per-GPU tokens, hidden, experts, top-k, expert hidden (default: DeepSeek-V3's)")
    args = ap.parse_args()
    devices = jax.devices()
    g = len(devices)
    shape = (64, 64, max(8, g), 2, 128) if args.small else tuple(args.shape or moe.DEEPSEEK_EXCHANGE)
    if shape[2] % g:
        raise SystemExit(f"moe_timeline: {g} devices do not divide the {shape[2]} experts")
    mesh = Mesh(np.array(devices), (moe.AX,))
    for name in args.programs:
        op = name if name in ("dispatch", "combine") else "moe_mlp" if name.startswith("mlp") else "dispatch_gemm"
        case = moe.Case(op, *shape, "uniform", name == "mlp_fwd_bwd")
        xs, ours, bases, _, _ = moe._contenders(case, g, mesh, jnp.bfloat16)
        if name in ("alone", "unfused"):
            label = "grouped GEMM alone" if name == "alone" else "dispatch then GEMM"
            base = next(b for b in bases if b[0] == label)
            fn, xs = base[1], (base[2] if len(base) > 2 else xs)
        else:
            fn = ours
        print_timeline(f"{name} ({op})", trace_events(lambda: jax.block_until_ready(fn(*xs))), args.min_us)


if __name__ == "__main__":
    main()
