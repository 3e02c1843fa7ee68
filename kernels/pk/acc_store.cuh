// A warpgroup's 64 x N fp32 accumulator (wgmma layout) -> shared memory as OutT, in one of two
// layouts: SwizzledBoxes (what TMA tensor stores read, pk/swizzle.cuh) or PaddedRows (contiguous rows
// for 1-D bulk copies; the 16-byte pad keeps the 8 rows of a stmatrix block in different banks).
// 16-bit outputs go through stmatrix (four 8x8 blocks per instruction); fp32 through 8-byte stores.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "swizzle.cuh"

namespace pk {

template <typename OutT>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<OutT, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

template <typename OutT>
struct SwizzledBoxes {
  static constexpr uint32_t slot_bytes(int n) { return 64u * n * sizeof(OutT); }
  __device__ static uint32_t offset(uint32_t row, uint32_t col) { return swizzled_tile_offset<OutT>(row, col, 64); }
};

template <typename OutT, int N>
struct PaddedRows {
  static constexpr uint32_t kPitch = N * sizeof(OutT) + 16;
  static constexpr uint32_t slot_bytes(int) { return 64u * kPitch; }
  __device__ static uint32_t offset(uint32_t row, uint32_t col) { return row * kPitch + col * sizeof(OutT); }
};

template <typename OutT, int N, class Layout = SwizzledBoxes<OutT>>
__device__ __forceinline__ void store_acc(OutT* tile, const float (&acc)[N / 2]) {
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  if constexpr (sizeof(OutT) == 2) {
    // Lane L addresses row L % 8 of block L / 8: blocks are (rows +0/+8) x (columns j, j + 8).
    const uint32_t row = warp * 16 + ((lane / 8) % 2) * 8 + lane % 8;
    const uint32_t col_shift = (lane / 16) * 8;
#pragma unroll
    for (int j = 0; j < N / 8; j += 2) {
      const uint32_t addr = base + Layout::offset(row, j * 8 + col_shift);
      const uint32_t r0 = pack2<OutT>(acc[4 * j], acc[4 * j + 1]), r1 = pack2<OutT>(acc[4 * j + 2], acc[4 * j + 3]);
      const uint32_t r2 = pack2<OutT>(acc[4 * j + 4], acc[4 * j + 5]);
      const uint32_t r3 = pack2<OutT>(acc[4 * j + 6], acc[4 * j + 7]);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
                   "r"(r2), "r"(r3)
                   : "memory");
    }
  } else {
    const uint32_t row = warp * 16 + lane / 4, col = (lane % 4) * 2;
#pragma unroll
    for (int i = 0; i < N / 2; i += 2) {  // register pair i: row + 8 * ((i / 2) % 2), column 8 * (i / 4) + col
      const uint32_t addr = base + Layout::offset(row + ((i / 2) % 2) * 8, (i / 4) * 8 + col);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(acc[i]), "f"(acc[i + 1]) : "memory");
    }
  }
}

}  // namespace pk
