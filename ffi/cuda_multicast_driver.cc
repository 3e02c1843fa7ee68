// MulticastDriver on the CUDA driver API (entry points from driver::multicast_api(), resolved only here,
// i.e. only once multicast was requested). Built and compile-checked; never run on our machines.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "driver_api.h"
#include "multicast_group.h"
#include "multicast_policy.h"

namespace pk {
namespace {

// Makes `ordinal`'s primary context current for the driver calls of one step; restores the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    cudaGetDevice(&prev_);
    if (cudaSetDevice(ordinal) != cudaSuccess)
      throw std::runtime_error("pk_jax: cannot make GPU " + std::to_string(ordinal) + " current");
  }
  ~DeviceScope() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

// Defense in depth: MulticastGroup asks the policy first, but no multicast driver step runs without it
// even if someone calls the driver directly.
void require_policy() {
  const MulticastPolicy p = multicast_policy();
  if (!p.allowed) throw std::runtime_error("pk_jax: multicast refused: " + p.reason);
}

// The caller's device: its primary context serves the calls that name no device.
int current_device() {
  int d = 0;
  cudaGetDevice(&d);
  return d;
}

CUmemAllocationProp physical_prop(int ordinal) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

CUmulticastObjectProp multicast_prop(int num_devices, size_t bytes) {
  CUmulticastObjectProp prop = {};
  prop.numDevices = unsigned(num_devices);
  prop.size = bytes;
  prop.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

class CudaMulticastDriver final : public MulticastDriver {
 public:
  bool multicast_supported(int device) override {
    require_policy();
    const auto& mc = driver::multicast_api();
    CUdevice dev;
    driver::check(mc.device_get(&dev, device), "cuDeviceGet");
    int supported = 0;
    driver::check(mc.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev),
                  "cuDeviceGetAttribute(MULTICAST_SUPPORTED)");
    return supported != 0;
  }

  size_t multicast_granularity(int num_devices, size_t bytes) override {
    require_policy();
    DeviceScope scope(current_device());
    const CUmulticastObjectProp prop = multicast_prop(num_devices, bytes);
    size_t g = 0;
    driver::check(driver::multicast_api().multicast_get_granularity(&g, &prop, CU_MULTICAST_GRANULARITY_RECOMMENDED),
                  "cuMulticastGetGranularity");
    return g;
  }

  size_t allocation_granularity(int device) override {
    require_policy();
    const CUmemAllocationProp prop = physical_prop(device);
    size_t g = 0;
    driver::check(driver::api().mem_get_allocation_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                  "cuMemGetAllocationGranularity");
    return g;
  }

  uint64_t create_multicast(int num_devices, size_t bytes) override {
    require_policy();
    DeviceScope scope(current_device());
    const CUmulticastObjectProp prop = multicast_prop(num_devices, bytes);
    CUmemGenericAllocationHandle h = 0;
    driver::check(driver::multicast_api().multicast_create(&h, &prop), "cuMulticastCreate");
    return h;
  }

  int export_fd(uint64_t handle) override {
    require_policy();
    DeviceScope scope(current_device());
    int fd = -1;
    driver::check(driver::multicast_api().mem_export_to_shareable_handle(
                      &fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                  "cuMemExportToShareableHandle");
    return fd;
  }

  uint64_t import_fd(int fd) override {
    require_policy();
    DeviceScope scope(current_device());
    CUmemGenericAllocationHandle h = 0;
    void* os_handle = reinterpret_cast<void*>(static_cast<uintptr_t>(fd));
    driver::check(driver::multicast_api().mem_import_from_shareable_handle(&h, os_handle,
                                                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                  "cuMemImportFromShareableHandle");
    return h;
  }

  void add_device(uint64_t multicast, int device) override {
    require_policy();
    DeviceScope scope(device);
    const auto& mc = driver::multicast_api();
    CUdevice dev;
    driver::check(mc.device_get(&dev, device), "cuDeviceGet");
    driver::check(mc.multicast_add_device(multicast, dev), "cuMulticastAddDevice");
  }

  uint64_t create_physical(int device, size_t bytes) override {
    require_policy();
    DeviceScope scope(device);
    const CUmemAllocationProp prop = physical_prop(device);
    CUmemGenericAllocationHandle h = 0;
    driver::check(driver::api().mem_create(&h, bytes, &prop, 0), "cuMemCreate(POSIX_FD)");
    return h;
  }

  void bind(uint64_t multicast, int device, uint64_t physical, size_t bytes) override {
    require_policy();
    DeviceScope scope(device);
    driver::check(driver::multicast_api().multicast_bind_mem(multicast, 0, physical, 0, bytes, 0),
                  "cuMulticastBindMem");
  }

  void unbind(uint64_t multicast, int device, size_t bytes) override {
    DeviceScope scope(device);
    const auto& mc = driver::multicast_api();
    CUdevice dev;
    driver::check(mc.device_get(&dev, device), "cuDeviceGet");
    driver::check(mc.multicast_unbind(multicast, dev, 0, bytes), "cuMulticastUnbind");
  }

  uint64_t map(uint64_t handle, int device, size_t bytes, size_t alignment) override {
    require_policy();
    DeviceScope scope(device);
    const auto& d = driver::api();
    CUdeviceptr va = 0;
    driver::check(d.mem_address_reserve(&va, bytes, alignment, 0, 0), "cuMemAddressReserve");
    CUresult r = d.mem_map(va, bytes, 0, handle, 0);
    if (r == CUDA_SUCCESS) {
      CUmemAccessDesc access = {};
      access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      access.location.id = device;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      r = d.mem_set_access(va, bytes, &access, 1);
      if (r != CUDA_SUCCESS) d.mem_unmap(va, bytes);
    }
    if (r != CUDA_SUCCESS) {
      d.mem_address_free(va, bytes);
      driver::check(r, "cuMemMap/cuMemSetAccess");
    }
    return va;
  }

  void unmap(uint64_t address, size_t bytes) override {
    const auto& d = driver::api();
    driver::check(d.mem_unmap(address, bytes), "cuMemUnmap");
    driver::check(d.mem_address_free(address, bytes), "cuMemAddressFree");
  }

  // Teardown (unbind, unmap, release) runs whatever the policy says now: what was made must be undone.
  void release(uint64_t handle) override { driver::check(driver::api().mem_release(handle), "cuMemRelease"); }
};

}  // namespace

MulticastDriver& cuda_multicast_driver() {
  static CudaMulticastDriver driver;
  return driver;
}

}  // namespace pk
