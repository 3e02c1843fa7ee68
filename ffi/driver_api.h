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
};

// Loads the entry points once; throws std::runtime_error naming a missing one.
const Api& api();

// Throws std::runtime_error with the driver's message.
void check(CUresult r, const char* what);

}  // namespace pk::driver
