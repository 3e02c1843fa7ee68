// Host-side TMA descriptors for row-major 2-D matrices (the tiles kernels move with
// pk::tma::load_tile_2d / store_tile_2d).
#pragma once
#include <cuda.h>

#include <cstdint>

namespace pk {

enum class ElemType { kBF16, kF16, kF32 };

inline int elem_bytes(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }

// A (rows x cols) row-major matrix at `base` (leading dimension `ld` elements), moved in boxes of
// box_rows x box_cols elements with the 128-byte swizzle (box_cols * element size must be 128).
// Throws std::runtime_error naming the violated TMA requirement.
CUtensorMap make_tensor_map_2d(const void* base, ElemType type, uint64_t rows, uint64_t cols, uint64_t ld,
                               uint32_t box_rows, uint32_t box_cols);

}  // namespace pk
