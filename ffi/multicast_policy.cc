#include "multicast_policy.h"

#include <cstdlib>
#include <cstring>

namespace pk {

MulticastPolicy multicast_policy_of(const std::function<const char*(const char*)>& getenv) {
  const auto env_is = [&](const char* name, const char* value) {
    const char* v = getenv(name);
    return v != nullptr && std::strcmp(v, value) == 0;
  };
  if (env_is("NCCL_NVLS_ENABLE", "0")) return {false, "NCCL_NVLS_ENABLE=0 is set"};
  if (env_is("NVSHMEM_DISABLE_NVLS", "1")) return {false, "NVSHMEM_DISABLE_NVLS=1 is set"};
  if (env_is("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")) return {false, "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set"};
  if (!env_is("PK_JAX_ENABLE_MULTICAST", "1")) return {false, "not requested (PK_JAX_ENABLE_MULTICAST is not 1)"};
  return {true, "requested by PK_JAX_ENABLE_MULTICAST=1"};
}

MulticastPolicy multicast_policy() {
  return multicast_policy_of([](const char* name) -> const char* { return std::getenv(name); });
}

}  // namespace pk
