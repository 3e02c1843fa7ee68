// One NVLink multicast object per group of devices (the paper's multicast PGL, appendix "In-network
// acceleration set-up"): every member binds its own physical memory to the object and maps both, so it
// holds a unicast address (its own copy, ordinary loads/stores) and a multicast address (multimem.*:
// stores broadcast to every member, ld_reduce/red reduce in the NVSwitch).
//
// Multicast can take a shared host's GPUs out of service, so every step refuses unless
// multicast_policy() allows it and every member's device reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED;
// a refusal touches no multicast state. The driver and the cross-process exchange are interfaces, so
// the decision logic and the exchange order are unit-tested on CPU with fakes.
// Built and unit-tested only: not measured (or run) on hardware.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "multicast_policy.h"

namespace pk {

// The driver steps a multicast group needs. Handles are CUmemGenericAllocationHandle values, addresses
// CUdeviceptr values. Methods throw std::runtime_error on failure.
class MulticastDriver {
 public:
  virtual ~MulticastDriver() = default;
  virtual bool multicast_supported(int device) = 0;
  // Multicast granularity (recommended) for a team of `num_devices` binding `bytes` each.
  virtual size_t multicast_granularity(int num_devices, size_t bytes) = 0;
  // Physical allocation granularity of `device` for POSIX-fd shareable allocations.
  virtual size_t allocation_granularity(int device) = 0;
  virtual uint64_t create_multicast(int num_devices, size_t bytes) = 0;  // POSIX-fd exportable
  virtual int export_fd(uint64_t handle) = 0;                           // caller owns the fd
  virtual uint64_t import_fd(int fd) = 0;                               // does not close the fd
  virtual void add_device(uint64_t multicast, int device) = 0;
  virtual uint64_t create_physical(int device, size_t bytes) = 0;       // POSIX-fd exportable
  virtual void bind(uint64_t multicast, int device, uint64_t physical, size_t bytes) = 0;
  virtual void unbind(uint64_t multicast, int device, size_t bytes) = 0;
  // Reserves a VA range (aligned to `alignment`), maps `handle` there and grants `device` read/write;
  // returns the address.
  virtual uint64_t map(uint64_t handle, int device, size_t bytes, size_t alignment) = 0;
  virtual void unmap(uint64_t address, size_t bytes) = 0;  // unmap + free the VA range
  virtual void release(uint64_t handle) = 0;
};

// The CUDA driver (entry points resolved on first use, driver_api.h).
MulticastDriver& cuda_multicast_driver();

// What the processes of one group exchange. Every process of the group calls the same methods in the
// same order; each call returns the same result everywhere, or throws (bounded: no call may hang).
class MulticastTransport {
 public:
  virtual ~MulticastTransport() = default;
  // True in every process when `mine` is true in every process.
  virtual bool all_agree(bool mine) = 0;
  // The root process passes the fd to share and gets it back; the others pass -1 and get their own
  // copy (which they own). Never called when the group lives in one process.
  virtual int share_fd(int fd) = 0;
  virtual void barrier() = 0;
};

// One process holding every member: nothing to exchange.
class SingleProcessTransport final : public MulticastTransport {
 public:
  bool all_agree(bool mine) override { return mine; }
  int share_fd(int fd) override { return fd; }
  void barrier() override {}
};

struct MulticastRequest {
  int group_size = 0;                // members across all processes (2..kMaxGroup)
  std::vector<int> local_devices;    // CUDA ordinals of this process's members
  bool is_root = false;              // this process creates the object (exactly one process)
  bool single_process = true;        // all members are in this process (no fd exchange)
  size_t bytes = 0;                  // wanted per member; rounded up to the granularities
};

// This process's view of a member: its own copy and the multicast alias of the group.
struct MulticastMember {
  int device;
  uint64_t physical;   // cuMemCreate handle
  uint64_t unicast;    // address of this member's copy
  uint64_t multicast;  // address of the multicast object (multimem.* only)
};

class MulticastGroup {
 public:
  // The group, or nullptr with `why_not` set when the policy refuses, a device lacks multicast, the
  // request is malformed or (after the agreement) a driver step failed; a refusal calls no driver step
  // but multicast_supported, and a failure undoes the steps taken. Throws only when the transport does.
  // `policy`: multicast_policy() in the runtime (a driver that creates anything checks it again).
  static std::unique_ptr<MulticastGroup> create(const MulticastRequest& req, const MulticastPolicy& policy,
                                                MulticastDriver& driver, MulticastTransport& transport,
                                                std::string& why_not);
  ~MulticastGroup();
  MulticastGroup(const MulticastGroup&) = delete;
  MulticastGroup& operator=(const MulticastGroup&) = delete;

  size_t bytes() const { return bytes_; }  // per member, rounded up
  const std::vector<MulticastMember>& members() const { return members_; }

 private:
  explicit MulticastGroup(MulticastDriver& d) : driver_(d) {}
  void set_up(const MulticastRequest& req, MulticastTransport& transport);
  void tear_down() noexcept;

  MulticastDriver& driver_;
  uint64_t multicast_ = 0;
  bool have_multicast_ = false;
  size_t bytes_ = 0;
  size_t alignment_ = 0;
  std::vector<int> added_;                 // devices added to the team
  std::vector<MulticastMember> members_;   // fields set as the steps succeed (0 = not done)
  std::vector<bool> bound_;
};

// The whole single-process set-up for the runtime: one multicast group over `ordinals` (this process's
// GPUs, all in the group) of `bytes` per GPU, with the CUDA driver; nullptr and `why_not` when refused.
std::unique_ptr<MulticastGroup> create_local_multicast_group(const std::vector<int>& ordinals, size_t bytes,
                                                             std::string& why_not);

}  // namespace pk
