"""Can ring attention run its block pairs on cuDNN (pk_jax/context/cudnn_block.py)? A one-GPU probe, ~1 min.

cudnn_block takes two things from JAX's internal cuDNN binding that jax.nn.dot_product_attention does not give:
each block's LSE (`return_residual=True`), and the backward primitive fed the whole row's merged output and LSE
rather than the ones its forward produced. On 4x H200 (2026-11-26) XLA 0.11.2 segfaulted compiling a program
in which a cuDNN forward's residuals had users besides its backward, so the second may not compile. Run this
under `python -X faulthandler`, so a crash names its step. Each step prints OK or the error:
  merge     two key halves through cudnn_block.forward, merged by their LSEs, vs the whole keys in one call
            (the LSE's units and layout)
  backward  each half's cudnn_block.backward with the merged output and LSE: dQ summed, dK/dV concatenated,
            vs jax.vjp of a float32 reference
  diagonal  a zigzag ring's own q0 pair: Tq = C queries against Tk = 2C keys, causal top-left (cuDNN's mask with
            Tq != Tk), forward and backward
  ring      pk_jax.ring_attention with PK_JAX_RING_LOCAL=cudnn on a group of one (this GPU), causal and not,
            vs the reference
  timing    per-block ms at the ring's block shapes (S 12288 at 4 and 2 GPUs): cuDNN forward with LSE, its
            backward fed statistics, against our kernels

    python -X faulthandler scripts/probe_cudnn_ring_block.py [--steps merge backward diagonal ring timing]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.context import cudnn_block
from pk_jax.context.online_softmax import merge

SCALE = 1 / math.sqrt(128)


def data(b, t, n, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(kk, (b, t, n, d), jnp.float32).astype(jnp.bfloat16) for kk in ks]


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def report(what: str, names: str, got, want, tol: float = 2e-2) -> None:
    """One line: each array's relative error against the reference, then OK, or FAILED past `tol` (bf16)."""
    errs = [rel(a, b) for a, b in zip(got, want)]
    verdict = "OK" if all(e <= tol for e in errs) else f"FAILED (tol {tol})"
    print(f"{what}: {names} rel " + " / ".join(f"{e:.2e}" for e in errs) + f"  {verdict}")


def reference_grads(q, k, v, d_out, mask=None):
    """(out, dq, dk, dv) of float32 attention with an optional (Tq, Tk) boolean mask."""
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=SCALE, implementation="xla",
                                                     mask=None if mask is None else mask[None, None])
    f32 = lambda x: x.astype(jnp.float32)
    out, vjp = jax.vjp(f, f32(q), f32(k), f32(v))
    return (out, *vjp(f32(d_out)))


def halves(q, k, v, d_out):
    """Two key halves (no mask) merged, then each half's backward with the merged output and LSE."""
    t = k.shape[1] // 2
    fwd = lambda k, v: cudnn_block.forward(q, k, v, scale=SCALE, causal=False, visible="all")
    (o0, l0), (o1, l1) = fwd(k[:, :t], v[:, :t]), fwd(k[:, t:], v[:, t:])
    out, lse = merge(o0.astype(jnp.float32), l0, o1.astype(jnp.float32), l1)
    bwd = lambda k, v: cudnn_block.backward(q, k, v, out, d_out, lse, scale=SCALE, causal=False, visible="all")
    (dq0, dk0, dv0), (dq1, dk1, dv1) = bwd(k[:, :t], v[:, :t]), bwd(k[:, t:], v[:, t:])
    return out, lse, dq0 + dq1, jnp.concatenate([dk0, dk1], 1), jnp.concatenate([dv0, dv1], 1)


def step_merge():
    q, k, v, d_out = data(2, 1024, 8, 128)
    whole, lse_whole = jax.jit(lambda q, k, v: cudnn_block.forward(q, k, v, scale=SCALE, causal=False,
                                                                   visible="all"))(q, k, v)
    out, lse, *_ = jax.jit(halves)(q, k, v, d_out)
    report("merge", "out / lse", (out, lse), (whole, lse_whole))


def step_backward():
    q, k, v, d_out = data(2, 1024, 8, 128, seed=1)
    out, _, dq, dk, dv = jax.jit(halves)(q, k, v, d_out)
    report("backward", "out / dq / dk / dv", (out, dq, dk, dv), reference_grads(q, k, v, d_out))


