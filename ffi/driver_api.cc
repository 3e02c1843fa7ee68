#include "driver_api.h"

#include <cuda_runtime.h>
#include <mutex>
#include <stdexcept>
#include <string>

namespace pk::driver {
namespace {

// `version`: the CUDA version whose ABI of the entry point we call (12.0; multicast appeared in 12.1).
template <typename F>
void resolve(F& fn, const char* name, unsigned version = 12000) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status;
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &status);
  if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || p == nullptr)
    throw std::runtime_error(std::string("pk_jax: CUDA driver entry point ") + name + " is unavailable");
  fn = reinterpret_cast<F>(p);
}

}  // namespace

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    resolve(a.mem_create, "cuMemCreate");
    resolve(a.mem_release, "cuMemRelease");
    resolve(a.mem_get_allocation_granularity, "cuMemGetAllocationGranularity");
    resolve(a.mem_address_reserve, "cuMemAddressReserve");
    resolve(a.mem_address_free, "cuMemAddressFree");
    resolve(a.mem_map, "cuMemMap");
    resolve(a.mem_unmap, "cuMemUnmap");
    resolve(a.mem_set_access, "cuMemSetAccess");
    resolve(a.get_error_string, "cuGetErrorString");
    resolve(a.tensor_map_encode_tiled, "cuTensorMapEncodeTiled");
    resolve(a.mem_get_address_range, "cuMemGetAddressRange");
    resolve(a.pointer_get_attribute, "cuPointerGetAttribute");
  });
  return a;
}

const MulticastApi& multicast_api() {
  static MulticastApi a;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      resolve(a.multicast_get_granularity, "cuMulticastGetGranularity", 12010);
      resolve(a.multicast_create, "cuMulticastCreate", 12010);
      resolve(a.multicast_add_device, "cuMulticastAddDevice", 12010);
      resolve(a.multicast_bind_mem, "cuMulticastBindMem", 12010);
      resolve(a.multicast_unbind, "cuMulticastUnbind", 12010);
      resolve(a.mem_export_to_shareable_handle, "cuMemExportToShareableHandle");
      resolve(a.mem_import_from_shareable_handle, "cuMemImportFromShareableHandle");
      resolve(a.device_get_attribute, "cuDeviceGetAttribute");
      resolve(a.device_get, "cuDeviceGet");
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  if (!error.empty()) throw std::runtime_error(error);
  return a;
}

const ShareApi& share_api() {
  static ShareApi a;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      resolve(a.mem_retain_allocation_handle, "cuMemRetainAllocationHandle");
      resolve(a.mem_get_allocation_properties_from_handle, "cuMemGetAllocationPropertiesFromHandle");
      resolve(a.mem_export_to_shareable_handle, "cuMemExportToShareableHandle");
      resolve(a.mem_import_from_shareable_handle, "cuMemImportFromShareableHandle");
      resolve(a.device_get, "cuDeviceGet");
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  if (!error.empty()) throw std::runtime_error(error);
  return a;
}

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* msg = "unknown error";
  api().get_error_string(r, &msg);
  throw std::runtime_error(std::string("pk_jax: ") + what + ": " + msg);
}

}  // namespace pk::driver
