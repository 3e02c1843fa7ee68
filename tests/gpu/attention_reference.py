"""Float32 numpy attention (the tests' ground truth, independent of pk_jax's XLA path): q (B, Tq, N, D),
k and v (B, Tk, K, D), K dividing N; causal masks by global positions (row q_offset + i sees key
kv_offset + j when q_offset + i >= kv_offset + j). A row that sees no key: out 0, lse -inf."""

from __future__ import annotations

import numpy as np


def attention_f32(q, k, v, *, scale: float, causal: bool, q_offset: int = 0,
                  kv_offset: int = 0, xp=np) -> tuple[np.ndarray, np.ndarray]:
    """-> (out (B, Tq, N, D) float32, lse (B, N, Tq) float32). xp=jax.numpy: differentiable."""
    np = xp  # noqa: F811 (the same code, numpy or jax.numpy)
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    b, tq, n, d = q.shape
    group = n // k.shape[2]
    kk = np.repeat(k, group, axis=2)  # query head h reads kv head h // group
    vv = np.repeat(v, group, axis=2)
    s = np.einsum("bqnd,bknd->bnqk", q, kk) * scale
    if causal:
        rows = q_offset + np.arange(tq)[:, None]
        cols = kv_offset + np.arange(k.shape[1])[None, :]
        s = np.where(rows >= cols, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    out = np.einsum("bnqk,bknd->bqnd", p / np.where(l > 0, l, 1.0), vv)
    lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    return out, lse
