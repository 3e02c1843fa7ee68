#include "multicast_plan.h"

#include <stdexcept>

#include "../kernels/pk/control_block.h"

namespace pk {

TransportPlan plan_transport(const TransportPlanInput& in) {
  if (int(in.supported.size()) != in.group_size)
    throw std::invalid_argument("supported lists " + std::to_string(in.supported.size()) +
                                " devices for a group of " + std::to_string(in.group_size) +
                                "; pass one flag per member");
  if (!in.policy.allowed) return {false, "multicast refused: " + in.policy.reason};
  if (in.group_size < 2 || in.group_size > kMaxGroup)
    return {false, "multimem needs a group of 2.." + std::to_string(kMaxGroup) + " GPUs, got " +
                       std::to_string(in.group_size)};
  for (int r = 0; r < in.group_size; ++r)
    if (!in.supported[r])
      return {false, "member " + std::to_string(r) + "'s GPU reports no multicast support"};
  if (in.num_hosts != 1)
    return {false, "the group spans " + std::to_string(in.num_hosts) +
                       " hosts; multicast handles are exchanged within one host only"};
  if (in.nbytes == 0) return {false, "an empty message moves nothing"};
  if (in.nbytes % 16 != 0)
    return {false, "multimem kernels move 16-byte vectors; " + std::to_string(in.nbytes) +
                       " bytes is not a multiple of 16"};
  if (in.nbytes > in.region_bytes)
    return {false, std::to_string(in.nbytes) + " bytes exceed the multicast region (" +
                       std::to_string(in.region_bytes) + " bytes per GPU)"};
  return {true, "multicast requested and supported by all " + std::to_string(in.group_size) +
                    " GPUs (path unmeasured on hardware)"};
}

}  // namespace pk