def step_diagonal():
    c = 512
    q, k, v, d_out = data(2, 2 * c, 8, 128, seed=2)
    q, d_out = q[:, :c], d_out[:, :c]  # queries of the first chunk against both chunks' keys
    mask = jnp.arange(c)[:, None] >= jnp.arange(2 * c)[None, :]

    def run(q, k, v, d_out):
        out, lse = cudnn_block.forward(q, k, v, scale=SCALE, causal=True, visible="diagonal")
        return (out, *cudnn_block.backward(q, k, v, out, d_out, lse, scale=SCALE, causal=True, visible="diagonal"))
    report("diagonal (Tq 512, Tk 1024, top-left)", "out / dq / dk / dv", jax.jit(run)(q, k, v, d_out),
           reference_grads(q, k, v, d_out, mask))


def step_ring():
    os.environ[cudnn_block.LOCAL_VAR] = "cudnn"
    try:
        m = Mesh(np.array(jax.devices()[:1]), ("sp",))
        for causal in (False, True):
            q, k, v, d_out = data(2, 1024, 8, 128, seed=3 + causal)
            f = jax.shard_map(lambda a, b, c: pk_jax.ring_attention(a, b, c, "sp", causal=causal), mesh=m,
                              in_specs=P(None, "sp"), out_specs=P(None, "sp"))

            def run(q, k, v, d_out):
                out, vjp = jax.vjp(f, q, k, v)
                return (out, *vjp(d_out))
            hlo = jax.jit(run).lower(q, k, v, d_out).compile().as_text()
            got = jax.jit(run)(q, k, v, d_out)
            mask = (jnp.arange(1024)[:, None] >= jnp.arange(1024)[None, :]) if causal else None
            report(f"ring G 1 causal={causal}, {hlo.count('custom_call_target="__cudnn')} cuDNN calls", "out / dq / dk / dv",
                   got, reference_grads(q, k, v, d_out, mask))
            if "__cudnn" not in hlo:
                print("ring: FAILED no cuDNN call in the compiled program")
    finally:
        os.environ.pop(cudnn_block.LOCAL_VAR, None)


def _time(f, *a, reps=20):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(5):
            r = f(*a)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t0) / 5 * 1e3)
    return float(np.median(ts))


def step_timing():
    from pk_jax.attention import _delta, _kernel_attention, _offset_array, pk_attention_bwd_p

    for b, t, n in ((16, 3072, 16), (16, 6144, 16)):  # a ring block at S 12288 on 4 and on 2 GPUs
        q, k, v, d_out = data(b, t, n, 128, seed=5)
        fwd = jax.jit(lambda q, k, v: cudnn_block.forward(q, k, v, scale=SCALE, causal=False, visible="all"))
        out, lse = fwd(q, k, v)
        bwd = jax.jit(lambda q, k, v, o, do, l: cudnn_block.backward(q, k, v, o, do, l, scale=SCALE, causal=False,
                                                                     visible="all"))
        offsets = _offset_array(0, 0)
        ours_fwd = jax.jit(lambda q, k, v: _kernel_attention(q, k, v, offsets, SCALE, False, 0))
        o2, l2 = ours_fwd(q, k, v)
        delta = _delta(o2, d_out, jnp.zeros_like(l2))

        def ours_bwd(q, k, v, do, l, d):
            return pk_attention_bwd_p.bind(q, k, v, do, l, d, offsets, scale=SCALE, causal=False, reserve_sms=0,
                                           dq_f32=True)
        ours_bwd = jax.jit(ours_bwd)
        row = dict(cudnn_fwd=_time(fwd, q, k, v), cudnn_bwd=_time(bwd, q, k, v, out, d_out, lse),
                   ours_fwd=_time(ours_fwd, q, k, v), ours_bwd=_time(ours_bwd, q, k, v, d_out, l2, delta))
        flops = 4 * b * n * t * t * 128
        print(f"timing B{b} T{t} N{n} D128, ms (TFLOP/s): " + "  ".join(
            f"{key} {ms:.3f} ({flops * (2.5 if 'bwd' in key else 1) / ms / 1e9:.0f})" for key, ms in row.items()))


STEPS = dict(merge=step_merge, backward=step_backward, diagonal=step_diagonal, ring=step_ring, timing=step_timing)

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    args = ap.parse_args()
    print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    for name in args.steps:
        print(f"--- {name}", flush=True)
        try:
            STEPS[name]()
        except Exception as e:  # a step that fails says why; the next one still runs
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
    sys.stdout.flush()
