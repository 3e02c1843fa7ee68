// Turning CUDA return codes into exceptions with the failing call named.
#pragma once
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>

namespace pk {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace pk

#define PK_CUDA(call) ::pk::cuda_check((call), #call)
