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

// SMs a persistent kernel takes when `reserve` of the device's `sms` are left free for traffic on another
// stream (ring attention's K/V blocks: the `reserve_sms` attribute); all of them when reserve is 0 or too big.
inline int sms_after_reserve(int sms, int reserve) { return reserve > 0 && reserve < sms ? sms - reserve : sms; }

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
