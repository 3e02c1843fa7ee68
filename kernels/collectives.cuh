// Host-side entry points of the collective kernels (implemented in collectives.cu).
#pragma once
#include <cuda_runtime.h>
#include <vector>
#include "pk/box.cuh"
#include "pk/group.cuh"

namespace pk {

enum OpCode : int32_t {
  kOpAllGather = 1,
  kOpReduceScatter = 2,
  kOpAllReduce = 3,
  kOpAllToAll = 4,
  kOpSelfTest = 5,
  kOpAllGatherMatmul = 6,
  kOpMatmulReduceScatter = 7,
  kOpMatmulAllReduce = 8,
  kOpMoeDispatch = 9,  // kernels/moe_dispatch.cu: rows pushed to the experts' members (counts exchanged or known)
  kOpMoeCombine = 10,  // rows pulled back to their tokens' members and summed by weight (or gathered)
  kOpMoeSend = 11,     // rows pushed with the layout known (combine's backward)
  kOpRingShift = 12,   // kernels/ring_shift.cu: ring attention's K/V (or dK/dV) one member on, side channel
  kOpAllReducePipelined = 13,  // never a launch's op: the flag code of all_reduce "small_pipelined" (mismatch reports)
  kOpMoeDispatchMatmul = 14,  // kernels/moe_gemm.cu: dispatch + the first grouped GEMM in one kernel
  kOpAllReduceLL128 = 15,     // never a launch's op: the flag code of all_reduce "small_ll128" (mismatch reports)
  // Never launch ops nor flag codes (flags keep 4 bits): the peer's LL128 kernel in a mismatch report, when members
  // picked different kernels for one op (PK_JAX_AR_LL128_SHOTS or _TWO_SHOT_MIN_BYTES differing between processes).
  kOpAllReduceLL128OneShot = 16,
  kOpAllReduceLL128TwoShot = 17,
};

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct LaunchLimits {
  int num_sms;  // grids are capped at num_sms x (resident CTAs per SM of the kernel)
};

// all_gather / all_to_all: box(sender, receiver) of the sender's `src` goes to the receiver's
// `dst`, for every pair; `pull` picks remote loads instead of remote stores.
cudaError_t launch_copy(const Group& g, const Box& box, int vec_bytes, bool pull, const void* src, void* dst,
                        const LaunchLimits& lim, cudaStream_t stream);

// reduce_scatter / all_reduce: every member sums box(rank) of all members' `src` in rank order
// (bitwise identical on every member) and writes it to its own `dst`, or to every member's `dst`
// when `broadcast` (the second half of a two-shot all-reduce).
cudaError_t launch_pull_reduce(const Group& g, const Box& box, int vec_bytes, DType dtype, bool broadcast,
                               const void* src, void* dst, const LaunchLimits& lim, cudaStream_t stream);

// Self-test of the bounded wait: waits for a test signal from `peer_rank` that nobody sends.
cudaError_t launch_wait_for_peer(const Group& g, int peer_rank, cudaStream_t stream);

// Every kernel in this file, so the runtime can load them all before any cross-GPU wait can be in
// flight (a lazy module load takes a process-wide lock and can deadlock against a spinning kernel).
std::vector<const void*> collective_kernels();

// Grid for `kernel` (configured by configure_kernels) with `warp_items` warp-sized work items of
// `threads`-thread CTAs, capped so that every CTA is resident at once (CTAs wait on peers), and at
// `max_ctas_per_sm` CTAs per SM.
constexpr int kAnyCtasPerSm = 1 << 20;
int resident_grid(const void* kernel, int64_t warp_items, int threads, const LaunchLimits& lim,
                  int max_ctas_per_sm = kAnyCtasPerSm);

// Loads every kernel on the current device and records how many CTAs of each fit on one SM.
// Call on each device at start-up, before any launch.
cudaError_t configure_kernels();

}  // namespace pk
