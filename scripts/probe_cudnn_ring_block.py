"""Can ring attention run its block pairs on cuDNN? A one-GPU probe (run it on a device; ~1 min).

The ring needs two things cuDNN's JAX binding does not offer through jax.nn.dot_product_attention:
  1. each block's log-sum-exp beside its output (to merge blocks): the internal
     `fused_attention_stablehlo.dot_product_attention(..., return_residual=True)`;
  2. each pair's backward with the *merged* output and LSE of the whole row (ring-flash-attention's scheme):
     the internal cuDNN backward primitive fed an output and softmax statistics that XLA computed, not the
     ones its forward call produced. On 4x H200 (2026-11-26) XLA 0.11.2 segfaulted compiling a program where
     a cuDNN forward's residuals had users besides its backward, so this may not compile.
Steps (each prints OK or the error; run under `python -X faulthandler` so a crash names its step):
  merge     two key halves' outputs and LSEs merged vs attention over the whole keys (LSE units, layout)
  backward  each half's backward with the merged output and LSE; dQ summed, dK/dV concatenated, vs jax.vjp
  causal    the same with the diagonal half causal (the zigzag ring's diagonal pairs)
  timing    per-block fwd and bwd ms at the ring's block shapes: cuDNN (this route) vs our kernels

    python -X faulthandler scripts/probe_cudnn_ring_block.py [--steps merge backward causal timing]
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fa


def cudnn_fwd(q, k, v, scale, causal):
    """(out in q's dtype, stats as cuDNN returns them)."""
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    out, stats = fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask, return_residual=True)
    return out, stats


def cudnn_bwd(q, k, v, out, stats, d_out, scale, causal):
    """dq, dk, dv of one block with a given output and statistics (the whole row's, in the ring)."""
    nu = jnp.zeros(0, q.dtype)
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, nu, nu, nu, nu, nu, nu, nu, stats, out, d_out, scale=scale, seed=42, dropout_rate=0.0,
        variadic_args=(False, False), mask_type=mask, layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=None)
    return grads[:3]


def data(b, t, n, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(kk, (b, t, n, d), jnp.float32).astype(jnp.bfloat16) for kk in ks]


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def merged(q, k, v, scale, causal_second):
    """Both halves of the keys attended separately, merged by their LSEs: (out f32, lse (B, N, T) like cuDNN's
    statistics). causal_second: rows t.. see keys t.. causally, rows < t none of them."""
    t = k.shape[1] // 2
    o0, s0 = cudnn_fwd(q, k[:, :t], v[:, :t], scale, False)
    o1, s1 = cudnn_fwd(q[:, t:] if causal_second else q, k[:, t:], v[:, t:], scale, causal_second)
    if causal_second:
        s1 = jnp.concatenate([jnp.full(s1.shape, -jnp.inf, s1.dtype), s1], axis=2)
        o1 = jnp.concatenate([jnp.zeros_like(o1), o1], axis=1)
    lse = jnp.logaddexp(s0, s1)
    w = lambda s: jnp.swapaxes(jnp.exp(s - lse), 1, 2)[..., None]  # (B, T, N, 1)
    return o0.astype(jnp.float32) * w(s0) + o1.astype(jnp.float32) * w(s1), lse


def step_merge(args):
    q, k, v, _ = data(2, 1024, 8, 128)
    scale = 1 / math.sqrt(128)
    whole, stats = jax.jit(lambda q, k, v: cudnn_fwd(q, k, v, scale, False))(q, k, v)
    print("stats shape", stats.shape, stats.dtype, "(q", q.shape, ")")
    out, lse = jax.jit(lambda q, k, v: merged(q, k, v, scale, False))(q, k, v)
    print(f"merge: out rel {rel(out, whole):.2e}, lse rel {rel(lse, stats):.2e}  (both ~1e-3 or less: OK)")


