"""How pk_jax ops find their communication group in a mesh (shard_map) at lowering time."""

from pk_jax.sharding.mesh_groups import GroupTable, group_size, group_table, normalize_axis_name

__all__ = ["GroupTable", "group_size", "group_table", "normalize_axis_name"]
