"""Ring attention's block pairs on cuDNN (the default where takes() accepts a pair; $PK_JAX_RING_LOCAL=pk: our kernels).

    if takes(q, k, causal, pair.visible):
        out, lse = forward(q, k, v, scale=s, causal=causal, visible=pair.visible)
        dq, dk, dv = backward(q, k, v, out, do, lse, scale=s, causal=causal, visible=pair.visible)

Why: at 4 GPUs the ring's non-causal rows are bound by the attention kernels, and ours trail cuDNN (0.86-0.97x
fwd+bwd on H200; issue 18), so the ring at S 12288 reached 1.05x all_gather + cuDNN fwd+bwd against a 1.37x bound
(4x H200, 2026-11-26). On cuDNN, same run, S 12288 (docs/benchmarks.md, session 19): fwd 9.01 against 9.89 ms on
our kernels, causal zigzag 6.36 / 6.77, fwd+bwd 36.84 / 37.58, causal zigzag fwd+bwd 25.62 / 25.75.

The ring needs two things jax.nn.dot_product_attention does not give, so this calls JAX's cuDNN binding
(jax._src.cudnn.fused_attention_stablehlo, pinned with jax 0.11.2) directly:
- forward: each block's log-sum-exp beside its output (`return_residual=True`: cuDNN's softmax statistics, natural
  log, (B, N, Tq) float32, the layout of our kernel's LSE), to merge blocks.
- backward: each pair's gradients computed with the whole row's output and LSE, not the block's (as
  ring-flash-attention does with flash-attn): cuDNN's backward primitive fed the merged `out` and `lse`. It
  recomputes P = exp(s - lse) and delta = rowsum(dO * out), so the pairs' gradients add up.
Masks: cuDNN's causal mask is top-left aligned (row i sees keys 0..i), so a pair runs here only if it needs no
mask or is a "diagonal" pair (ring_schedule.BlockPair.visible). The "bottom_right" ones (the zigzag own q1 pair,
the bottom half of a split diagonal) run as two cuDNN calls (their fully visible keys, then their diagonal) where
they have at least SPLIT_MIN_ROWS query rows, and on our kernel below that: two calls' fixed work outweighs cuDNN's
speed on small pairs. Measured causal zigzag fwd+bwd (docs/benchmarks.md, sessions 22-23): split wins 1.7-2.7 % at
6144-row pairs, ties at 3072 on H200 (loses 3.5 % on H100), loses 2 % at 1536. cudnn-split / cudnn-whole force either
way.
cuDNN cannot leave SMs free, so it serves only where no shift kernel needs them (the copy-engine shifts:
single-process jobs; multi-process jobs keep the SM shift and so our kernels).
Precision: cuDNN returns each pair's dQ in the inputs' dtype, so it is rounded once per pair before the float32
sum (our kernel hands the ring float32 dQ).
Checked on a GPU (4x H200, 2026-11-26): `scripts/probe_cudnn_ring_block.py` (XLA compiles a cuDNN backward fed
statistics it did not produce; merge, backward, diagonal and ring at G 1 match a float32 reference to 2-3e-3) and
the ring's GPU tests on cuDNN at G 4.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pk_jax._env import choice_setting
from pk_jax.context.online_softmax import merge

LOCAL_VAR = "PK_JAX_RING_LOCAL"
LOCALS = ("pk", "cudnn", "cudnn-split", "cudnn-whole", "cudnn-fwd")
SPLIT_MIN_ROWS = 4096  # "cudnn" splits a bottom-right pair for cuDNN from this many query rows (see above)


def ring_local() -> str:
    """$PK_JAX_RING_LOCAL, read when traced: "cudnn" (default: this module wherever takes() accepts a pair; the
    "bottom_right" pairs as two cuDNN calls each from SPLIT_MIN_ROWS query rows), "pk" (our attention kernels for
    every pair), "cudnn-split" (every bottom-right pair split for cuDNN), "cudnn-whole" (none: they stay on our
    kernel) or "cudnn-fwd" (the forward's pairs as "cudnn", every backward pair on our kernel: no per-call dO.O
    pass, memsets or dQ conversion of cuDNN's backward; with $PK_JAX_RING_MERGE=dq-direct the pair adds its dQ in
    place). cudnn-fwd lost to the default on 4x H200 (2026-11-28, S 12288 fwd+bwd, dq-direct): 38.31 vs 37.33 ms,
    causal zigzag 25.47 vs 23.95; so our backward kernel is the slower one on these pairs."""
    return choice_setting(LOCAL_VAR, "cudnn", LOCALS, owner="pk_jax.ring_attention")


@functools.cache
def _max_head_dim() -> int:
    """The largest head dim cuDNN's flash attention takes here: 256 on Hopper and later, 128 before; 0 where there
    is no CUDA GPU or no cuDNN (the binding's own checks)."""
    try:
        from jax._src import xla_bridge
        from jax._src.cudnn import fused_attention_stablehlo as fa

        if "cuda" not in xla_bridge.get_backend().platform_version:
            return 0
        fa.check_cudnn_version()
        return 256 if fa.check_compute_capability("9.0") else 128
    except Exception:  # no GPU backend, ROCm, no cuDNN: our kernels serve every pair
        return 0


def _on_gpu(d: int) -> bool:
    return d <= _max_head_dim()


def takes(q: jax.Array, k: jax.Array, causal: bool, visible: str | None, rows: int | None = None, *,
          backward: bool = False) -> bool:
    """Whether cuDNN runs this pair (q (B, Tq, N, H); rows: the pair's query rows where q holds more, else Tq):
    selected, a CUDA GPU with cuDNN, 16-bit inputs, a head dim cuDNN takes (a multiple of 8, up to _max_head_dim()),
    no shift kernel needing SMs beside it, and a mask it can express (none, or causal on a diagonal pair) or split
    into two it can (a bottom-right pair, by ring_local() and its rows); backward: a pair of the backward pass
    ("cudnn-fwd" keeps those on our kernel)."""
    from pk_jax.context.ring_shift import shift_sms

    d = q.shape[-1]
    local = ring_local()
    rows = q.shape[1] if rows is None else rows
    if local == "pk" or (local == "cudnn-fwd" and backward):
        return False
    split = local == "cudnn-split" or (local in ("cudnn", "cudnn-fwd") and rows >= SPLIT_MIN_ROWS)
    masks = ("all", "diagonal", "bottom_right") if split else ("all", "diagonal")
    return (q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and d % 8 == 0
            and (not causal or visible in masks) and shift_sms() == 0 and _on_gpu(d))


def split_bottom_right(tk: int, tq: int) -> tuple[tuple[int, int, str], tuple[int, int, str]]:
    """A "bottom_right" pair's keys as two pairs cuDNN's masks express: ((start, length, visible), ...): the first
    tk - tq keys, which every query sees ("all"), and the last tq on the diagonal ("diagonal", top-left)."""
    return (0, tk - tq, "all"), (tk - tq, tq, "diagonal")


def _top_left(causal: bool, visible: str | None) -> bool:
    """cuDNN's causal mask where the pair needs one (a diagonal pair under a causal ring); none where every key is
    visible to every query."""
    return causal and visible == "diagonal"


def _cudnn_fwd(q, k, v, scale: float, top_left: bool):
    """(out in q's dtype, stats (B, N, Tq) float32): cuDNN's forward with its softmax statistics."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    mask = fa.MaskType.CAUSAL if top_left else fa.MaskType.NO_MASK
    return fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask, return_residual=True)


def _cudnn_bwd(q, k, v, out, stats, do, scale: float, top_left: bool):
    """(dq, dk, dv) in the inputs' dtype: cuDNN's backward primitive with the given output and statistics."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    unused = jnp.zeros(0, q.dtype)
    mask = fa.MaskType.CAUSAL if top_left else fa.MaskType.NO_MASK
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, unused, unused, unused, unused, unused, unused, stats, out, do, scale=scale, seed=42,
        dropout_rate=0.0, variadic_args=(False, False), mask_type=mask, layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=None)
    return tuple(grads[:3])


