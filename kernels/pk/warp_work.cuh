// Grid-strided warp items: this thread's warp index over the whole grid, the number of warps, its lane.
// Kernels that hand out (row, segment) work per warp (bulk copies, MoE rows) stride by it.
#pragma once
#include <cstdint>

namespace pk {

struct WarpWork {
  int64_t warp, nwarps;
  int lane;
  __device__ WarpWork()
      : warp((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5),
        nwarps((int64_t(gridDim.x) * blockDim.x) >> 5),
        lane(threadIdx.x & 31) {}
};

}  // namespace pk
