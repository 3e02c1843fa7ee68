#include "runtime.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "../kernels/gemm.cuh"
#include "../kernels/tp_gemm.cuh"
#include "cuda_check.h"

namespace pk {
namespace {

std::mutex init_mutex;

// Restores the calling thread's current device (XLA threads rely on their own).
struct DeviceGuard {
  int prev = 0;
  DeviceGuard() { cudaGetDevice(&prev); }
  ~DeviceGuard() { cudaSetDevice(prev); }
};

}  // namespace

const char* op_name(int32_t op) {
  switch (op) {
    case kOpAllGather: return "all_gather";
    case kOpReduceScatter: return "reduce_scatter";
    case kOpAllReduce: return "all_reduce";
    case kOpAllToAll: return "all_to_all";
    case kOpSelfTest: return "self-test wait";
    case kOpAllGatherMatmul: return "all_gather_matmul";
    case kOpMatmulReduceScatter: return "matmul_reduce_scatter";
    case kOpMatmulAllReduce: return "matmul_all_reduce";
  }
  return "unknown op";
}

Runtime& Runtime::get() {
  static Runtime* r = new Runtime();  // never destroyed: handlers may run during interpreter exit
  return *r;
}

void Runtime::initialize(const std::vector<int>& ordinals, const std::vector<int64_t>& global_ids) {
  std::lock_guard<std::mutex> lock(init_mutex);
  if (initialized()) {
    bool same = ordinals.size() == devices_.size();
    for (size_t i = 0; same && i < ordinals.size(); ++i)
      same = devices_[i].ordinal == ordinals[i] && devices_[i].global_id == global_ids[i];
    if (!same) throw std::runtime_error("pk_jax: runtime already initialized with other devices");
    return;
  }
  if (ordinals.empty() || ordinals.size() != global_ids.size())
    throw std::runtime_error("pk_jax: initialize needs one global id per device ordinal");
  if (ordinals.size() > size_t(kMaxSlots))
    throw std::runtime_error("pk_jax: at most " + std::to_string(kMaxSlots) + " local GPUs are supported");
  if (const char* t = std::getenv("PK_JAX_TIMEOUT_MS")) set_timeout_ms(std::strtoull(t, nullptr, 10));

  DeviceGuard guard;
  // Peer access makes XLA's own buffers (cuMemAlloc) reachable from every device; XLA usually
  // enabled it already.
  for (int a : ordinals) {
    PK_CUDA(cudaSetDevice(a));
    for (int b : ordinals) {
      if (a == b) continue;
      int can = 0;
      PK_CUDA(cudaDeviceCanAccessPeer(&can, a, b));
      if (!can)
        throw std::runtime_error("pk_jax: GPU " + std::to_string(a) + " cannot access GPU " + std::to_string(b) +
                                 " directly (no NVLink/P2P path)");
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) PK_CUDA(e);
      cudaGetLastError();  // clear the sticky "already enabled"
    }
  }

  control_ = std::make_unique<SymmetricRegion>(ordinals, sizeof(ControlBlock));
  PK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&errors_), sizeof(ErrorRecord) * kMaxSlots,
                        cudaHostAllocMapped | cudaHostAllocPortable));
  std::fill(errors_, errors_ + kMaxSlots, ErrorRecord{});

  // Load every kernel on every device now: a lazy load during a later launch takes a
  // process-wide lock and can deadlock against one of our kernels spinning on another GPU.
  for (size_t i = 0; i < ordinals.size(); ++i) {
    PK_CUDA(cudaSetDevice(ordinals[i]));
    PK_CUDA(cudaMemset(control_->at(i), 0, sizeof(ControlBlock)));
    PK_CUDA(configure_kernels());
    PK_CUDA(gemm::configure_once(ordinals[i]));
    PK_CUDA(tp::configure());
    cudaDeviceProp prop;
    PK_CUDA(cudaGetDeviceProperties(&prop, ordinals[i]));
    ErrorRecord* dev_err = nullptr;
    PK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_err), errors_ + i, 0));
    devices_.push_back(LocalDevice{ordinals[i], global_ids[i], int(i), static_cast<ControlBlock*>(control_->at(i)),
                                   dev_err, prop.multiProcessorCount});
    PK_CUDA(cudaDeviceSynchronize());
  }
  watchdog_ = std::thread([this] { watch_errors(); });
  watchdog_.detach();
  initialized_.store(true, std::memory_order_release);
}

const LocalDevice* Runtime::by_ordinal(int ordinal) const {
  for (const auto& d : devices_)
    if (d.ordinal == ordinal) return &d;
  return nullptr;
}

const LocalDevice* Runtime::by_global_id(int64_t id) const {
  for (const auto& d : devices_)
    if (d.global_id == id) return &d;
  return nullptr;
}

std::string Runtime::describe(const ErrorRecord& e) const {
  auto ordinal_of = [this](int slot) {
    return slot >= 0 && size_t(slot) < devices_.size() ? devices_[slot].ordinal : -1;
  };
  std::string what = e.code == kTimeoutReady  ? "never started the op (its buffers were never published)"
                     : e.code == kTimeoutDone ? "never finished the op"
                     : e.code == kTimeoutItem ? "never delivered a tile or row chunk of the op"
                                              : "never sent the expected signal";
  return std::string("pk_jax ") + op_name(e.op) + ": GPU " + std::to_string(ordinal_of(e.device_slot)) +
         " waited more than " + std::to_string(timeout_ns() / 1000000) + " ms for GPU " +
         std::to_string(ordinal_of(e.peer_slot)) + ", which " + what +
         ". Every member of the group must run the same collectives in the same order. The runtime is "
         "stopped; call pk_jax.runtime.reset() once all GPUs are idle (timeout: PK_JAX_TIMEOUT_MS).";
}

std::string Runtime::first_error() const {
  if (!errors_) return "";
  for (size_t i = 0; i < devices_.size(); ++i) {
    const volatile ErrorRecord* e = errors_ + i;
    if (e->code != kOk) {
      ErrorRecord copy{e->code, e->op, e->device_slot, e->peer_slot};
      return describe(copy);
    }
  }
  return "";
}

void Runtime::watch_errors() {
  std::string reported;
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const std::string e = first_error();
    if (!e.empty() && e != reported) std::fprintf(stderr, "%s\n", e.c_str());
    reported = e;
  }
}

void Runtime::reset() {
  if (!initialized()) return;
  DeviceGuard guard;
  for (const auto& d : devices_) {
    PK_CUDA(cudaSetDevice(d.ordinal));
    PK_CUDA(cudaDeviceSynchronize());
  }
  for (const auto& d : devices_) {
    PK_CUDA(cudaSetDevice(d.ordinal));
    PK_CUDA(cudaMemset(d.ctrl, 0, sizeof(ControlBlock)));
    PK_CUDA(cudaDeviceSynchronize());
  }
  std::fill(errors_, errors_ + kMaxSlots, ErrorRecord{});
}

}  // namespace pk
