// Host interface of the attention forward kernel (kernels/attention_kernel.cuh).
#pragma once
#include <cuda_runtime.h>

#include "../ffi/tensor_map.h"

namespace pk::attention {

struct Problem {
  const void* q;  // (batch, tq, heads, head_dim)
  const void* k;  // (batch, tk, kv_heads, head_dim)
  const void* v;  // (batch, tk, kv_heads, head_dim)
  void* o;        // (batch, tq, heads, head_dim), the input dtype (unused when acc_mode != 0)
  float* lse;     // (batch, heads, lse_seq) float32 from this call's row 0, or nullptr
  // Ring attention's float32 accumulator (attention_kernel.cuh Globals): acc_mode 0 none, 1 write O and LSE into
  // acc (batch, lse_seq, heads, head_dim) and lse from this call's row 0, 2 merge them with what is there.
  float* acc = nullptr;
  int acc_mode = 0;
  int lse_seq = 0;  // 0: tq
  const int* offsets;  // device int32[2]: q_offset, kv_offset (global positions of row 0 and key 0)
  int batch, tq, tk, heads, kv_heads, head_dim;
  ElemType type;  // bf16 or f16
  float scale;    // > 0
  bool causal;
  bool pipelined;  // the consumers overlap softmax with the previous block's P V (measured slower; opt-in)
  int variant;     // forward variant (attention_kernel.cuh FwdVariant): 0 default, 1 l2order, 2 pingpong, 3 fa3,
                   // 4 fa3n160, 5 fa3n176
};

// Loads and configures every attention kernel on the current device (see lcsc::configure).
cudaError_t configure();
// configure() on GPU `ordinal` the first time it is asked for it (thread-safe; restores the current device).
cudaError_t configure_once(int ordinal);
// Multiprocessor count of GPU `ordinal` (cached), 0 if it could not be configured.
int num_sms(int ordinal);
// Throws std::invalid_argument naming the argument for shapes/types the kernel does not take, and
// std::runtime_error for CUDA failures.
void launch(const Problem& p, int compute_sms, cudaStream_t stream);

}  // namespace pk::attention
