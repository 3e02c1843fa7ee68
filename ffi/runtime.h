// The process-wide runtime: which local devices take part, their symmetric control blocks, the
// host-mapped error records, and the kernel preloading. Initialized once (from Python, before the
// first op executes); read-only afterwards except for error state, so FFI handlers running on
// several device threads at once need no locks.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../kernels/collectives.cuh"
#include "../kernels/pk/control_block.h"
#include "symmetric_memory.h"

namespace pk {

struct LocalDevice {
  int ordinal;        // CUDA ordinal in this process
  int64_t global_id;  // JAX device id
  int slot;           // index into control-block arrays
  ControlBlock* ctrl; // symmetric, reachable from every local device
  ErrorRecord* err;   // host-mapped
  int num_sms;
};

class Runtime {
 public:
  static Runtime& get();

  // Allocates control blocks, enables peer access, preloads every kernel on every device.
  // Idempotent for the same device list; throws std::runtime_error otherwise or on failure.
  void initialize(const std::vector<int>& ordinals, const std::vector<int64_t>& global_ids);
  bool initialized() const { return initialized_.load(std::memory_order_acquire); }

  const LocalDevice* by_ordinal(int ordinal) const;
  const LocalDevice* by_global_id(int64_t id) const;
  const std::vector<LocalDevice>& devices() const { return devices_; }
  LaunchLimits limits(const LocalDevice& d) const { return {d.num_sms}; }

  uint64_t timeout_ns() const { return timeout_ns_.load(std::memory_order_relaxed); }
  void set_timeout_ms(uint64_t ms) { timeout_ns_.store(ms * 1000000ull, std::memory_order_relaxed); }

  // The first recorded device-side error, as a message naming the op and the missing device;
  // empty when there is none.
  std::string first_error() const;
  // Waits for all devices, clears error records and control blocks. No op may be in flight.
  void reset();

 private:
  Runtime() = default;
  std::string describe(const ErrorRecord& e) const;
  void watch_errors();

  std::atomic<bool> initialized_{false};
  std::vector<LocalDevice> devices_;
  std::unique_ptr<SymmetricRegion> control_;
  ErrorRecord* errors_ = nullptr;  // kMaxSlots records, host-mapped
  std::atomic<uint64_t> timeout_ns_{5000ull * 1000000ull};
  std::thread watchdog_;
};

const char* op_name(int32_t op);

}  // namespace pk
