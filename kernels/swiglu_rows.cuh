// SwiGLU over the rows in use of an MoE layer's expert buffers: hidden = silu(gate) * up on rows
// [0, sum(group_sizes)) only (clipped at the buffer's rows), the rest left as they were. An expert-parallel
// layer sizes its buffers for the worst case (at G 4 about 3/4 of the rows are never used), so the
// elementwise passes XLA would run over every row cost ~4x their work there. group_sizes stay on the device.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../ffi/tensor_map.h"

namespace pk::swiglu {

struct Rows {
  const void* gate;            // (rows, cols)
  const void* up;              // (rows, cols)
  const void* d_hidden;        // backward: (rows, cols); forward: nullptr
  void* hidden;                // forward: (rows, cols)
  void* d_gate;                // backward: (rows, cols)
  void* d_up;                  // backward: (rows, cols)
  const int32_t* group_sizes;  // (groups,) on the device: rows in use = min(sum, rows)
  int groups;
  int64_t rows, cols;          // cols % 8 == 0 (16-byte vectors)
  ElemType type;               // bf16 or f16, every buffer
};

// Why the kernels cannot take `r` ("" when they can).
const char* unsupported(const Rows& r, bool backward);
// Forward: hidden = silu(gate) * up, in float32, rounded once. Backward: d_gate = d_hidden * up * silu'(gate),
// d_up = d_hidden * silu(gate), each rounded once.
cudaError_t launch_forward(const Rows& r, cudaStream_t stream);
cudaError_t launch_backward(const Rows& r, cudaStream_t stream);
cudaError_t configure();  // loads the kernels on the current device (the runtime preloads every kernel)

}  // namespace pk::swiglu
