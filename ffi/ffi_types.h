// Glue between XLA FFI and the kernels' host interfaces: element types and error reporting.
#pragma once
#include <stdexcept>

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

// Runs a launch that reports bad arguments as std::invalid_argument and failures as other
// exceptions, as the matching XLA FFI error.
template <typename Launch>
xla::ffi::Error launch_as_ffi_error(Launch launch) {
  try {
    launch();
  } catch (const std::invalid_argument& e) {
    return xla::ffi::Error::InvalidArgument(e.what());
  } catch (const std::exception& e) {
    return xla::ffi::Error::Internal(e.what());
  }
  return xla::ffi::Error::Success();
}

}  // namespace pk
