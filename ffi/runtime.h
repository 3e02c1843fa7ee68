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
#include "vmm_share.h"

namespace pk {

// A region of this device's memory that the other processes of the job have mapped: an address
// inside it is `address + delta[slot]` in the process of the member with that slot (0 in ours).
struct SharedRegion {
  uint64_t begin = 0, end = 0;
  int64_t delta[kMaxSlots] = {};
};

struct LocalDevice {
  int ordinal;        // CUDA ordinal in this process
  int64_t global_id;  // JAX device id
  int slot;           // index into control-block arrays
  ControlBlock* ctrl; // symmetric, reachable from every local device
  ErrorRecord* err;   // host-mapped
  int num_sms;
  // Multi-process jobs only: regions peers have mapped (XLA's, the staging heap) and the heap that
  // takes buffers outside them (one copy each way; see ffi/staging.h).
  std::vector<SharedRegion> regions;
  char* staging = nullptr;
  size_t staging_bytes = 0;
};

// A device of the job's NVLink domain (all of it in one process; every pk_jax process of this host
// in a multi-process job), with its control block as mapped in this process.
struct Member {
  int64_t global_id;
  int slot;
  int process;  // jax process index
  ControlBlock* ctrl;
};

// What a local device exports in a multi-process job (handles: CUDA IPC handle bytes, or for a region
// shared by POSIX fd a vmm descriptor with one fd per chunk in region_fds; the caller sends the fds to
// the peer processes and closes them).
struct LocalExport {
  std::string ctrl_handle;
  std::vector<uint64_t> region_begin, region_size;
  std::vector<std::string> region_handle;
  std::vector<std::vector<int>> region_fds;  // per region; empty: legacy IPC
  std::string xla_sharing;     // "cuda_ipc" or "posix_fd" when XLA's region is shared
  std::string why_not_shared;  // XLA's region could not be exported: buffers go through staging
};

class Runtime {
 public:
  static Runtime& get();

  // Allocates control blocks, enables peer access, preloads every kernel on every device.
  // Idempotent for the same device list; throws std::runtime_error otherwise or on failure.
  void initialize(const std::vector<int>& ordinals, const std::vector<int64_t>& global_ids);
  bool initialized() const { return initialized_.load(std::memory_order_acquire); }

  // Multi-process start-up, driven by pk_jax.initialize() (which exchanges the exports through the
  // jax.distributed key-value store): (1) add_local_device for each local device: control block,
  // kernels, and the export of XLA's region (found from `probe`, a live XLA buffer; legacy IPC, else
  // POSIX fd over at most `region_limit` bytes of contiguous chunks, 0: the probe's chunk, unless
  // `share_by_fd` is false) and of a
  // staging heap; (2) attach_member for each device of another process of this host: maps its control
  // block and regions (`region_fds[i]`: the fds of region i when shared by POSIX fd, else empty; all of
  // them are closed before it returns or throws), returning their addresses here; (3) set_region_delta with where each peer mapped
  // our regions; (4) finish_multiprocess. Not thread-safe; called once, before any op runs.
  LocalExport add_local_device(int ordinal, int64_t global_id, int slot, int process, const void* probe,
                               size_t staging_bytes, uint64_t region_limit = 0, bool share_by_fd = true);
  std::vector<uint64_t> attach_member(int64_t global_id, int slot, int process, const std::string& ctrl_handle,
                                      const std::vector<std::string>& region_handles,
                                      const std::vector<std::vector<int>>& region_fds = {});
  void set_region_delta(int64_t local_global_id, size_t region, int member_slot, uint64_t member_address);
  void finish_multiprocess();
  bool multiprocess() const { return multiprocess_; }

  const LocalDevice* by_ordinal(int ordinal) const;
  const Member* member(int64_t global_id) const;
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

  void load_kernels_and_errors(size_t i, int ordinal);

  std::atomic<bool> initialized_{false};
  bool multiprocess_ = false;
  std::vector<LocalDevice> devices_;
  std::vector<Member> members_;
  std::unique_ptr<SymmetricRegion> control_;
  // Peers' regions mapped here by POSIX fd; unmapped, released and their VA freed when destroyed (the
  // runtime lives for the process, so in practice at exit, after every op).
  std::vector<std::unique_ptr<vmm::ImportedRegion>> imports_;
  ErrorRecord* errors_ = nullptr;  // kMaxSlots records, host-mapped
  std::atomic<uint64_t> timeout_ns_{5000ull * 1000000ull};
  std::thread watchdog_;
};

const char* op_name(int32_t op);

}  // namespace pk
