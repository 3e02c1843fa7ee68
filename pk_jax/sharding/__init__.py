"""Sharding support: mesh → group tables for the ops inside shard_map (mesh_groups), and matmuls for
plain `jax.jit` that pick AG+GEMM / GEMM+RS / GEMM+AR from the partitioner's shardings (jit_matmul)."""

from pk_jax.sharding.mesh_groups import GroupTable, group_size, group_table, normalize_axis_name
from pk_jax.sharding.jit_matmul import decisions, matmul
from pk_jax.sharding.jit_einsum import einsum
from pk_jax.sharding.matmul_decision import MatmulDecision, decide

__all__ = ["GroupTable", "MatmulDecision", "decide", "decisions", "einsum", "group_size", "group_table", "matmul",
           "normalize_axis_name"]
