// Host-side entry points of the small-message collectives (implemented in small_collectives.cu).
// Docs: docs/design-small-collectives.md.
#pragma once
#include <cuda_runtime.h>
#include <vector>
#include "collectives.cuh"

namespace pk {

enum class SmallOp : int32_t {
  kAllReduceOneShot = 0,  // every member sends all of x to every peer and sums all G in rank order
  kAllReduceTwoShot = 1,  // x's words split into G chunks: owner sums its chunk, sends it to all
  kAllGather = 2,         // output = the G members' x concatenated in rank order
  kReduceScatter = 3,     // x = G contiguous chunks; member r gets the rank-order sum of chunk r
  kAllReduceChunked = 4,  // one-shot with plain stores + one release flag per chunk (x up to kChunkedBytes)
  kAllReducePipelined = 5,  // plain stores, pushes and sums pipelined, a signal warp's flags (small_pipelined.cu)
  kAllReduceLL128 = 6,      // one-shot with 128-byte LL lines (120 payload bytes + flag) (small_ll128.cu)
};

// `bytes`: all_reduce: x's size; all_gather: x's size (one block); reduce_scatter: y's size (one
// chunk). The payload a sender puts in one peer's LL area must fit kLLLines words; two-shot also
// needs its words (ceil(bytes / 4)) divisible by the group size. cudaErrorInvalidValue otherwise.
// kAllReduceChunked, kAllReducePipelined: bytes up to kChunkedBytes, x and y 16-byte aligned
// (cudaErrorMisalignedAddress); kAllReduceLL128: the same bytes, x and y 8-byte aligned.
cudaError_t launch_small(const Group& g, SmallOp op, DType dtype, const void* x, void* y, int64_t bytes,
                         const LaunchLimits& lim, cudaStream_t stream);

// LL words (4 payload bytes each) a sender puts in one peer's LL area for this op.
int64_t small_payload_words(SmallOp op, int64_t bytes);

// Every small-message kernel, for the up-front loading (see collective_kernels()).
std::vector<const void*> small_collective_kernels();

}  // namespace pk
