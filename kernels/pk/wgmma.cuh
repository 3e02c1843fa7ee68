// Warpgroup MMA (sm_90a): shared-memory matrix descriptors for the 128-byte-swizzled tiles TMA
// writes, the wgmma issue/commit/wait protocol, and the producer/consumer register split.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <type_traits>

#include "wgmma_ops.cuh"

namespace pk::wgmma {

// Descriptor of a 128B-swizzled tile (layout type 1 in bits 62-63). Offsets are in bytes.
//  K-major (rows of 64 bf16 along K): SBO = 1024, the step between 8-row groups; LBO unused.
//  MN-major (rows of 64 bf16 along M/N, one row per k): LBO = the step between 64-wide MN blocks,
//  SBO = 1024, the step between groups of 8 k-rows.
__device__ __forceinline__ uint64_t desc_sw128(const void* smem, uint32_t lbo, uint32_t sbo) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

// The descriptor of the tile `bytes` further into shared memory (bytes: a multiple of 16). Only the start-address
// field (bits 0-13, address >> 4) changes and it cannot carry into the LBO field: shared addresses stay below
// 256 KiB. One 32-bit add per wgmma instead of a generic-to-shared conversion, mask and shift (desc_sw128): the
// attention loops build 18-26 descriptors per key block.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(desc) + (bytes >> 4));
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across an asynchronous wgmma.
template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

// d (+)= A(64 x 16) * B(16 x N) for element type T (bf16 or f16).
template <typename T, int N, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void mma(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, uint32_t scale_d) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static_assert(kBf16 || std::is_same_v<T, __half>, "wgmma: bf16 or f16 operands");
#define PK_WGMMA_SHAPE(n)                                                                  \
  if constexpr (N == n) {                                                                  \
    if constexpr (kBf16) mma_m64n##n##k16_bf16<TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d); \
    else mma_m64n##n##k16_f16<TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);                  \
    return;                                                                                \
  }
  PK_WGMMA_SHAPE(32)
  PK_WGMMA_SHAPE(64)
  PK_WGMMA_SHAPE(96)
  PK_WGMMA_SHAPE(128)
  PK_WGMMA_SHAPE(160)
  PK_WGMMA_SHAPE(176)
  PK_WGMMA_SHAPE(256)
#undef PK_WGMMA_SHAPE
  static_assert(N == 32 || N == 64 || N == 96 || N == 128 || N == 160 || N == 176 || N == 256,
                "wgmma: N is 32, 64, 96, 128, 160, 176 or 256");
}

// d (+)= A(64 x 16, registers) * B(16 x N, shared) for T = bf16 or f16; `a` holds the thread's four
// pairs of A in the accumulator layout (see wgmma_ops.cuh), e.g. probabilities converted in place.
template <typename T, int N, int TRANS_B>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, uint32_t scale_d) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static_assert(kBf16 || std::is_same_v<T, __half>, "wgmma: bf16 or f16 operands");
  if constexpr (N == 128) {
    if constexpr (kBf16) mma_rs_m64n128k16_bf16<TRANS_B>(d, a, desc_b, scale_d);
    else mma_rs_m64n128k16_f16<TRANS_B>(d, a, desc_b, scale_d);
  } else {
    static_assert(N == 64, "wgmma (A from registers): N is 64 or 128");
    if constexpr (kBf16) mma_rs_m64n64k16_bf16<TRANS_B>(d, a, desc_b, scale_d);
    else mma_rs_m64n64k16_f16<TRANS_B>(d, a, desc_b, scale_d);
  }
}

}  // namespace pk::wgmma
