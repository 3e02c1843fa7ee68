// A communication group as a kernel sees it: members' control blocks (peer-mapped pointers passed
// by value as a kernel argument, so no per-access address loads), this device's rank, and where to
// report errors.
#pragma once
#include <cstdint>
#include "control_block.h"

namespace pk {

// Multi-process jobs: a buffer address of this process means nothing in a peer's process. Each
// member maps the others' shared memory regions (XLA's allocator region, the staging heap) once at
// start-up; `to_member` turns an address in one of this device's regions into member r's mapping of
// it. Empty (n = 0) in one process, where every address is valid on every device.
constexpr int kMaxRegions = 4;
struct AddressMap {
  uint64_t begin[kMaxRegions];
  uint64_t end[kMaxRegions];
  int64_t delta[kMaxRegions][kMaxGroup];  // by region and rank: member's address - ours
  int32_t n;

  __host__ __device__ uint64_t to_member(uint64_t addr, int r) const {
    for (int i = 0; i < n; ++i)
      if (addr >= begin[i] && addr < end[i]) return addr + uint64_t(delta[i][r]);
    return addr;
  }
};

struct Group {
  ControlBlock* ctrl[kMaxGroup];  // by rank; ctrl[rank] is this device's own block
  int32_t slot[kMaxGroup];        // by rank: the device slot used to index ready/done/mailbox
  int32_t rank;
  int32_t size;
  int32_t op;                     // OpCode, for error reports
  uint64_t timeout_ns;
  ErrorRecord* err;               // host-mapped record of this device
  AddressMap map;                 // published addresses as the members see them (multi-process)

  __host__ __device__ ControlBlock* self() const { return ctrl[rank]; }
  __host__ __device__ int my_slot() const { return slot[rank]; }
};

}  // namespace pk
