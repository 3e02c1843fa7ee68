// XLA FFI handlers `pk_swiglu_rows` and `pk_swiglu_rows_bwd` (kernels/swiglu_rows.cuh): SwiGLU of an MoE
// layer's expert rows on the rows in use only (group_sizes read on the device; rows past their sum are left
// unwritten). No per-call host state: command-buffer safe.
//   forward:  gate (R, F), up (R, F), group_sizes (E,) -> hidden (R, F)
//   backward: gate, up, d_hidden (R, F), group_sizes (E,) -> d_gate, d_up (R, F)
#include <cuda_runtime.h>

#include <string>

#include "../kernels/swiglu_rows.cuh"
#include "ffi_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Checks that every buffer is (R, F) of gate's dtype and fills the sizes; "" when they fit.
std::string rows_of(std::initializer_list<const ffi::AnyBuffer*> buffers, ffi::Buffer<ffi::S32>& group_sizes,
                    pk::swiglu::Rows& r) {
  const ffi::AnyBuffer& gate = **buffers.begin();
  const auto d = gate.dimensions();
  if (d.size() != 2) return "gate must be 2-D (R, F)";
  if (!pk::to_elem_type(gate.element_type(), r.type)) return "operands must be bfloat16 or float16";
  for (const ffi::AnyBuffer* b : buffers) {
    const auto db = b->dimensions();
    if (db.size() != 2 || db[0] != d[0] || db[1] != d[1] || b->element_type() != gate.element_type())
      return "every operand and result must be (R, F) of one dtype";
  }
  if (group_sizes.dimensions().size() != 1) return "group_sizes must be 1-D (E,)";
  r.rows = d[0], r.cols = d[1];
  r.group_sizes = group_sizes.typed_data();
  r.groups = int(group_sizes.dimensions()[0]);
  return "";
}

ffi::Error finish(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("pk_jax ") + what + ": " + cudaGetErrorString(e));
}

ffi::Error swiglu_forward(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> hidden) {
  pk::swiglu::Rows r{};
  const ffi::AnyBuffer& out = *hidden;
  if (std::string why = rows_of({&gate, &up, &out}, group_sizes, r); !why.empty())
    return ffi::Error::InvalidArgument("pk_jax swiglu_rows: " + why);
  r.gate = gate.untyped_data(), r.up = up.untyped_data(), r.hidden = hidden->untyped_data();
  if (const char* why = pk::swiglu::unsupported(r, false); *why)
    return ffi::Error::InvalidArgument(std::string("pk_jax swiglu_rows: ") + why);
  return finish(pk::swiglu::launch_forward(r, stream), "swiglu_rows");
}

ffi::Error swiglu_backward(cudaStream_t stream, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer d_hidden,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> d_gate,
                           ffi::Result<ffi::AnyBuffer> d_up) {
  pk::swiglu::Rows r{};
  const ffi::AnyBuffer &dg = *d_gate, &du = *d_up;
  if (std::string why = rows_of({&gate, &up, &d_hidden, &dg, &du}, group_sizes, r); !why.empty())
    return ffi::Error::InvalidArgument("pk_jax swiglu_rows_bwd: " + why);
  r.gate = gate.untyped_data(), r.up = up.untyped_data(), r.d_hidden = d_hidden.untyped_data();
  r.d_gate = d_gate->untyped_data(), r.d_up = d_up->untyped_data();
  if (const char* why = pk::swiglu::unsupported(r, true); *why)
    return ffi::Error::InvalidArgument(std::string("pk_jax swiglu_rows_bwd: ") + why);
  return finish(pk::swiglu::launch_backward(r, stream), "swiglu_rows_bwd");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkSwigluRows, swiglu_forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkSwigluRowsBwd, swiglu_backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