def forward(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, causal: bool,
            visible: str | None) -> tuple[jax.Array, jax.Array]:
    """One pair: (out (B, Tq, N, H) in q's dtype, lse (B, Tq, N) float32), as ring._block_forward returns. A
    "bottom_right" pair: two calls (split_bottom_right) merged by their LSE."""
    if causal and visible == "bottom_right":
        (o_a, l_a), (o_b, l_b) = (forward(q, k[:, a:a + n], v[:, a:a + n], scale=scale, causal=True, visible=vis)
                                  for a, n, vis in split_bottom_right(k.shape[1], q.shape[1]))
        out, lse = merge(o_a.astype(jnp.float32), l_a, o_b.astype(jnp.float32), l_b)
        return out.astype(q.dtype), lse
    out, stats = _cudnn_fwd(q, k, v, scale, _top_left(causal, visible))
    return out, jnp.swapaxes(stats, 1, 2)


def backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, do: jax.Array, lse: jax.Array, *,
             scale: float, causal: bool, visible: str | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One pair's (dq, dk, dv) from the whole row's out (B, Tq, N, H) and lse (B, Tq, N): dq as cuDNN wrote it (q's
    dtype; the caller widens it inside the add that takes it, so no float32 copy of each pair's dQ is written: 0.1-0.4
    ms per pair on 4x H100, session 21), dk and dv in k's dtype. A "bottom_right" pair: two calls
    (split_bottom_right), dQ summed in float32, dK/dV of their key rows concatenated."""
    if causal and visible == "bottom_right":
        parts = [backward(q, k[:, a:a + n], v[:, a:a + n], out, do, lse, scale=scale, causal=True, visible=vis)
                 for a, n, vis in split_bottom_right(k.shape[1], q.shape[1])]
        (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = parts
        return (dq_a.astype(jnp.float32) + dq_b.astype(jnp.float32), jnp.concatenate([dk_a, dk_b], axis=1),
                jnp.concatenate([dv_a, dv_b], axis=1))
    dq, dk, dv = _cudnn_bwd(q, k, v, out.astype(q.dtype), jnp.swapaxes(lse, 1, 2), do.astype(q.dtype), scale,
                            _top_left(causal, visible))
    return dq, dk, dv
