// XLA FFI element types -> the kernels' ElemType.
#pragma once
#include "tensor_map.h"
#include "xla/ffi/api/ffi.h"

namespace pk {

inline bool to_elem_type(xla::ffi::DataType t, ElemType& out) {
  switch (t) {
    case xla::ffi::DataType::BF16: out = ElemType::kBF16; return true;
    case xla::ffi::DataType::F16: out = ElemType::kF16; return true;
    case xla::ffi::DataType::F32: out = ElemType::kF32; return true;
    default: return false;
  }
}

}  // namespace pk
