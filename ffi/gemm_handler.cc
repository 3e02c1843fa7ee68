// XLA FFI handler `pk_matmul`: C = op(A) @ op(B) on one GPU with our LCSC GEMM (kernels/gemm.cuh);
// transpose_a: a is stored (k, m), transpose_b: b is stored (n, k), both read in place.
// Stateless per call (tensor maps are rebuilt from the buffers each time, ~1 us of host work), so it
// is safe to capture into XLA's command buffers.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "../kernels/gemm.cuh"
#include "ffi_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error matmul(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer a, ffi::AnyBuffer b,
                  ffi::Result<ffi::AnyBuffer> c, int32_t tile, int32_t compute_sms, int32_t transpose_a,
                  int32_t transpose_b) {
  if ((transpose_a != 0 && transpose_a != 1) || (transpose_b != 0 && transpose_b != 1))
    return ffi::Error::InvalidArgument("pk_jax matmul: transpose_a and transpose_b must be 0 or 1");
  const auto da = a.dimensions(), db = b.dimensions(), dc = c->dimensions();
  if (da.size() != 2 || db.size() != 2 || dc.size() != 2)
    return ffi::Error::InvalidArgument("pk_jax matmul: a, b and c must be 2-D");
  const int64_t m = da[transpose_a], k = da[1 - transpose_a], n = db[1 - transpose_b];
  if (db[transpose_b] != k)
    return ffi::Error::InvalidArgument(std::string("pk_jax matmul: b must be ") + (transpose_b ? "(n, k)" : "(k, n)") +
                                       " with the k of a, stored " + (transpose_a ? "(k, m)" : "(m, k)") +
                                       " (transpose_a / transpose_b vs the buffer dims)");
  if (dc[0] != m || dc[1] != n)
    return ffi::Error::InvalidArgument("pk_jax matmul: c must be (m, n) of op(a) @ op(b)");
  pk::gemm::Problem p{a.untyped_data(), b.untyped_data(), c->untyped_data(), int(m), int(n), int(k),
                      pk::ElemType::kBF16, pk::ElemType::kBF16, transpose_a == 1, transpose_b == 1};
  if (!pk::to_elem_type(a.element_type(), p.in) || a.element_type() != b.element_type())
    return ffi::Error::InvalidArgument("pk_jax matmul: a, b must be bfloat16 or float16 (same dtype)");
  if (!pk::to_elem_type(c->element_type(), p.out))
    return ffi::Error::InvalidArgument("pk_jax matmul: the output must be the input dtype or float32");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {
    const cudaError_t e = cudaMemsetAsync(p.c, 0, size_t(p.m) * p.n * pk::elem_bytes(p.out), stream);
    return e == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(e));
  }
  if (cudaError_t e = pk::gemm::configure_once(ordinal); e != cudaSuccess)
    return ffi::Error::Internal(std::string("pk_jax matmul: configuring kernels: ") + cudaGetErrorString(e));
  const int sms = pk::gemm::num_sms(ordinal);
  return pk::launch_as_ffi_error(
      [&] { pk::gemm::launch(p, tile, compute_sms > 0 && compute_sms < sms ? compute_sms : sms, stream); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMatmul, matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("compute_sms")
                                  .Attr<int32_t>("transpose_a")
                                  .Attr<int32_t>("transpose_b"),
                              {ffi::Traits::kCmdBufferCompatible});
