// The few CUDA driver entry points the runtime needs (virtual memory management, TMA tensor maps). Resolved at run
// time through the runtime API, so the extension never links libcuda (absent on CPU-only machines).
#pragma once
#include <cuda.h>

namespace pk::driver {

struct Api {
  decltype(&cuMemCreate) mem_create;
  decltype(&cuMemRelease) mem_release;
  decltype(&cuMemGetAllocationGranularity) mem_get_allocation_granularity;
  decltype(&cuMemAddressReserve) mem_address_reserve;
  decltype(&cuMemAddressFree) mem_address_free;
  decltype(&cuMemMap) mem_map;
  decltype(&cuMemUnmap) mem_unmap;
  decltype(&cuMemSetAccess) mem_set_access;
  decltype(&cuGetErrorString) get_error_string;
  decltype(&cuTensorMapEncodeTiled) tensor_map_encode_tiled;
  decltype(&cuMemGetAddressRange) mem_get_address_range;
  decltype(&cuPointerGetAttribute) pointer_get_attribute;
};

// Loads the entry points once; throws std::runtime_error naming a missing one.
const Api& api();

// The multicast entry points (NVLink SHARP / multimem). Separate from Api and resolved only on the first
// multicast_api() call, i.e. only when multicast was requested: a driver without them must not break init.
struct MulticastApi {
  decltype(&cuMulticastGetGranularity) multicast_get_granularity;
  decltype(&cuMulticastCreate) multicast_create;
  decltype(&cuMulticastAddDevice) multicast_add_device;
  decltype(&cuMulticastBindMem) multicast_bind_mem;
  decltype(&cuMulticastUnbind) multicast_unbind;
  decltype(&cuMemExportToShareableHandle) mem_export_to_shareable_handle;
  decltype(&cuMemImportFromShareableHandle) mem_import_from_shareable_handle;
  decltype(&cuDeviceGetAttribute) device_get_attribute;
  decltype(&cuDeviceGet) device_get;
};

// Loads the multicast entry points once; throws std::runtime_error naming a missing one (and keeps
// throwing on later calls, so a caller can fall back to peer-to-peer).
const MulticastApi& multicast_api();

// The entry points that share virtual-memory (cuMemCreate) allocations between processes by POSIX fd
// (XLA's allocator region, ffi/vmm_share.h). Separate from Api and resolved on the first share_api() call,
// so a driver without one of them only turns that sharing off (the caller falls back to staging).
struct ShareApi {
  decltype(&cuMemRetainAllocationHandle) mem_retain_allocation_handle;
  decltype(&cuMemGetAllocationPropertiesFromHandle) mem_get_allocation_properties_from_handle;
  decltype(&cuMemExportToShareableHandle) mem_export_to_shareable_handle;
  decltype(&cuMemImportFromShareableHandle) mem_import_from_shareable_handle;
  decltype(&cuDeviceGet) device_get;
};

// Loads the sharing entry points once; throws std::runtime_error naming a missing one (on every call).
const ShareApi& share_api();

// Throws std::runtime_error with the driver's message.
void check(CUresult r, const char* what);

}  // namespace pk::driver
