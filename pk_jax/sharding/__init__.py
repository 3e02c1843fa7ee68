"""How pk_jax ops find their communication group in a mesh (shard_map) at lowering time, and
sequence layouts for context parallelism."""

from pk_jax.sharding.mesh_groups import GroupTable, group_size, group_table, normalize_axis_name
from pk_jax.sharding.zigzag import from_zigzag, to_zigzag, zigzag_chunk_order

__all__ = ["GroupTable", "from_zigzag", "group_size", "group_table", "normalize_axis_name", "to_zigzag",
           "zigzag_chunk_order"]
