// Host side of the LL128 all_reduce ("small_ll128", kernels/small_ll128.cu). Reached through launch_small
// (SmallOp::kAllReduceLL128); declared here for small_collectives.cu.
#pragma once
#include <cuda_runtime.h>
#include <vector>

#include "collectives.cuh"

namespace pk {

// bytes in 1..kChunkedBytes, x and y 8-byte aligned (cudaErrorMisalignedAddress otherwise).
cudaError_t launch_ll128(const Group& g, DType dtype, const void* x, void* y, int64_t bytes, const LaunchLimits& lim,
                         cudaStream_t stream);

// 1 (one-shot) or 2 (two-shot) for an all_reduce of `bytes` over `group` members: PK_JAX_AR_LL128_SHOTS if set, else
// two-shot from G = 3 and PK_JAX_AR_LL128_TWO_SHOT_MIN_BYTES; one-shot wherever there are fewer lines than members.
int ll128_shots(int64_t bytes, int group);

std::vector<const void*> ll128_kernels();

}  // namespace pk
