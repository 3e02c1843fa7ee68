// One side stream per device for work that must run *beside* XLA's stream (the ring shift): created
// lazily on first use, kept for the process, keyed by CUDA ordinal. Host state, so the handlers that use
// it are not command-buffer compatible (a captured graph would replay the side launch on XLA's stream).
#pragma once
#include <cuda_runtime.h>

#include <mutex>

namespace pk {

struct SideStream {
  cudaStream_t stream = nullptr;     // highest priority: its few CTAs get the SMs the attention left free
  cudaEvent_t main_ready = nullptr;  // recorded on XLA's stream, waited on by the side stream (start)
  cudaEvent_t side_done = nullptr;   // recorded on the side stream, waited on by XLA's stream (done)
  std::mutex mutex;                  // record + wait pairs of one device never interleave
};

// The device's side stream, created on first call (throws std::runtime_error if CUDA refuses).
SideStream& side_stream(int ordinal);
// The device's side stream if one was created, else nullptr (nothing was ever issued on it).
SideStream* existing_side_stream(int ordinal);

}  // namespace pk
