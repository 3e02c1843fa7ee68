// The 128-byte swizzle that TMA (CU_TENSOR_MAP_SWIZZLE_128B) and wgmma descriptors agree on: inside
// each 1024-byte block of 8 rows x 128 bytes, the 16-byte chunk c of row r lives at chunk c ^ (r % 8).
// Tiles are stored as boxes of `rows` x 128 bytes; this is the one place that index math lives.
#pragma once
#include <cstdint>

namespace pk {

__host__ __device__ constexpr uint32_t swizzle128(uint32_t row, uint32_t byte_in_row) {
  return row * 128 + ((((byte_in_row >> 4) ^ row) & 7) << 4) + (byte_in_row & 15);
}

// Byte offset of element (row, col) of a tile stored as consecutive boxes of 128-byte rows
// (box b holds columns [b * 128 / sizeof(T), (b + 1) * 128 / sizeof(T)) of all `rows` rows).
template <typename T>
__host__ __device__ constexpr uint32_t swizzled_tile_offset(uint32_t row, uint32_t col, uint32_t rows) {
  constexpr uint32_t kBoxCols = 128 / sizeof(T);
  return (col / kBoxCols) * rows * 128 + swizzle128(row, (col % kBoxCols) * sizeof(T));
}

}  // namespace pk
