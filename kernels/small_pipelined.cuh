// Host side of the pipelined all_reduce ("small_pipelined", kernels/small_pipelined.cu). Reached through
// launch_small (SmallOp::kAllReducePipelined); declared here for small_collectives.cu.
#pragma once
#include <cuda_runtime.h>
#include <vector>

#include "collectives.cuh"
#include "pk/pipelined_schedule.h"

namespace pk {

// bytes in 1..kChunkedBytes, x and y 16-byte aligned (cudaErrorMisalignedAddress otherwise).
cudaError_t launch_pipelined(const Group& g, DType dtype, const void* x, void* y, int64_t bytes,
                             const LaunchLimits& lim, cudaStream_t stream);

// The knobs this process runs with (env PK_JAX_AR_PIPELINED_*, read once).
const PipelinedKnobs& pipelined_knobs();

std::vector<const void*> pipelined_kernels();

}  // namespace pk
