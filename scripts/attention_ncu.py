"""Hardware counters of our attention kernels beside cuDNN's on one shape, for Nsight Compute (ncu):

    ncu --clock-control none -k regex:'attention|sdpa|flash|fmha|cudnn' --section ... \
        python3 scripts/attention_ncu.py [--batch 4 --seq 16384 --heads 16 --head-dim 128] [--kv-heads 2] [--causal]

Each function runs once to compile (ncu skips those launches: --launch-skip is the caller's), then once more.
Order: our forward, cuDNN's forward, our forward+backward, cuDNN's forward+backward."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import pk_jax


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=None, help="K / V heads (GQA; default: --heads)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--only", nargs="*", default=["ours_fwd", "cudnn_fwd", "ours_bwd", "cudnn_bwd"])
    a = ap.parse_args()
    shape = (a.batch, a.seq, a.heads, a.head_dim)
    kv_shape = (a.batch, a.seq, a.kv_heads or a.heads, a.head_dim)
    q, k, v, do = (jax.random.normal(jax.random.key(i), s, jnp.float32).astype(jnp.bfloat16)
                   for i, s in enumerate((shape, kv_shape, kv_shape, shape)))
    ours = lambda q, k, v: pk_jax.attention(q, k, v, causal=a.causal, implementation="pk")
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=a.causal, implementation="cudnn")
    grads = lambda f: (lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
    fns = {"ours_fwd": (jax.jit(ours), (q, k, v)), "cudnn_fwd": (jax.jit(cudnn), (q, k, v)),
           "ours_bwd": (jax.jit(grads(ours)), (q, k, v, do)), "cudnn_bwd": (jax.jit(grads(cudnn)), (q, k, v, do))}
    for name in a.only:
        f, args = fns[name]
        jax.block_until_ready(f(*args))
    for name in a.only:
        f, args = fns[name]
        print(f"== {name}", flush=True)
        jax.block_until_ready(f(*args))


if __name__ == "__main__":
    main()
