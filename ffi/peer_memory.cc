#include "peer_memory.h"

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>

#include "driver_api.h"

namespace pk {

ExportedRegion export_region(const void* ptr) {
  ExportedRegion r;
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult cr = driver::api().mem_get_address_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
  if (cr != CUDA_SUCCESS) {
    r.why_not = "cuMemGetAddressRange failed (not device memory?)";
    return r;
  }
  r.begin = base;
  r.size = size;
  cudaIpcMemHandle_t h;
  const cudaError_t e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base));
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky; keep later checks clean
    r.why_not = std::string("cudaIpcGetMemHandle: ") + cudaGetErrorString(e);
    return r;
  }
  r.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  return r;
}

void* open_region(const std::string& handle) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) throw std::runtime_error("pk_jax: malformed IPC handle");
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("pk_jax: mapping a peer process's GPU memory failed (cudaIpcOpenMemHandle: ") +
                             cudaGetErrorString(e) +
                             "). The processes' GPUs need a peer-to-peer path (NVLink or PCIe P2P), or the ranks must "
                             "share one GPU under MPS.");
  }
  return p;
}

}  // namespace pk
