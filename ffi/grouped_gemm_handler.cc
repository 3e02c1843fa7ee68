// XLA FFI handler `pk_grouped_matmul`: jax.lax.ragged_dot and its VJP on one GPU with our grouped GEMM
// (kernels/grouped_gemm.cuh). group_sizes stay on the device (the kernel reads them), so the handler
// has no per-call host state beyond the tensor maps it rebuilds each time: command-buffer safe.
//   mode 0 (forward):     x (m, k), w (E, k, n)               -> out (m, n)
//   mode 1 (input grad):  dy (m, k), w (E, n, k) (read as wᵀ)  -> out (m, n)
//   mode 2 (weight grad): x (m, k), dy (m, n)                 -> out (E, k, n)
// variant: schedule variant bits (pk_jax/moe/grouped_matmul.py, PK_JAX_GROUPED_VARIANT); 0 the default.
// `pk_grouped_matmul_sum` (mode 0 or 1): a, b, a2, b2, group_sizes -> out = a @ b[e] + a2 @ b2[e] in one pass.
#include <cuda_runtime.h>

#include <string>

#include "../kernels/grouped_gemm.cuh"
#include "ffi_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The problem of one product (a, b -> out) in `mode`, or why its shapes do not fit ("" when they do).
std::string problem_of(int32_t mode, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> group_sizes,
                       ffi::Result<ffi::AnyBuffer>& out, int32_t variant, pk::grouped::Problem& p) {
  const auto da = a.dimensions(), db = b.dimensions(), dg = group_sizes.dimensions(), dout = out->dimensions();
  if (dg.size() != 1) return "group_sizes must be 1-D (E,)";
  const int64_t e = dg[0];
  p.mode = mode;
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  p.group_sizes = group_sizes.typed_data();
  p.out = out->untyped_data();
  p.num_groups = int(e);
  p.variant = variant;
  if (da.size() != 2) return "the first operand must be 2-D";
  p.tokens = int(da[0]);
  if (mode == 2) {
    if (db.size() != 2 || db[0] != da[0] || dout.size() != 3 || dout[0] != e || dout[1] != da[1] || dout[2] != db[1])
      return "(weight grad): x (m, k), dy (m, n) -> (E, k, n)";
    p.m = int(da[1]), p.n = int(db[1]);
  } else {
    const int64_t k_dim = mode == 1 ? 2 : 1, n_dim = mode == 1 ? 1 : 2;
    if (db.size() != 3 || db[0] != e || db[k_dim] != da[1] || dout.size() != 2 || dout[0] != da[0] ||
        dout[1] != db[n_dim])
      return mode == 1 ? "(input grad): dy (m, k), w (E, n, k) -> (m, n)" : "x (m, k), w (E, k, n) -> (m, n)";
    p.k = int(da[1]), p.n = int(db[n_dim]);
  }
  if (!pk::to_elem_type(a.element_type(), p.type) || a.element_type() != b.element_type() ||
      out->element_type() != a.element_type() || p.type == pk::ElemType::kF32)
    return "operands and output must be one of bfloat16, float16";
  return "";
}

ffi::Error launch(cudaStream_t stream, int32_t ordinal, const pk::grouped::Problem& p, int32_t tile) {
  if (const char* why = pk::grouped::unsupported(p); *why)
    return ffi::Error::InvalidArgument(std::string("pk_jax grouped_matmul: ") + why);
  if (cudaError_t err = pk::grouped::configure_once(ordinal); err != cudaSuccess)
    return ffi::Error::Internal(std::string("pk_jax grouped_matmul: configuring kernels: ") + cudaGetErrorString(err));
  const int sms = pk::grouped::num_sms(ordinal);
  return pk::launch_as_ffi_error([&] { pk::grouped::launch(p, tile, sms, stream); });
}

ffi::Error grouped_matmul(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer a, ffi::AnyBuffer b,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out, int32_t mode,
                          int32_t tile, int32_t variant) {
  pk::grouped::Problem p{};
  if (std::string why = problem_of(mode, a, b, group_sizes, out, variant, p); !why.empty())
    return ffi::Error::InvalidArgument("pk_jax grouped_matmul: " + why);
  return launch(stream, ordinal, p, tile);
}

// Two products of one mode summed: out = a @ b[e] (+) a2 @ b2[e] over each group's rows (mode 0 or 1).
ffi::Error grouped_matmul_sum(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer a, ffi::AnyBuffer b,
                              ffi::AnyBuffer a2, ffi::AnyBuffer b2, ffi::Buffer<ffi::S32> group_sizes,
                              ffi::Result<ffi::AnyBuffer> out, int32_t mode, int32_t tile, int32_t variant) {
  if (mode != 0 && mode != 1) return ffi::Error::InvalidArgument("pk_jax grouped_matmul_sum: mode must be 0 or 1");
  pk::grouped::Problem p{}, second{};
  if (std::string why = problem_of(mode, a, b, group_sizes, out, variant, p); !why.empty())
    return ffi::Error::InvalidArgument("pk_jax grouped_matmul_sum (first product): " + why);
  if (std::string why = problem_of(mode, a2, b2, group_sizes, out, variant, second); !why.empty())
    return ffi::Error::InvalidArgument("pk_jax grouped_matmul_sum (second product): " + why);
  if (a2.element_type() != a.element_type())
    return ffi::Error::InvalidArgument("pk_jax grouped_matmul_sum: both products must share one dtype");
  p.a2 = second.a, p.b2 = second.b, p.k2 = second.k;
  return launch(stream, ordinal, p, tile);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkGroupedMatmulSum, grouped_matmul_sum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("variant"),
                              {ffi::Traits::kCmdBufferCompatible});
