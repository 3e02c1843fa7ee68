// Host interface of the single-GPU GEMM (kernels/gemm_kernel.cuh): C = op(A) @ op(B), row-major,
// with either operand stored transposed (read in place).
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "../ffi/tensor_map.h"

namespace pk::gemm {

// Block tiles the GEMM can run with; kAuto picks one from the shape (choose_tile).
enum Tile : int { kAuto = -1, k128x256 = 0, k128x128 = 1, k64x128 = 2, kNumTiles = 3 };

struct TileShape {
  int rows, cols;     // rows = 64 x consumer warpgroups
  double efficiency;  // relative tensor-core efficiency (bigger tiles reuse more), for choose_tile
};
inline constexpr TileShape kTileShapes[kNumTiles] = {{128, 256, 1.0}, {128, 128, 0.87}, {64, 128, 0.62}};

struct Problem {
  const void* a;  // M x K (transpose_a: K x M)
  const void* b;  // K x N (transpose_b: N x K)
  void* c;        // M x N
  int m, n, k;
  ElemType in, out;  // in: bf16 or f16; out: in or f32
  bool transpose_a = false, transpose_b = false;
};

const char* tile_name(int tile);
// Whether `tile` is built for these element types (128x256 is not for f32 output: no room for stages).
bool tile_available(int tile, ElemType in, ElemType out);
// The tile with the fewest estimated SM-waves x tile cost on `num_sms` SMs.
int choose_tile(const Problem& p, int num_sms);
// Loads and configures every GEMM kernel on the current device (see lcsc::configure).
cudaError_t configure();
// configure() on GPU `ordinal` the first time it is asked for that GPU (thread-safe; restores the
// current device). The runtime calls it for every GPU at start, before any cross-GPU wait.
cudaError_t configure_once(int ordinal);
// Multiprocessor count of GPU `ordinal` (cached).
int num_sms(int ordinal);
// Throws std::invalid_argument for unsupported types/shapes (the message names the argument) and
// std::runtime_error for CUDA failures. Returns the tile used.
int launch(const Problem& p, int tile, int compute_sms, cudaStream_t stream);

}  // namespace pk::gemm
