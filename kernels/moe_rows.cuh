// Row movement shared by the fused MoE kernels (moe_dispatch.cu, moe_partials.cu): warp items of one row
// segment (kSegVecs vectors: 4 per lane), the zeroing of a buffer's tail. Docs: docs/design-moe.md.
#pragma once
#include <cstdint>
#include <cstring>

#include "pk/vec.cuh"
#include "pk/warp_work.cuh"

namespace pk {

constexpr int kMoeThreads = 512;
constexpr int kMoeUnroll = 4;                  // vectors per lane per row segment
constexpr int64_t kSegVecs = 32 * kMoeUnroll;  // vectors of one warp item

using Warps = WarpWork;  // pk/warp_work.cuh

__host__ __device__ __forceinline__ int64_t moe_segments(int64_t row_vecs) { return (row_vecs + kSegVecs - 1) / kSegVecs; }

// Warp items for `rows` rows (at least one: a grid of one CTA still runs the protocol).
inline int64_t moe_warp_items(int64_t rows, int64_t row_vecs) {
  const int64_t n = rows * moe_segments(row_vecs);
  return n > 1 ? n : 1;
}

// Zeroes vectors [from, to) of buf, strided over `stride` threads, this one being `index`.
template <int VEC>
__device__ __forceinline__ void zero_vecs(char* buf, int64_t from, int64_t to, int64_t index, int64_t stride) {
  vec_t<VEC> z;
  memset(&z, 0, sizeof(z));
  for (int64_t i = from + index; i < to; i += stride) store_vec<VEC>(buf, i, z);
}

// Zeroes rows [from_row, rows) of this member's buffer, grid-strided.
template <int VEC>
__device__ __forceinline__ void zero_rows(char* buf, int64_t from_row, int64_t rows, int64_t row_vecs) {
  zero_vecs<VEC>(buf, from_row * row_vecs, rows * row_vecs, int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                 int64_t(gridDim.x) * blockDim.x);
}

// One warp segment's vectors into registers (`left`: vectors of the row from the segment's start).
template <int VEC>
__device__ __forceinline__ void load_segment(const char* src, int64_t src_vec, int64_t left, int lane,
                                             vec_t<VEC> (&v)[kMoeUnroll]) {
#pragma unroll
  for (int u = 0; u < kMoeUnroll; ++u) {
    const int64_t i = u * 32 + lane;
    if (i < left) v[u] = load_vec<VEC>(src, src_vec + i);
  }
}

template <int VEC>
__device__ __forceinline__ void store_segment(char* dst, int64_t dst_vec, int64_t left, int lane,
                                              const vec_t<VEC> (&v)[kMoeUnroll]) {
#pragma unroll
  for (int u = 0; u < kMoeUnroll; ++u) {
    const int64_t i = u * 32 + lane;
    if (i < left) store_vec<VEC>(dst, dst_vec + i, v[u]);
  }
}

// One warp item: vectors [seg * kSegVecs, +kSegVecs) of a row, src row -> dst row.
template <int VEC>
__device__ __forceinline__ void copy_segment(const char* src, int64_t src_vec, char* dst, int64_t dst_vec, int64_t left,
                                             int lane) {
  vec_t<VEC> v[kMoeUnroll];
  load_segment<VEC>(src, src_vec, left, lane, v);
  store_segment<VEC>(dst, dst_vec, left, lane, v);
}

}  // namespace pk
