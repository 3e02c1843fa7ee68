// The asynchronous ring shift: member r's buffers x_i land in member (r+d_i) mod G's buffers y_i (d_i = 1 for
// ring attention; d_i = 1..G-1 make an all-to-all, pk_jax/context/async_all_to_all.py), on a
// side stream while XLA's stream runs the ring's attention (ffi/ring_shift_handler.cc). Handshakes on
// the control block's side channel (OpProtocolOn<kSideChannel>), never the main one.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "collectives.cuh"
#include "pk/group.cuh"

namespace pk {

constexpr int kMaxShiftBuffers = 4;     // K, V (forward) or dK, dV (backward): at most kMaxPublished
constexpr int kShiftThreads = 512;

struct ShiftBuffers {
  const char* x[kMaxShiftBuffers];  // this member's inputs (read locally)
  char* y[kMaxShiftBuffers];        // this member's outputs, reachable by member rank - dist[i] (published)
  int64_t bytes[kMaxShiftBuffers];  // x_i and y_i are `bytes[i]` long, 16-byte aligned
  int32_t dist[kMaxShiftBuffers];   // x_i lands on member (rank + dist[i]) mod G, 1 <= dist[i] < G (1: the ring)
  int32_t n;
};

// The loads each thread of the shift kernel keeps in flight (template instances; anything else is refused).
constexpr int kShiftUnrolls[] = {4, 8, 16};

// Launches the shift kernel on `stream` with `ctas` CTAs, `unroll` (one of kShiftUnrolls) loads in flight per
// thread. When it ends, every y_i holds the x_i of member rank - dist[i] and no peer touches this member's
// buffers any more.
cudaError_t launch_ring_shift(const Group& g, const ShiftBuffers& b, int ctas, int unroll, cudaStream_t stream);

// The kernel(s) of this file, preloaded by the runtime with every other kernel (collectives.cu).
std::vector<const void*> ring_shift_kernels();

}  // namespace pk
