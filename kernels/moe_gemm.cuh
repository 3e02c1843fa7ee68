// Host interface of DispatchMatmul (kernels/moe_gemm_kernel.cuh): the MoE dispatch and the first grouped GEMM
// (gate and up projections) in one kernel, comm SMs pushing rows while the other SMs multiply the experts
// whose rows have landed.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../ffi/tensor_map.h"
#include "moe_dispatch.cuh"

namespace pk::moe {

struct Problem {
  Group group;
  MoeDims dims;                // T, K, E, R; row_vecs in 16-byte vectors
  ElemType type;               // bfloat16 or float16 (x, recv, weights, outputs)
  int hidden, ffn;             // H (x's row), F (w's columns)
  const void* x;               // (T, H)
  const int32_t* key;          // (T * K,) routing.plan_local's key, pos and order
  const int32_t* pos;
  const int32_t* order;
  const void* w_gate;          // (L, H, F)
  const void* w_up;            // (L, H, F)
  void* recv;                  // (R, H), reachable by the peers
  int32_t* recv_counts;        // (G, L)
  int32_t* send_row;           // (T * K,)
  int32_t* totals;             // (L,) scratch: the GEMM's group sizes
  void* gate;                  // (R, F)
  void* up;                    // (R, F)
  int num_sms;                 // SMs of the device (one CTA each)
  int num_comm_sms;            // of them pushing rows first (then computing)
};

// Why the kernel cannot run `p` ("" when it can); the Python side checks the same before binding.
const char* unsupported(const Problem& p);
// Loads and configures the kernels on the current device (before any cross-GPU wait can be in flight).
cudaError_t configure();
// Throws std::invalid_argument for unsupported problems and std::runtime_error for CUDA failures.
void launch(const Problem& p, cudaStream_t stream);

}  // namespace pk::moe
