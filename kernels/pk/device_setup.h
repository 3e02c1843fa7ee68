// One-time per-GPU set-up of a kernel family (load and configure its kernels, read the SM count), done the
// first time a handler asks for that GPU. After that a handler pays only the once_flag check (no lock on
// the per-call path). Host code only.
#pragma once
#include <cuda_runtime.h>

#include <mutex>

namespace pk {

struct DeviceSetup {
  std::once_flag once;
  cudaError_t status = cudaErrorInvalidDevice;
  int sms = 0;
};

constexpr int kMaxSetupDevices = 64;

// The set-up of GPU `ordinal` for the family configured by `Configure` (run with that GPU current; the
// caller's current device is restored). nullptr for an ordinal out of range.
template <cudaError_t (*Configure)()>
const DeviceSetup* device_setup(int ordinal) {
  static DeviceSetup devices[kMaxSetupDevices];
  if (ordinal < 0 || ordinal >= kMaxSetupDevices) return nullptr;
  DeviceSetup& d = devices[ordinal];
  std::call_once(d.once, [&] {
    int prev = 0;
    d.status = cudaGetDevice(&prev);
    if (d.status == cudaSuccess) d.status = cudaSetDevice(ordinal);
    if (d.status == cudaSuccess) d.status = Configure();
    if (d.status == cudaSuccess) d.status = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, ordinal);
    cudaSetDevice(prev);
  });
  return &d;
}

// The family's set-up status on GPU `ordinal` (running the set-up the first time).
template <cudaError_t (*Configure)()>
cudaError_t setup_status(int ordinal) {
  const DeviceSetup* d = device_setup<Configure>(ordinal);
  return d ? d->status : cudaErrorInvalidDevice;
}

// GPU `ordinal`'s SM count once the family is set up there, 0 if its set-up failed.
template <cudaError_t (*Configure)()>
int setup_sms(int ordinal) {
  const DeviceSetup* d = device_setup<Configure>(ordinal);
  return d && d->status == cudaSuccess ? d->sms : 0;
}

}  // namespace pk
