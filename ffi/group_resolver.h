// Which devices form this device's group, and its rank, from the mesh device table carried in the
// op's attributes and the device ordinal XLA runs the handler on (the rank is never baked into HLO:
// every device runs the same program).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace pk {

struct GroupMembers {
  std::vector<int64_t> ids;  // global device ids by rank
  int rank = -1;
};

// mesh_ids: device ids in row-major mesh order; group_axes: the mesh axes the collective runs over,
// major first (the order lax.axis_index uses for a tuple of axis names). Returns an error message
// in `error` (and empty members) when the device is not in the mesh.
GroupMembers resolve_group(int64_t my_id, const int64_t* mesh_ids, size_t n_ids, const int64_t* mesh_shape,
                           size_t n_dims, const int64_t* group_axes, size_t n_axes, std::string& error);

}  // namespace pk
