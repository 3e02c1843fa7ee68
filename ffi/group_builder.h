// The communication group of the GPU an FFI handler runs on, from the op's mesh attributes
// (shared by every multi-GPU handler).
#pragma once
#include <cuda_runtime.h>  // __host__ __device__ in the shared kernel headers

#include <cstdint>
#include <string>

#include "../kernels/pk/group.cuh"
#include "runtime.h"

namespace pk {

// Fills `g` (ranks, control blocks, error record, timeout) and `me`. Returns an error message, or
// an empty string on success. `invalid` is set when the message is about the arguments.
std::string build_group(int32_t ordinal, int32_t op, const int64_t* mesh_ids, size_t n_ids,
                        const int64_t* mesh_shape, size_t n_dims, const int64_t* group_axes, size_t n_axes,
                        Group& g, const LocalDevice*& me, bool& invalid);

}  // namespace pk
