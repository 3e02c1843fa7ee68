"""The fastest `jax.nn.dot_product_attention` for a call: cuDNN where it takes the call, else XLA.

jax 0.11.2's `jax.nn.dot_product_attention(implementation=None)` always runs XLA's unfused composition (two
GEMMs around a materialized softmax; its source says "defaults to XLA for now"). On an H200 that is ~4x slower
than cuDNN (Ulysses at G 2, S 8192, B16 N128 D128: 30 ms per 16-head chunk against ~7.5, 2026-11-27). pk_jax's
ops that run a library attention between their exchanges (`ulysses_attention`, `attention`'s fallback) call
this instead, so their default is the fast path a user would pick.
"""

from __future__ import annotations

import functools
import warnings

import jax

# What jax's cuDNN path raises at trace time for a call it does not take (a dtype, head dim or layout it lacks,
# no cuDNN or an old one).
_REFUSALS = (ValueError, NotImplementedError, RuntimeError, TypeError)


@functools.cache
def _note_xla(why: str) -> None:
    warnings.warn(f"pk_jax: cuDNN attention refused this call ({why}); it runs XLA's attention instead", stacklevel=4)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None,
                          is_causal: bool = False, implementation: str | None = None) -> jax.Array:
    """`jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, implementation=...)`.

    q: (B, Tq, N, H); k, v: (B, Tk, K, H), K dividing N; returns (B, Tq, N, H) in q's dtype.
    implementation: "cudnn" or "xla" as jax takes them; None: cuDNN when the default backend is a GPU and
    jax's cuDNN path accepts the call at trace time, else XLA (saying why once).
    """
    if implementation is None and jax.default_backend() == "gpu":
        try:
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, implementation="cudnn")
        except _REFUSALS as e:
            _note_xla(f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, implementation=implementation)
