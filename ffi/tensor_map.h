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

// A stack of `count` row-major (rows x cols) matrices, contiguous (an (E, rows, cols) array), as a 3-D
// map with dims (cols, rows, count), moved in boxes of box_rows x box_cols of one matrix (128-byte
// swizzle, box_cols * element size = 128): rows past a matrix's end read as zeros / are not written.
CUtensorMap make_tensor_map_3d(const void* base, ElemType type, uint64_t count, uint64_t rows, uint64_t cols,
                               uint32_t box_rows, uint32_t box_cols);

// A (batch, seq, heads, head_dim) array (jax.nn.dot_product_attention's layout) as a 4-D map with
// dims (head_dim, heads, seq, batch), moved in boxes of `box_rows` sequence positions x 128 bytes (64
// 16-bit or 32 float32 elements, swizzled) of one head: a kernel's tile of one (batch, head) is box_rows x 64
// per box (float32: x 32), and rows past the sequence's end read as zeros / are not written.
CUtensorMap make_tensor_map_bthd(const void* base, ElemType type, uint64_t batch, uint64_t seq, uint64_t heads,
                                 uint64_t head_dim, uint32_t box_rows);

}  // namespace pk
