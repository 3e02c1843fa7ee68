// Multi-process jobs: a buffer outside every region the peers mapped at start-up (XLA's allocator
// grew after pk_jax.initialize(), or its region could not be exported) goes through this device's
// staging heap, which the peers did map: one copy in before the kernel, one copy out after it. Both
// are stream-ordered async copies, so the handler stays command-buffer compatible, and the heap is
// reused from its start by every call (calls on one device run in stream order).
//
// Two windows of the heap, one per stream that stages: ops on XLA's stream use the lower three
// quarters, the ring shift on its side stream (which runs while XLA's stream runs other ops, each
// reusing its window from the start) the top quarter. Each window is reused in its own stream's order.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime.h"

namespace pk {

enum class StagingWindow { kMain, kSide };

class BufferStaging {
 public:
  BufferStaging(const LocalDevice& device, cudaStream_t stream, StagingWindow window = StagingWindow::kMain);
  // The address a kernel should use for `p` (`bytes` long): p itself when peers reach it. copy_in:
  // the kernel reads its contents; copy_out: what the kernel writes there is copied back to p.
  // Throws std::runtime_error when the heap is too small (the message names PK_JAX_STAGING_MB).
  void* reachable(void* p, size_t bytes, bool copy_in, bool copy_out);
  // After the launch: the staged outputs back into their buffers.
  cudaError_t copy_back();

 private:
  struct Out {
    void* dst;
    const void* src;
    size_t bytes;
  };
  const LocalDevice& d_;
  cudaStream_t stream_;
  size_t begin_ = 0, end_ = 0;  // the window of the heap this stream uses
  size_t used_ = 0;
  std::vector<Out> outs_;
};

// Buffers staged since start-up (for pk_jax.runtime.stats and the one-time notice).
uint64_t staged_buffers();

}  // namespace pk
