// The small path's per-pair epochs (ControlBlock::ll_seq) as one launch uses them: every CTA reads this
// op's flag with each member at its start (ll_flag of ll_seq + 1 and a 4-bit code), and the last CTA to
// finish advances ll_seq. Device memory only: command-buffer replays need no host state.
#pragma once
#include "ll.cuh"

namespace pk {

// Threads 0..G-1: flag[r] = this op's flag with member r (shared memory; the caller syncs).
__device__ __forceinline__ void load_small_flags(const Group& g, uint32_t* flag, int32_t code) {
  if (threadIdx.x < g.size) flag[threadIdx.x] = ll_flag(g.self()->ll_seq[g.slot[threadIdx.x]] + 1, code);
}

// Every thread of the CTA. The last CTA to arrive advances the epochs with every peer; every CTA read
// them at its start, before it arrived.
__device__ inline void finish_small_op(const Group& g) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  ControlBlock* me = g.self();
  if (atomicAdd(&me->ll_arrived, 1u) != gridDim.x - 1) return;
  for (int r = 0; r < g.size; ++r)
    if (r != g.rank) me->ll_seq[g.slot[r]] += 1;
  me->ll_arrived = 0;
}

}  // namespace pk
