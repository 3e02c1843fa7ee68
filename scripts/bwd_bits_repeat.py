"""Whether our attention's outputs repeat bit for bit (issue 18's "repeated calls give identical bits"): per
backward variant in --variants, the forward output and the gradients (jax.vjp with a bf16 cotangent, as the bench's
fwd_bwd rows) computed --repeats times on one set of inputs, each call's out / dQ / dK / dV compared with the first
call's and with the first variant's; prints the number of differing elements and the largest difference. dQ is
summed by reduce-adds in a run-dependent order: its differences are expected.
  python scripts/bwd_bits_repeat.py --shape 16 4096 16 128 --variants l2order_dqfirst base --repeats 4"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

import pk_jax
from pk_jax.attention import BWD_VARIANT_VAR


def outputs_fn(causal: bool):
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: pk_jax.attention(q, k, v, causal=causal, implementation="pk"), q, k, v)
        return (out, *vjp(d_out))
    return jax.jit(run)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=4, default=[16, 4096, 16, 128], metavar=("B", "S", "N", "D"))
    p.add_argument("--kv-heads", type=int, default=0, help="0: N")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--variants", nargs="+", default=["l2order_dqfirst", "base"])
    p.add_argument("--repeats", type=int, default=4)
    a = p.parse_args()
    b, s, n, d = a.shape
    kh = a.kv_heads or n
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (b, s, n, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, kh, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, kh, d), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(keys[3], (b, s, n, d), jnp.float32).astype(jnp.bfloat16)
    first = None
    for variant in a.variants:
        os.environ[BWD_VARIANT_VAR] = variant
        f = outputs_fn(a.causal)  # lowered under this variant
        runs = [[np.asarray(x.astype(jnp.float32)) for x in f(q, k, v, w)] for _ in range(a.repeats)]
        ref = runs[0]
        for i, r in enumerate(runs[1:], 1):
            diff = [int(np.sum(x != y)) for x, y in zip(r, ref)]
            mx = [float(np.max(np.abs(x - y))) for x, y in zip(r, ref)]
            print(f"{variant} call {i} vs call 0: differing elements out/dq/dk/dv {diff}, max |diff| {mx}", flush=True)
        if first is None:
            first = ref
        else:
            diff = [int(np.sum(x != y)) for x, y in zip(ref, first)]
            mx = [float(np.max(np.abs(x - y))) for x, y in zip(ref, first)]
            print(f"{variant} vs {a.variants[0]}: differing elements out/dq/dk/dv {diff}, max |diff| {mx}", flush=True)


if __name__ == "__main__":
    main()
