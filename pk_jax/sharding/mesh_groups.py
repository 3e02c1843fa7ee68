"""Mesh → group tables.

An op over `axis_name` inside `shard_map` talks to the devices that differ from it only along those
mesh axes. The lowering embeds the mesh's device ids (row-major) and the group's axis positions in
the custom call; each GPU finds its own position and rank at run time from its device ordinal, so
the HLO is identical on every device (SPMD) and never carries a rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence

from jax._src import core
from jax._src import mesh as mesh_lib
from jax._src import sharding_impls

AxisName = Hashable | tuple[Hashable, ...]


def normalize_axis_name(axis_name: AxisName) -> tuple[Hashable, ...]:
    """`'tp'` → `('tp',)`; tuples pass through (major axis first, as in jax.lax)."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def group_size(axis_name: AxisName, *, arg_name: str = "axis_name") -> int:
    """Size of the group at trace time; raises a NameError naming the unknown axis."""
    size = 1
    for name in normalize_axis_name(axis_name):
        try:
            size *= core.get_axis_env().axis_size(name)
        except NameError:
            raise NameError(
                f"pk_jax: {arg_name}={name!r} is not a mesh axis in scope. Call pk_jax ops inside "
                f"jax.shard_map over a mesh with that axis name.") from None
    return size


@dataclasses.dataclass(frozen=True)
class GroupTable:
    mesh_ids: tuple[int, ...]    # device ids, row-major over the mesh
    mesh_shape: tuple[int, ...]
    group_axes: tuple[int, ...]  # mesh axis positions of the group, major first
    all_local: bool              # every mesh device belongs to this process

    def members(self, device_id: int) -> tuple[list[int], int]:
        """(member ids by rank, rank) of `device_id` — the same walk as ffi/group_resolver.cc."""
        pos = self.mesh_ids.index(device_id)
        coord = list(_unravel(pos, self.mesh_shape))
        ids, rank = [], -1
        extents = [self.mesh_shape[a] for a in self.group_axes]
        for k in range(math.prod(extents)):
            c = list(coord)
            for a, i in zip(self.group_axes, _unravel(k, extents)):
                c[a] = i
            ids.append(self.mesh_ids[_ravel(c, self.mesh_shape)])
            if c == coord:
                rank = k
        return ids, rank


def _unravel(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(index % n)
        index //= n
    return tuple(reversed(out))


def _ravel(coord: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for c, n in zip(coord, shape):
        index = index * n + c
    return index


def _concrete_mesh(axis_context) -> mesh_lib.Mesh | None:
    mesh = getattr(axis_context, "mesh", None)
    if isinstance(mesh, mesh_lib.Mesh) and mesh.devices.size:
        return mesh
    mesh = mesh_lib.get_concrete_mesh()
    if isinstance(mesh, mesh_lib.Mesh) and mesh.devices.size:
        return mesh
    return None


def group_table(axis_context, axis_name: AxisName) -> GroupTable | None:
    """The group table for the lowering context, or None when no concrete mesh is known (an
    abstract mesh without `jax.set_mesh`), in which case the op lowers to jax.lax."""
    if not isinstance(axis_context, sharding_impls.SPMDAxisContext):
        return None
    mesh = _concrete_mesh(axis_context)
    if mesh is None:
        return None
    names = list(mesh.axis_names)
    axes = tuple(names.index(n) for n in normalize_axis_name(axis_name))
    local = {d.id for d in mesh.local_devices}
    ids = tuple(int(d.id) for d in mesh.devices.flat)
    return GroupTable(ids, tuple(mesh.devices.shape), axes, all(i in local for i in ids))
