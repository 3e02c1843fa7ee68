#include "tensor_map.h"

#include <stdexcept>
#include <string>

#include "driver_api.h"

namespace pk {

CUtensorMap make_tensor_map_2d(const void* base, ElemType type, uint64_t rows, uint64_t cols, uint64_t ld,
                               uint32_t box_rows, uint32_t box_cols) {
  const uint64_t esize = uint64_t(elem_bytes(type));
  if (reinterpret_cast<uintptr_t>(base) % 16)
    throw std::runtime_error("pk_jax: TMA needs 16-byte aligned matrix addresses");
  if ((ld * esize) % 16)
    throw std::runtime_error("pk_jax: TMA needs rows that are a multiple of 16 bytes (got " +
                             std::to_string(ld * esize) + ")");
  if (box_cols * esize != 128) throw std::runtime_error("pk_jax: swizzled boxes are 128 bytes wide");
  const CUtensorMapDataType dt = type == ElemType::kF32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                 : type == ElemType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                           : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUtensorMap map;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {ld * esize};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  driver::check(driver::api().tensor_map_encode_tiled(
                    &map, dt, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                "cuTensorMapEncodeTiled");
  return map;
}

CUtensorMap make_tensor_map_3d(const void* base, ElemType type, uint64_t count, uint64_t rows, uint64_t cols,
                               uint32_t box_rows, uint32_t box_cols) {
  const uint64_t esize = uint64_t(elem_bytes(type));
  if (reinterpret_cast<uintptr_t>(base) % 16)
    throw std::runtime_error("pk_jax: TMA needs 16-byte aligned array addresses");
  if ((cols * esize) % 16)
    throw std::runtime_error("pk_jax: TMA needs rows that are a multiple of 16 bytes (got " +
                             std::to_string(cols * esize) + ")");
  if (box_cols * esize != 128) throw std::runtime_error("pk_jax: swizzled boxes are 128 bytes wide");
  const CUtensorMapDataType dt = type == ElemType::kF32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                 : type == ElemType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                           : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUtensorMap map;
  const cuuint64_t dims[3] = {cols, rows, count};
  const cuuint64_t strides[2] = {cols * esize, rows * cols * esize};
  const cuuint32_t box[3] = {box_cols, box_rows, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  driver::check(driver::api().tensor_map_encode_tiled(
                    &map, dt, 3, const_cast<void*>(base), dims, strides, box, elem_strides,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                "cuTensorMapEncodeTiled (3-D)");
  return map;
}

CUtensorMap make_tensor_map_bthd(const void* base, ElemType type, uint64_t batch, uint64_t seq, uint64_t heads,
                                 uint64_t head_dim, uint32_t box_rows) {
  const uint64_t esize = uint64_t(elem_bytes(type));
  if (reinterpret_cast<uintptr_t>(base) % 16)
    throw std::runtime_error("pk_jax: TMA needs 16-byte aligned array addresses");
  if ((head_dim * esize) % 128) throw std::runtime_error("pk_jax: 4-D attention maps need head_dim * 2 bytes % 128 == 0");
  if (type == ElemType::kF32) throw std::runtime_error("pk_jax: attention maps are 16-bit");
  const CUtensorMapDataType dt =
      type == ElemType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  CUtensorMap map;
  const cuuint64_t dims[4] = {head_dim, heads, seq, batch};
  const cuuint64_t strides[3] = {head_dim * esize, heads * head_dim * esize, seq * heads * head_dim * esize};
  const cuuint32_t box[4] = {uint32_t(128 / esize), 1, box_rows, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  driver::check(driver::api().tensor_map_encode_tiled(
                    &map, dt, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                "cuTensorMapEncodeTiled (4-D)");
  return map;
}

}  // namespace pk
