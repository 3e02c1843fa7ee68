// Tasks claimed at run time. The loader thread of a CTA takes the next task from a device-wide
// counter and hands it to the CTA's other roles (consumer warps, storer) through a small ring, so
// every role of the CTA walks the same tasks in the same order. CTAs that start late (comm SMs
// after their communication) simply claim what is left: the last wave has no idle SMs.
//
// The counter lives in device memory and is reset to 0 by the launch's last CTA (op_protocol.cuh
// finish, or finish_counter_pair below), so no host state is needed and CUDA graph replays stay correct.
#pragma once
#include <cstdint>

#include "pipeline.cuh"

namespace pk {

template <int D>
struct TaskQueue {
  int id[D];
  Ring<D> ring;

  // One thread: `takers` arrivals release a slot (one per taking warp or thread).
  __device__ void init(uint32_t takers) { ring.init(1, takers); }

  // Loader thread: claim the next task (-1 once all `total` are claimed) and publish it.
  __device__ int claim(RingPos<D>& pos, uint32_t* counter, int total) {
    int t = int(atomicAdd(counter, 1u));
    if (t >= total) t = -1;
    pos.wait_empty(ring);
    id[pos.stage] = t;
    tma::mbar_arrive(&ring.full[pos.stage]);  // release: the id is visible to whoever sees the phase
    pos.advance();
    return t;
  }

  // A whole warp (whole_warp) or a single thread: the next task the loader published.
  __device__ int take(RingPos<D>& pos, bool whole_warp) {
    pos.wait_full(ring);
    const int t = id[pos.stage];
    if (whole_warp) __syncwarp();  // every lane has read the id before lane 0 frees the slot
    if (!whole_warp || threadIdx.x % 32 == 0) tma::mbar_arrive(&ring.empty[pos.stage]);
    pos.advance();
    return t;
  }
};

// A kernel's own counter pair {next task, CTAs done}, one per kernel type K (zero at module load): its
// task_counter(g) returns it, and finish_counter_pair below resets it at the end of each launch.
template <class K>
__device__ uint32_t kernel_counter_pair[2];

// A kernel-owned counter pair {next task, CTAs done} (one launch of the kernel at a time per device): called by
// one thread of every CTA once its loader's last claim is taken (the storer, after the -1), it counts the CTA
// done, and the launch's last CTA zeroes both, so the next launch (or graph replay) claims from 0.
__device__ __forceinline__ void finish_counter_pair(uint32_t* counter) {
  __threadfence();
  if (atomicAdd(&counter[1], 1u) == gridDim.x - 1) {
    atomicExch(&counter[0], 0u);
    atomicExch(&counter[1], 0u);
  }
}

}  // namespace pk
