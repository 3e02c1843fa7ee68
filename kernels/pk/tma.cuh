// TMA bulk transfers (sm_90): one thread moves a whole contiguous run between shared memory and
// local or peer global memory while the rest of the SM keeps computing (intra-SM overlap).
//   load_async:      global (local or peer) -> shared, completion counted on an mbarrier
//   store_async:     shared -> global (local or peer), completion tracked by bulk groups
//   store_add_async: shared -> global with an in-flight add at the destination (P2P reduction)
// Sizes are multiples of 16 bytes, addresses 16-byte aligned.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace pk::tma {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier (intra-SM synchronization, ~tens of ns) ----
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// mbarrier.try_wait with a suspend-time hint of 10 ms (CUTLASS's ClusterBarrier value): a waiting thread sleeps
// until the phase completes instead of coming back after the short system default to retry. Without it the loader's
// and storer's lanes retried every ~18 cycles: ~20 % of the attention forward's issued instructions, on the
// consumers' schedulers (Nsight Compute, session 35).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, 10000000;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(smem_addr(bar)),
      "r"(phase)
      : "memory");
}

// ---- bulk copies ----
__device__ __forceinline__ void load_async(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void store_async(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}


template <typename T>
__device__ __forceinline__ void store_add_async(T* gmem_dst, const T* smem_src, uint32_t bytes);
template <>
__device__ __forceinline__ void store_add_async(__nv_bfloat16* gmem_dst, const __nv_bfloat16* smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}
template <>
__device__ __forceinline__ void store_add_async(__half* gmem_dst, const __half* smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.f16 [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}
template <>
__device__ __forceinline__ void store_add_async(float* gmem_dst, const float* smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Wait until at most N committed store groups are still reading shared memory.
template <int N>
__device__ __forceinline__ void wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Wait until at most N committed store groups are still incomplete (writes visible).
template <int N>
__device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// ---- tensor (tiled) copies through a CUtensorMap built on the host (kernels/pk/tensor_map.h) ----
// Coordinates are (column, row) of the box's first element; out-of-bounds parts of a box read as
// zeros and are not written, which is how edge tiles are handled.
__device__ __forceinline__ void load_tile_2d(void* smem_dst, const void* tmap, int col, int row, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(smem_addr(smem_dst)), "l"(tmap), "r"(col), "r"(row), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void store_tile_2d(const void* tmap, int col, int row, const void* smem_src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];"
               ::"l"(tmap), "r"(col), "r"(row), "r"(smem_addr(smem_src))
               : "memory");
}

// 3-D boxes (e.g. a stack of matrices (E, rows, cols): coordinates (col, row, matrix)); out-of-bounds
// parts read as zeros and are not written, so a box never spills into the next matrix.
__device__ __forceinline__ void load_tile_3d(void* smem_dst, const void* tmap, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(smem_addr(smem_dst)), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void store_tile_3d(const void* tmap, int c0, int c1, int c2, const void* smem_src) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];"
               ::"l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(smem_src))
               : "memory");
}

// 4-D boxes (e.g. (B, T, N, D) attention operands: coordinates (d, head, t, batch)); out-of-bounds
// parts read as zeros and are not written, as in 2-D.
__device__ __forceinline__ void load_tile_4d(void* smem_dst, const void* tmap, int c0, int c1, int c2, int c3,
                                             uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
      ::"r"(smem_addr(smem_dst)), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void store_tile_4d(const void* tmap, int c0, int c1, int c2, int c3, const void* smem_src) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
               ::"l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(smem_src))
               : "memory");
}

// Element-wise add of the box into global memory (the reduction a GEMM + reduce-scatter needs).
__device__ __forceinline__ void store_add_tile_2d(const void* tmap, int col, int row, const void* smem_src) {
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];"
               ::"l"(tmap), "r"(col), "r"(row), "r"(smem_addr(smem_src))
               : "memory");
}

// The same for a 4-D box (float32 add: ring attention's dQ state, (d, head, t, batch) coordinates).
__device__ __forceinline__ void store_add_tile_4d(const void* tmap, int c0, int c1, int c2, int c3, const void* smem_src) {
  asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
               ::"l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(smem_src))
               : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const void* tmap) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(tmap) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// Before the barrier's memory is used for anything else (e.g. a comm CTA turning to compute).
__device__ __forceinline__ void mbar_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Order generic-proxy shared-memory writes before async-proxy (TMA) reads of them.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace pk::tma