def _pair_grads(q, k, v, d_out, scale, causal_second):
    t = k.shape[1] // 2
    out, lse = merged(q, k, v, scale, causal_second)
    out = out.astype(q.dtype)
    dq0, dk0, dv0 = cudnn_bwd(q, k[:, :t], v[:, :t], out, lse, d_out, scale, False)
    if causal_second:
        sl = (slice(None), slice(t, None))
        dq1, dk1, dv1 = cudnn_bwd(q[sl], k[:, t:], v[:, t:], out[sl], lse[:, :, t:], d_out[sl], scale, True)
        dq1 = jnp.concatenate([jnp.zeros_like(dq1), dq1], axis=1)
    else:
        dq1, dk1, dv1 = cudnn_bwd(q, k[:, t:], v[:, t:], out, lse, d_out, scale, False)
    return (dq0.astype(jnp.float32) + dq1.astype(jnp.float32), jnp.concatenate([dk0, dk1], 1),
            jnp.concatenate([dv0, dv1], 1))


def _check_backward(causal_second: bool):
    q, k, v, d_out = data(2, 1024, 8, 128, seed=1)
    scale = 1 / math.sqrt(128)
    t = k.shape[1] // 2
    if causal_second:  # the reference: rows < t see keys < t; rows >= t see keys < t and keys t.. causally
        rows = jnp.arange(q.shape[1])[:, None]
        cols = jnp.arange(k.shape[1])[None, :]
        mask = (cols < t) | (rows >= cols)
    else:
        mask = None
    ref = lambda q, k, v: jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                                       v.astype(jnp.float32), scale=scale,
                                                       mask=None if mask is None else mask[None, None])
    _, vjp = jax.vjp(ref, q, k, v)
    want = vjp(d_out.astype(jnp.float32))
    got = jax.jit(lambda *a: _pair_grads(*a, scale, causal_second))(q, k, v, d_out)
    errs = [rel(g, w) for g, w in zip(got, want)]
    print(f"{'causal' if causal_second else 'backward'}: dq / dk / dv rel {errs[0]:.2e} / {errs[1]:.2e} / "
          f"{errs[2]:.2e}  (<= ~1e-2 for bf16: OK)")


def step_backward(args):
    _check_backward(False)


def step_causal(args):
    _check_backward(True)


def _time(f, *a, reps=20):
    r = f(*a)
    jax.block_until_ready(r)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(5):
            r = f(*a)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t0) / 5 * 1e3)
    return float(np.median(ts))


def step_timing(args):
    import pk_jax

    for b, t, n in ((16, 3072, 16), (16, 6144, 16)):  # a block of the 4- and 2-GPU ring at S 12288
        q, k, v, d_out = data(b, t, n, 128, seed=2)
        scale = 1 / math.sqrt(128)
        fwd = jax.jit(lambda q, k, v: cudnn_fwd(q, k, v, scale, False))
        out, stats = fwd(q, k, v)
        bwd = jax.jit(lambda *a: cudnn_bwd(*a, scale, False))
        ours_fwd = jax.jit(lambda q, k, v: pk_jax.attention(q, k, v, return_lse=True, implementation="pk"))
        ours_fb = jax.jit(jax.grad(lambda q, k, v: jnp.sum(pk_jax.attention(q, k, v, implementation="pk")
                                                           .astype(jnp.float32) * d_out), (0, 1, 2)))
        cudnn_fb = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn").astype(jnp.float32) * d_out), (0, 1, 2)))
        row = dict(cudnn_fwd=_time(fwd, q, k, v), cudnn_bwd_given_stats=_time(bwd, q, k, v, out, stats, d_out),
                   cudnn_fwd_bwd=_time(cudnn_fb, q, k, v), ours_fwd=_time(ours_fwd, q, k, v),
                   ours_fwd_bwd=_time(ours_fb, q, k, v))
        print(f"timing B{b} T{t} N{n} D128 (ms, median of 20 x 5 calls): " +
              "  ".join(f"{key} {val:.3f}" for key, val in row.items()))


STEPS = dict(merge=step_merge, backward=step_backward, causal=step_causal, timing=step_timing)

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    args = ap.parse_args()
    print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    for name in args.steps:
        print(f"--- {name}", flush=True)
        try:
            STEPS[name](args)
        except Exception as e:  # a step that fails says why; the next still runs
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    sys.stdout.flush()
