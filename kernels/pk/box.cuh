// Strided boxes: every collective moves a box of rows (up to 3 outer dimensions, any strides) whose
// innermost run is contiguous on both sides. This is the one place that turns a row index into
// source/destination offsets; all kernels use it. Units are "vectors" (VEC bytes), chosen on the
// Python side so that every stride and offset is a whole number of vectors.
#pragma once
#include <cstdint>

namespace pk {

constexpr int kMaxOuterDims = 3;

struct Box {
  int64_t rows;                          // product of outer extents
  int64_t inner;                         // contiguous vectors per row
  int64_t extent[kMaxOuterDims];         // outer extents, outermost first (unused dims = 1)
  int64_t src_stride[kMaxOuterDims];     // vectors
  int64_t dst_stride[kMaxOuterDims];
  int64_t src_rank_offset, src_peer_offset;  // src origin = rank*src_rank_offset + peer*src_peer_offset
  int64_t dst_rank_offset, dst_peer_offset;  // dst origin likewise

  // Offsets of row `row` (without origins).
  __host__ __device__ void row_offsets(int64_t row, int64_t& src, int64_t& dst) const {
    src = 0;
    dst = 0;
#pragma unroll
    for (int d = kMaxOuterDims - 1; d >= 0; --d) {
      const int64_t i = row % extent[d];
      row /= extent[d];
      src += i * src_stride[d];
      dst += i * dst_stride[d];
    }
  }
  __host__ __device__ int64_t src_origin(int rank, int peer) const {
    return rank * src_rank_offset + peer * src_peer_offset;
  }
  __host__ __device__ int64_t dst_origin(int rank, int peer) const {
    return rank * dst_rank_offset + peer * dst_peer_offset;
  }
};

// A warp moves one "segment": kLanes x UNROLL consecutive vectors of one row.
template <int UNROLL>
struct Segments {
  static constexpr int64_t kVectors = 32 * UNROLL;
  __host__ __device__ static int64_t per_row(const Box& b) { return (b.inner + kVectors - 1) / kVectors; }
};

}  // namespace pk
