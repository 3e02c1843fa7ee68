#include "tensor_map.h"

#include <stdexcept>
#include <string>

#include "driver_api.h"

namespace pk {

namespace {

// The checks and the encode every map here shares: a 16-byte aligned base, 128-byte swizzled boxes,
// no interleave, zero fill out of bounds. dims/box innermost first; strides in bytes (rank - 1 of them).
CUtensorMap encode_swizzled(const void* base, ElemType type, cuuint32_t rank, const cuuint64_t* dims,
                            const cuuint64_t* strides, const cuuint32_t* box, const char* what) {
  if (reinterpret_cast<uintptr_t>(base) % 16)
    throw std::runtime_error("pk_jax: TMA needs 16-byte aligned array addresses");
  if (box[0] * uint64_t(elem_bytes(type)) != 128) throw std::runtime_error("pk_jax: swizzled boxes are 128 bytes wide");
  const CUtensorMapDataType dt = type == ElemType::kF32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                 : type == ElemType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                           : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  driver::check(driver::api().tensor_map_encode_tiled(
                    &map, dt, rank, const_cast<void*>(base), dims, strides, box, elem_strides,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                what);
  return map;
}

void check_row_bytes(uint64_t row_bytes) {
  if (row_bytes % 16)
    throw std::runtime_error("pk_jax: TMA needs rows that are a multiple of 16 bytes (got " +
                             std::to_string(row_bytes) + ")");
}

}  // namespace

CUtensorMap make_tensor_map_2d(const void* base, ElemType type, uint64_t rows, uint64_t cols, uint64_t ld,
                               uint32_t box_rows, uint32_t box_cols) {
  const uint64_t esize = uint64_t(elem_bytes(type));
  check_row_bytes(ld * esize);
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {ld * esize};
  const cuuint32_t box[2] = {box_cols, box_rows};
  return encode_swizzled(base, type, 2, dims, strides, box, "cuTensorMapEncodeTiled");
}

CUtensorMap make_tensor_map_3d(const void* base, ElemType type, uint64_t count, uint64_t rows, uint64_t cols,
                               uint32_t box_rows, uint32_t box_cols) {
  const uint64_t esize = uint64_t(elem_bytes(type));
  check_row_bytes(cols * esize);
  const cuuint64_t dims[3] = {cols, rows, count};
  const cuuint64_t strides[2] = {cols * esize, rows * cols * esize};
  const cuuint32_t box[3] = {box_cols, box_rows, 1};
  return encode_swizzled(base, type, 3, dims, strides, box, "cuTensorMapEncodeTiled (3-D)");
}

CUtensorMap make_tensor_map_bthd(const void* base, ElemType type, uint64_t batch, uint64_t seq, uint64_t heads,
                                 uint64_t head_dim, uint32_t box_rows) {
  const uint64_t esize = uint64_t(elem_bytes(type));
  if ((head_dim * esize) % 128)
    throw std::runtime_error("pk_jax: 4-D attention maps need head_dim * element bytes % 128 == 0");
  const cuuint64_t dims[4] = {head_dim, heads, seq, batch};
  const cuuint64_t strides[3] = {head_dim * esize, heads * head_dim * esize, seq * heads * head_dim * esize};
  const cuuint32_t box[4] = {uint32_t(128 / esize), 1, box_rows, 1};
  return encode_swizzled(base, type, 4, dims, strides, box, "cuTensorMapEncodeTiled (4-D)");
}

}  // namespace pk
