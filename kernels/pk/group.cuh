// A communication group as a kernel sees it: members' control blocks (peer-mapped pointers passed
// by value as a kernel argument, so no per-access address loads), this device's rank, and where to
// report errors.
#pragma once
#include <cstdint>
#include "control_block.h"

namespace pk {

struct Group {
  ControlBlock* ctrl[kMaxGroup];  // by rank; ctrl[rank] is this device's own block
  int32_t slot[kMaxGroup];        // by rank: the device slot used to index ready/done/mailbox
  int32_t rank;
  int32_t size;
  int32_t op;                     // OpCode, for error reports
  uint64_t timeout_ns;
  ErrorRecord* err;               // host-mapped record of this device

  __host__ __device__ ControlBlock* self() const { return ctrl[rank]; }
  __host__ __device__ int my_slot() const { return slot[rank]; }
};

}  // namespace pk
