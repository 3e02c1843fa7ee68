"""Sharding support: mesh → group tables for the ops inside shard_map (mesh_groups), matmuls for plain
`jax.jit` that pick AG+GEMM / GEMM+RS / GEMM+AR from the partitioner's shardings (jit_matmul), and sequence
layouts for context parallelism (zigzag)."""

from pk_jax.sharding.mesh_groups import GroupTable, group_size, group_table, normalize_axis_name
from pk_jax.sharding.jit_matmul import decisions, matmul
from pk_jax.sharding.jit_einsum import einsum
from pk_jax.sharding.matmul_decision import MatmulDecision, decide
from pk_jax.sharding.zigzag import from_zigzag, to_zigzag, zigzag_chunk_order

__all__ = ["GroupTable", "MatmulDecision", "decide", "decisions", "einsum", "from_zigzag", "group_size",
           "group_table", "matmul", "normalize_axis_name", "to_zigzag", "zigzag_chunk_order"]
