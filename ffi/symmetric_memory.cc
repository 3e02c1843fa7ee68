#include "symmetric_memory.h"

#include <stdexcept>
#include <string>

#include "driver_api.h"

namespace pk {

SymmetricRegion::SymmetricRegion(const std::vector<int>& ordinals, size_t bytes) : ordinals_(ordinals) {
  const auto& d = driver::api();
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  size_t granularity = 0;
  prop.location.id = ordinals.empty() ? 0 : ordinals[0];
  driver::check(d.mem_get_allocation_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity");
  bytes_ = (bytes + granularity - 1) / granularity * granularity;

  std::vector<CUmemAccessDesc> access(ordinals.size());
  for (size_t i = 0; i < ordinals.size(); ++i) {
    access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[i].location.id = ordinals[i];
    access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  for (int ordinal : ordinals) {
    prop.location.id = ordinal;
    CUmemGenericAllocationHandle h;
    const CUresult r = d.mem_create(&h, bytes_, &prop, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY)
      throw std::runtime_error("pk_jax: cannot allocate " + std::to_string(bytes_) +
                               " bytes of symmetric memory on GPU " + std::to_string(ordinal) +
                               ": the GPU is full. JAX preallocates 75% of GPU memory; lower it with "
                               "XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. 0.7) to leave room.");
    driver::check(r, "cuMemCreate");
    handles_.push_back(h);
    CUdeviceptr va = 0;
    driver::check(d.mem_address_reserve(&va, bytes_, granularity, 0, 0), "cuMemAddressReserve");
    driver::check(d.mem_map(va, bytes_, 0, h, 0), "cuMemMap");
    driver::check(d.mem_set_access(va, bytes_, access.data(), access.size()), "cuMemSetAccess");
    ptrs_.push_back(reinterpret_cast<void*>(va));
  }
}

SymmetricRegion::~SymmetricRegion() {
  const auto& d = driver::api();
  for (size_t i = 0; i < ptrs_.size(); ++i) {
    const auto va = reinterpret_cast<CUdeviceptr>(ptrs_[i]);
    d.mem_unmap(va, bytes_);
    d.mem_address_free(va, bytes_);
    d.mem_release(handles_[i]);
  }
}

}  // namespace pk
