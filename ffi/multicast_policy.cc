#include "multicast_policy.h"

#include <cstdlib>
#include <cstring>

namespace pk {
namespace {

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}

}  // namespace

MulticastPolicy multicast_policy() {
  if (env_is("NCCL_NVLS_ENABLE", "0")) return {false, "NCCL_NVLS_ENABLE=0 is set"};
  if (env_is("NVSHMEM_DISABLE_NVLS", "1")) return {false, "NVSHMEM_DISABLE_NVLS=1 is set"};
  if (env_is("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")) return {false, "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set"};
  if (!env_is("PK_JAX_ENABLE_MULTICAST", "1")) return {false, "not requested (PK_JAX_ENABLE_MULTICAST is not 1)"};
  return {true, "requested by PK_JAX_ENABLE_MULTICAST=1"};
}

}  // namespace pk
