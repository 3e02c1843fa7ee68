"""Expert parallelism: dispatch tokens to the members holding their experts, grouped GEMMs, combine.

dispatch / combine run fused kernels on GPUs (pk_jax/moe/fused.py: counts and rows exchanged inside one
kernel per op) and the reference exchange (padded pk_jax.all_to_all) elsewhere or with
PK_JAX_MOE_DISPATCH=reference, under the same semantics (pinned by tests/test_moe_cpu.py; docs/design-moe.md)."""

from pk_jax.moe.dispatch import combine, dispatch
from pk_jax.moe.grouped_matmul import grouped_matmul
from pk_jax.moe.mlp import moe_mlp
from pk_jax.moe.routing import RoutingHandle, expert_capacity, worst_case_recv_rows

__all__ = ["RoutingHandle", "combine", "dispatch", "expert_capacity", "grouped_matmul", "moe_mlp",
           "worst_case_recv_rows"]
