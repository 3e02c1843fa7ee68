"""moe_mlp: an expert-parallel SwiGLU MoE layer: dispatch -> grouped gate/up -> SwiGLU -> grouped down -> combine.

The experts' FFN runs as pk_jax/moe/expert_ffn.py (GEMMs, SwiGLU and the backward on the rows in use only;
PK_JAX_MOE_EXPERT_FFN=compose composes grouped_matmul and jax.nn instead). PK_JAX_MOE_OVERLAP=1 (trace time):
dispatch and the gate/up grouped GEMMs run as one kernel where it serves (pk_jax/moe/overlap.py); same results,
the backward unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pk_jax.moe.dispatch import combine, dispatch
from pk_jax.moe import expert_ffn, overlap, routing
from pk_jax.moe.grouped_matmul import grouped_matmul
from pk_jax.sharding import group_size
from pk_jax.sharding.mesh_groups import AxisName


def moe_mlp(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
            w_down: jax.Array, axis_name: AxisName, *, capacity: int | None = None,
            recv_rows: int | None = None) -> jax.Array:
    """The routed experts' contribution of a SwiGLU MoE layer, experts sharded over `axis_name`.

    Call inside `jax.shard_map` with tokens and experts sharded over `axis_name` (G members, L experts each,
    E = L * G; member r holds experts r*L .. r*L + L - 1).

    Args:
      x: (T, H) this member's tokens.
      topk_ids: (T, K) int global expert ids in [0, E); topk_weights: (T, K) their weights (e.g. softmax
        of the chosen router logits); gradients flow to x, topk_weights and the expert weights.
      w_gate, w_up: (L, H, F) this member's experts; w_down: (L, F, H).
      capacity, recv_rows: as pk_jax.moe.dispatch (default: nothing drops).

    Returns:
      (T, H) in x's dtype: sum_k topk_weights[t, k] * (silu(x_t W_gate[e]) * (x_t W_up[e])) W_down[e] for
      e = topk_ids[t, k]; dropped choices add zero.
    """
    g = group_size(axis_name)
    local = w_gate.shape[0]
    if w_gate.ndim != 3 or w_up.shape != w_gate.shape or w_down.shape != (local, w_gate.shape[2], w_gate.shape[1]):
        raise ValueError(f"pk_jax.moe.moe_mlp: w_gate and w_up must be (L, H, F) and w_down (L, F, H), got "
                         f"{w_gate.shape}, {w_up.shape}, {w_down.shape}")
    if x.ndim != 2 or x.shape[1] != w_gate.shape[1]:
        raise ValueError(f"pk_jax.moe.moe_mlp: x must be (T, H) with H = {w_gate.shape[1]} (w_gate's dim 1), "
                         f"got {x.shape}")
    ffn = w_gate.shape[2]
    if _valid_routing_args(topk_ids, x, capacity, recv_rows) and overlap.use_overlap(
            routing.routing_sizes(g, local * g, x.shape[0], topk_ids.shape[1], capacity, recv_rows), x.shape[1], ffn,
            x.dtype):
        gate, up, counts, handle = overlap.dispatch_gate_up(x, topk_ids, w_gate, w_up, axis_name, num_experts=local * g,
                                                           capacity=capacity, recv_rows=recv_rows)
    else:  # dispatch validates the routing arguments and names the bad one
        rows_only = not expert_ffn.composed()
        # Where the FFN's kernels read only the rows in use, recv's tail (and combine's d y tail) need no zeros.
        zero_tail = not (rows_only and expert_ffn.runs_kernels(x, w_gate, w_down))
        recv, counts, handle = dispatch(x, topk_ids, axis_name, num_experts=local * g, capacity=capacity,
                                        recv_rows=recv_rows, zero_tail=zero_tail)
        if rows_only:  # only the rows in use (combine reads no others)
            return combine(expert_ffn.expert_ffn(recv, counts, w_gate, w_up, w_down), topk_weights, handle)
        gate, up = grouped_matmul(recv, w_gate, counts), grouped_matmul(recv, w_up, counts)
    hidden = jax.nn.silu(gate) * up
    return combine(grouped_matmul(hidden, w_down, counts), topk_weights, handle)


def _valid_routing_args(topk_ids: jax.Array, x: jax.Array, capacity, recv_rows) -> bool:
    """The arguments pk_jax.moe.dispatch accepts (else the unfused path runs it, which raises naming the bad one)."""
    return (topk_ids.ndim == 2 and topk_ids.shape[0] == x.shape[0] and jnp.issubdtype(topk_ids.dtype, jnp.integer)
            and (capacity is None or (isinstance(capacity, int) and capacity >= 0))
            and (recv_rows is None or (isinstance(recv_rows, int) and recv_rows >= 1)))
