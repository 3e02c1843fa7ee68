// The one place that chooses between the multimem (NVLink multicast) and the peer-to-peer transport for
// a collective, with the reason. Pure host logic: unit-tested on CPU through the extension.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "multicast_policy.h"

namespace pk {

struct TransportPlanInput {
  MulticastPolicy policy;        // multicast_policy()
  int group_size = 0;            // members of the group
  std::vector<bool> supported;   // CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED of each member, by rank
  int num_hosts = 1;             // hosts the group spans (an fd exchange reaches one host only)
  size_t nbytes = 0;             // the message, bytes per member
  size_t region_bytes = 0;       // bytes per member of the group's multicast region (SIZE_MAX: not limiting)
};

struct TransportPlan {
  bool multimem;       // false: peer_to_peer
  std::string reason;
  const char* name() const { return multimem ? "multimem" : "peer_to_peer"; }
};

// The policy's refusal always wins; then the group, the devices, the layout and the message decide.
// Throws std::invalid_argument when `supported` does not list group_size members.
TransportPlan plan_transport(const TransportPlanInput& in);

}  // namespace pk
