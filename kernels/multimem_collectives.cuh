// Collectives over a multicast PGL (the paper's multimem all-reduce and barrier): each member holds a
// unicast address of its own copy and the group's multicast address (ffi/multicast_group.h).
// Built into the extension so compile errors surface; never launched on our machines, and refused
// unless configure() ran with the multicast policy allowing it. Unmeasured on hardware.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collectives.cuh"
#include "pk/control_block.h"

namespace pk::multimem {

constexpr int kMaxBarrierBlocks = 256;  // CTAs per launch: one barrier counter each
constexpr int kThreads = 512;

// Barrier state inside the multicast region. arrive[b] is written through the multicast alias (every
// member's copy gets +1 from every member) and read through the unicast one; seq[b] is this member's
// count of barriers of CTA b, touched only locally. Both only grow, so launches need no reset and CUDA
// graphs replay; the pad must be zeroed on every member before the first launch.
struct SignalPad {
  uint32_t arrive[kMaxBarrierBlocks];
  uint32_t seq[kMaxBarrierBlocks];
};

struct MulticastPgl {
  void* data_uc;        // this member's copy (16-byte aligned)
  void* data_mc;        // the group's multicast alias of the same bytes
  SignalPad* pad_uc;
  SignalPad* pad_mc;
  int32_t rank;
  int32_t size;
  uint64_t timeout_ns;  // bounded barrier waits
  ErrorRecord* err;     // host-mapped record of this device (may be null)
  int32_t op;           // OpCode for the error report
};

// A member's multicast region for collectives of up to `data_bytes` per member: the data, then the
// signal pad (128-byte aligned). Ask MulticastGroup for region_bytes(data_bytes).
constexpr size_t pad_offset(size_t data_bytes) { return (data_bytes + 127) / 128 * 128; }
constexpr size_t region_bytes(size_t data_bytes) { return pad_offset(data_bytes) + sizeof(SignalPad); }

// The PGL of one member over its region, from the member's unicast and multicast base addresses
// (MulticastMember::unicast / ::multicast).
inline MulticastPgl make_pgl(uint64_t unicast, uint64_t multicast, size_t data_bytes, int rank, int size,
                             uint64_t timeout_ns, ErrorRecord* err, int32_t op) {
  MulticastPgl p;
  p.data_uc = reinterpret_cast<void*>(unicast);
  p.data_mc = reinterpret_cast<void*>(multicast);
  p.pad_uc = reinterpret_cast<SignalPad*>(unicast + pad_offset(data_bytes));
  p.pad_mc = reinterpret_cast<SignalPad*>(multicast + pad_offset(data_bytes));
  p.rank = rank;
  p.size = size;
  p.timeout_ns = timeout_ns;
  p.err = err;
  p.op = op;
  return p;
}

// In-place all-reduce of `nbytes` (a multiple of 16) at data_mc: each member sums its 1/G slice over the
// group with multimem.ld_reduce (f32 accumulation for bf16/f16) and stores it to every member with
// multimem.st; a multicast barrier before (inputs in place) and after (results landed). Every member must
// launch it with the same nbytes and max_blocks. cudaErrorNotPermitted unless configure() allowed it.
cudaError_t launch_all_reduce(const MulticastPgl& p, DType dtype, size_t nbytes, int max_blocks, cudaStream_t stream);

// One multicast barrier (multimem.red arrive, bounded local wait).
cudaError_t launch_barrier(const MulticastPgl& p, cudaStream_t stream);

std::vector<const void*> kernels();

// Loads the multimem kernels on the current device when multicast_policy() allows it (else loads
// nothing and leaves launches refused). The runtime calls it per device next to configure_kernels().
cudaError_t configure();

}  // namespace pk::multimem
