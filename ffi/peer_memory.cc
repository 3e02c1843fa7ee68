#include "peer_memory.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "driver_api.h"
#include "vmm_share.h"

namespace pk {
namespace {

// What kind of allocation `base` is, for the report when legacy IPC refuses it: a stream-ordered pool
// (cudaMallocAsync) or virtual-memory memory (cuMemCreate) and the shareable handle types it was
// created with; the next step (pool export, fd export) depends on which.
std::string describe_allocation(CUdeviceptr base) {
  const auto& d = driver::api();
  int legacy = -1;
  CUmemoryPool pool = nullptr;
  unsigned long long handle_types = 0;  // NOLINT(runtime/int): the attribute's type
  const bool has_legacy =
      d.pointer_get_attribute(&legacy, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, base) == CUDA_SUCCESS;
  const bool has_pool = d.pointer_get_attribute(&pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, base) == CUDA_SUCCESS;
  const bool has_types =
      d.pointer_get_attribute(&handle_types, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, base) == CUDA_SUCCESS;
  std::string out = "allocation: legacy-IPC capable " + (has_legacy ? std::to_string(legacy) : std::string("?"));
  out += has_pool ? (pool ? ", from a stream-ordered memory pool" : ", no memory pool") : ", pool ?";
  out += has_types ? ", shareable handle types 0x" + [&] {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%llx", handle_types);
    return std::string(buf);
  }() : std::string(", handle types ?");
  return out;
}

}  // namespace

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
    r.why_not = std::string("cudaIpcGetMemHandle: ") + cudaGetErrorString(e) + "; " + describe_allocation(base);
    return r;
  }
  r.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  r.sharing = "cuda_ipc";
  return r;
}

ExportedRegion export_xla_region(const void* ptr, uint64_t max_bytes, bool by_fd) {
  ExportedRegion r = export_region(ptr);
  if (!r.handle.empty() || r.begin == 0) return r;
  if (!by_fd) {
    r.why_not += "; POSIX-fd sharing is off (PK_JAX_FD_SHARING=0)";
    return r;
  }
  unsigned long long handle_types = 0;  // NOLINT(runtime/int): the attribute's type
  if (driver::api().pointer_get_attribute(&handle_types, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
                                          reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS ||
      !(handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    return r;  // neither legacy IPC nor POSIX fd: r.why_not says why
  vmm::Exported e;
  std::string why;
  if (!vmm::export_region(ptr, max_bytes, e, why)) {
    r.why_not += "; POSIX-fd export failed: " + why;
    return r;
  }
  r.begin = e.layout.begin;
  r.size = e.layout.size;
  r.handle = vmm::encode_descriptor(e.layout);
  r.fds = std::move(e.fds);
  r.sharing = "posix_fd";
  r.why_not.clear();
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
