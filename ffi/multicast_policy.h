// NVLink multicast can take a shared host's GPUs out of service, so it is off unless explicitly
// requested, and refused whenever the machine says so. Every transport decision goes through here.
#pragma once
#include <functional>
#include <string>

namespace pk {

struct MulticastPolicy {
  bool allowed;
  std::string reason;
};

// Allowed only with PK_JAX_ENABLE_MULTICAST=1 and none of NCCL_NVLS_ENABLE=0,
// NVSHMEM_DISABLE_NVLS=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 set. The default is peer-to-peer.
// `getenv` looks a variable up (nullptr: unset): tests decide policies of environments they describe,
// so no test ever sets the opt-in in the real environment.
MulticastPolicy multicast_policy_of(const std::function<const char*(const char*)>& getenv);
// The policy of this process's environment.
MulticastPolicy multicast_policy();

}  // namespace pk
