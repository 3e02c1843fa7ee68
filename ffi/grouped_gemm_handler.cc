// XLA FFI handler `pk_grouped_matmul`: jax.lax.ragged_dot and its VJP on one GPU with our grouped GEMM
// (kernels/grouped_gemm.cuh). group_sizes stay on the device (the kernel reads them), so the handler
// has no per-call host state beyond the tensor maps it rebuilds each time: command-buffer safe.
//   mode 0 (forward):     x (m, k), w (E, k, n)               -> out (m, n)
//   mode 1 (input grad):  dy (m, k), w (E, n, k) (read as wᵀ)  -> out (m, n)
//   mode 2 (weight grad): x (m, k), dy (m, n)                 -> out (E, k, n)
// variant: schedule variant bits (pk_jax/moe/grouped_matmul.py, PK_JAX_GROUPED_VARIANT); 0 the default.
#include <cuda_runtime.h>

#include <string>

#include "../kernels/grouped_gemm.cuh"
#include "ffi_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error grouped_matmul(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer a, ffi::AnyBuffer b,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out, int32_t mode,
                          int32_t tile, int32_t variant) {
  const auto da = a.dimensions(), db = b.dimensions(), dg = group_sizes.dimensions(), dout = out->dimensions();
  if (dg.size() != 1) return ffi::Error::InvalidArgument("pk_jax grouped_matmul: group_sizes must be 1-D (E,)");
  const int64_t e = dg[0];
  pk::grouped::Problem p{};
  p.mode = mode;
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.group_sizes = group_sizes.typed_data();
  p.out = out->untyped_data();
  p.num_groups = int(e);
  p.variant = variant;
  if (da.size() != 2) return ffi::Error::InvalidArgument("pk_jax grouped_matmul: the first operand must be 2-D");
  p.tokens = int(da[0]);
  if (mode == 2) {
    if (db.size() != 2 || db[0] != da[0] || dout.size() != 3 || dout[0] != e || dout[1] != da[1] || dout[2] != db[1])
      return ffi::Error::InvalidArgument("pk_jax grouped_matmul (weight grad): x (m, k), dy (m, n) -> (E, k, n)");
    p.m = int(da[1]), p.n = int(db[1]);
  } else {
    const int64_t k_dim = mode == 1 ? 2 : 1, n_dim = mode == 1 ? 1 : 2;
    if (db.size() != 3 || db[0] != e || db[k_dim] != da[1] || dout.size() != 2 || dout[0] != da[0] ||
        dout[1] != db[n_dim])
      return ffi::Error::InvalidArgument(mode == 1 ? "pk_jax grouped_matmul (input grad): dy (m, k), w (E, n, k) -> (m, n)"
                                                   : "pk_jax grouped_matmul: x (m, k), w (E, k, n) -> (m, n)");
    p.k = int(da[1]), p.n = int(db[n_dim]);
  }
  if (!pk::to_elem_type(a.element_type(), p.type) || a.element_type() != b.element_type() ||
      out->element_type() != a.element_type() || p.type == pk::ElemType::kF32)
    return ffi::Error::InvalidArgument("pk_jax grouped_matmul: operands and output must be one of bfloat16, float16");
  if (const char* why = pk::grouped::unsupported(p); *why)
    return ffi::Error::InvalidArgument(std::string("pk_jax grouped_matmul: ") + why);
  if (cudaError_t err = pk::grouped::configure_once(ordinal); err != cudaSuccess)
    return ffi::Error::Internal(std::string("pk_jax grouped_matmul: configuring kernels: ") + cudaGetErrorString(err));
  const int sms = pk::grouped::num_sms(ordinal);
  return pk::launch_as_ffi_error([&] { pk::grouped::launch(p, tile, sms, stream); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkGroupedMatmul, grouped_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("variant"),
                              {ffi::Traits::kCmdBufferCompatible});
