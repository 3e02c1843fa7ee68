// Host interface of the grouped GEMM (kernels/grouped_gemm_kernel.cuh): jax.lax.ragged_dot and its VJP
// on contiguous ragged groups of rows, group sizes read on the device.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../ffi/tensor_map.h"

namespace pk::grouped {

// Block tiles: rows x columns of the output (kAuto picks one from n).
enum Tile : int { kAuto = -1, k128x256 = 0, k128x128 = 1, kNumTiles = 2 };

struct Problem {
  int mode;                    // Mode (grouped_gemm_kernel.cuh): 0 forward, 1 input grad, 2 weight grad
  const void* a;               // x (tokens, k); weight grad: x (tokens, m)
  const void* b;               // forward: w (E, k, n); input grad: w (E, n, k); weight grad: y (tokens, n)
  const int32_t* group_sizes;  // (E,) on the device
  void* out;                   // (tokens, n); weight grad: (E, m, n)
  int tokens, m, n, k;         // m: weight grad only; k: forward / input grad only
  int num_groups;
  ElemType type;               // bf16 or f16 (inputs and output)
  int variant;                 // Variant bits (grouped_gemm_kernel.cuh): 0 the default schedule; 1 dyn (tasks
                               // claimed at run time), 2 narrow (half-width MMAs for the n tail), 4 n128,
                               // 8 pipe (weight grad: 128x128 tiles, epilogue under the next tile's MMAs),
                               // 16 notail (rows past sum(group_sizes) left unwritten)
  // Forward / input grad: a second product summed into out (k2 > 0): a2 (tokens, k2) with b2 shaped as b
  // over k2 (moe_mlp's input grad of gate and up in one pass: no (tokens, n) sum afterwards).
  const void* a2 = nullptr;
  const void* b2 = nullptr;
  int k2 = 0;
};

// Why the kernel cannot run `p` ("" when it can): the Python side checks the same before binding.
const char* unsupported(const Problem& p);
int choose_tile(const Problem& p);
cudaError_t configure();
cudaError_t configure_once(int ordinal);
int num_sms(int ordinal);
// Throws std::invalid_argument for unsupported problems and std::runtime_error for CUDA failures.
// Empty outputs and an empty contraction (all zeros) are handled here. Returns the tile used.
int launch(const Problem& p, int tile, int compute_sms, cudaStream_t stream);

}  // namespace pk::grouped
