"""Expert parallelism: dispatch tokens to the members holding their experts, grouped GEMMs, combine.

Reference path today (jnp routing layout, padded all-to-all, ragged_dot / a tiled scan); the fused
kernels will replace it under the same semantics (pinned by tests/test_moe_cpu.py)."""

from pk_jax.moe.dispatch import combine, dispatch
from pk_jax.moe.grouped_matmul import grouped_matmul
from pk_jax.moe.mlp import moe_mlp
from pk_jax.moe.routing import RoutingHandle, expert_capacity, worst_case_recv_rows

__all__ = ["RoutingHandle", "combine", "dispatch", "expert_capacity", "grouped_matmul", "moe_mlp",
           "worst_case_recv_rows"]
