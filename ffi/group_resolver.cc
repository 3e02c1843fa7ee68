#include "group_resolver.h"

namespace pk {

GroupMembers resolve_group(int64_t my_id, const int64_t* mesh_ids, size_t n_ids, const int64_t* mesh_shape,
                           size_t n_dims, const int64_t* group_axes, size_t n_axes, std::string& error) {
  GroupMembers g;
  size_t pos = n_ids;
  for (size_t i = 0; i < n_ids; ++i)
    if (mesh_ids[i] == my_id) pos = i;
  if (pos == n_ids) {
    error = "device id " + std::to_string(my_id) + " is not in the op's mesh";
    return g;
  }
  std::vector<int64_t> coord(n_dims);
  for (size_t d = n_dims, rest = pos; d-- > 0;) {
    coord[d] = int64_t(rest) % mesh_shape[d];
    rest /= mesh_shape[d];
  }
  int64_t size = 1;
  for (size_t a = 0; a < n_axes; ++a) size *= mesh_shape[group_axes[a]];
  for (int64_t k = 0; k < size; ++k) {
    std::vector<int64_t> c = coord;
    bool me = true;
    for (size_t a = n_axes, rest = size_t(k); a-- > 0;) {
      const int64_t ax = group_axes[a];
      c[ax] = int64_t(rest) % mesh_shape[ax];
      rest /= mesh_shape[ax];
      me = me && c[ax] == coord[ax];
    }
    int64_t linear = 0;
    for (size_t d = 0; d < n_dims; ++d) linear = linear * mesh_shape[d] + c[d];
    g.ids.push_back(mesh_ids[linear]);
    if (me) g.rank = int(k);
  }
  return g;
}

}  // namespace pk
