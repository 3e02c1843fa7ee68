#include "group_builder.h"

#include "group_resolver.h"

namespace pk {

std::string build_group(int32_t ordinal, int32_t op, const int64_t* mesh_ids, size_t n_ids,
                        const int64_t* mesh_shape, size_t n_dims, const int64_t* group_axes, size_t n_axes,
                        Group& g, const LocalDevice*& me, bool& invalid) {
  invalid = false;
  Runtime& rt = Runtime::get();
  if (!rt.initialized()) return "pk_jax: runtime not initialized (import pk_jax first)";
  const std::string pending = rt.first_error();
  if (!pending.empty()) return pending;
  me = rt.by_ordinal(ordinal);
  if (!me) return "pk_jax: GPU " + std::to_string(ordinal) + " is not managed by pk_jax";
  std::string error;
  const GroupMembers members =
      resolve_group(me->global_id, mesh_ids, n_ids, mesh_shape, n_dims, group_axes, n_axes, error);
  if (!error.empty()) return "pk_jax: " + error;
  if (members.ids.size() < 2 || members.ids.size() > size_t(kMaxGroup)) {
    invalid = true;
    return "pk_jax: group size must be 2.." + std::to_string(kMaxGroup);
  }
  g = Group{};
  g.rank = members.rank;
  g.size = int32_t(members.ids.size());
  g.op = op;
  g.timeout_ns = rt.timeout_ns();
  g.err = me->err;
  for (int r = 0; r < g.size; ++r) {
    const Member* m = rt.member(members.ids[r]);
    if (!m)
      return "pk_jax: device id " + std::to_string(members.ids[r]) +
             " is not on this host's NVLink domain (call pk_jax.initialize() in every process of a "
             "jax.distributed job; axes that cross hosts run jax.lax)";
    g.ctrl[r] = m->ctrl;
    g.slot[r] = m->slot;
  }
  // Published addresses as each member sees them (multi-process; empty in one process).
  g.map.n = int32_t(me->regions.size());
  if (g.map.n > kMaxRegions) return "pk_jax: too many shared memory regions on one device";
  for (int i = 0; i < g.map.n; ++i) {
    g.map.begin[i] = me->regions[i].begin;
    g.map.end[i] = me->regions[i].end;
    for (int r = 0; r < g.size; ++r) g.map.delta[i][r] = me->regions[i].delta[g.slot[r]];
  }
  return "";
}

}  // namespace pk
