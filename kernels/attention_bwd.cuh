// Host interface of the attention backward kernel (kernels/attention_bwd_kernel.cuh).
#pragma once
#include <cuda_runtime.h>

#include "../ffi/tensor_map.h"

namespace pk::attention_bwd {

struct Problem {
  const void* q;     // (batch, tq, heads, head_dim)
  const void* k;     // (batch, tk, kv_heads, head_dim)
  const void* v;     // (batch, tk, kv_heads, head_dim)
  const void* dout;  // (batch, tq, heads, head_dim): the output's cotangent
  const float* lse2;   // (batch, heads, tq_pad): LSE * log2(e); +inf for rows past tq and rows that see no key
  const float* delta;  // (batch, heads, tq_pad): rowsum(dout * out) - dlse; 0 for rows past tq
  float* dq_acc;       // (batch, heads, tq_pad, head_dim) float32, dQ / scale in 64 x 64 chunks of
                       // accumulator order (zeroed by launch(); pk_jax/attention.py reads it back)
  void* dk;            // (batch, tk, kv_heads, head_dim), the input dtype
  void* dv;
  const int* offsets;  // device int32[2]: q_offset, kv_offset
  int batch, tq, tk, heads, kv_heads, head_dim, tq_pad;  // tq_pad: tq rounded up to a multiple of 64
  // In place (ring attention; defaults: off): q and dout are (batch, q_rows, heads, head_dim) and the call's
  // queries their rows [q_row0, q_row0 + tq); with dq_state set, dQ (scaled) is added by the kernel straight into
  // rows [dq_row0, dq_row0 + tq) of that float32 (batch, dq_state_rows, heads, head_dim) array (dq_acc unused).
  int q_rows = 0, q_row0 = 0;  // q_rows 0: tq
  float* dq_state = nullptr;
  int dq_state_rows = 0, dq_row0 = 0;
  ElemType type;  // bf16 or f16
  float scale;    // > 0
  bool causal;
  int variant;    // 0 base, 1 dqfirst, 2 l2order_dqfirst (attention_bwd_kernel.cuh)
  // GQA head split (attention_bwd_kernel.cuh Globals::head_split): 1, or a divisor of heads / kv_heads; above 1,
  // dkv_acc is float32 (2, batch, tk, kv_heads, head_dim) scratch, zeroed by launch(), converted into dk and dv.
  int head_split = 1;
  float* dkv_acc = nullptr;
};

// Loads and configures every backward kernel on the current device (see lcsc::configure).
cudaError_t configure();
// configure() on GPU `ordinal` the first time it is asked for (thread-safe; restores the current device).
cudaError_t configure_once(int ordinal);
// Multiprocessor count of GPU `ordinal` (cached), 0 if it could not be configured.
int num_sms(int ordinal);
// Zeroes dq_acc (unless dq_state is set) and dkv_acc (head_split > 1), launches the kernel on `stream`, and with a
// head split converts dkv_acc into dk and dv. Throws std::invalid_argument naming the argument
// for shapes/types it does not take, std::runtime_error for CUDA failures.
void launch(const Problem& p, int compute_sms, cudaStream_t stream);

}  // namespace pk::attention_bwd
