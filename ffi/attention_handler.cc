// XLA FFI handler `pk_attention`: the attention forward kernel (kernels/attention.cuh) on one GPU.
// Operands q (B, Tq, N, D), k and v (B, Tk, Nkv, D), offsets int32[2] (q_offset, kv_offset);
// results o (B, Tq, N, D) in the input dtype and lse (B, N, Tq) float32 (written only when
// `with_lse` is 1; otherwise XLA still allocates it, as a (1,1,1) placeholder); `pipelined` picks the
// consumer schedule of variant 0 and `variant` the forward variant (0 default, 1 l2order, 2 pingpong,
// 3 fa3, 4 fa3n160, 5 fa3n176: kernels/attention_kernel.cuh; pk_jax/attention.py sets both when it lowers). Stateless per call
// (tensor maps rebuilt each time), so it can be captured into command buffers.
#include <cuda_runtime.h>

#include <string>

#include "../kernels/attention.cuh"
#include "ffi_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + ")";
}

ffi::Error attention(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                     float scale, int32_t causal, int32_t with_lse, int32_t pipelined, int32_t variant,
                     int32_t reserve_sms) {
  const auto dq = q.dimensions(), dk = k.dimensions(), dv = v.dimensions(), dout = o->dimensions();
  if (dq.size() != 4 || dk.size() != 4 || dv.size() != 4 || dout.size() != 4)
    return ffi::Error::InvalidArgument("pk_jax attention: q, k, v and o must be 4-D (batch, seq, heads, head_dim)");
  if (dk[0] != dq[0] || dk[3] != dq[3])
    return ffi::Error::InvalidArgument("pk_jax attention: k " + dims_str(dk) + " must share batch and head_dim with q " +
                                       dims_str(dq));
  for (int i = 0; i < 4; ++i)
    if (dv[i] != dk[i]) return ffi::Error::InvalidArgument("pk_jax attention: v " + dims_str(dv) + " must match k " + dims_str(dk));
  for (int i = 0; i < 4; ++i)
    if (dout[i] != dq[i]) return ffi::Error::InvalidArgument("pk_jax attention: o " + dims_str(dout) + " must match q " + dims_str(dq));
  if (causal != 0 && causal != 1) return ffi::Error::InvalidArgument("pk_jax attention: causal must be 0 or 1");
  if (with_lse != 0 && with_lse != 1) return ffi::Error::InvalidArgument("pk_jax attention: with_lse must be 0 or 1");
  if (pipelined != 0 && pipelined != 1) return ffi::Error::InvalidArgument("pk_jax attention: pipelined must be 0 or 1");
  if (variant < 0 || variant > 5)
    return ffi::Error::InvalidArgument(
        "pk_jax attention: variant must be 0..5 (default, l2order, pingpong, fa3, fa3n160, fa3n176)");
  if (offsets.element_type() != ffi::DataType::S32 || offsets.element_count() != 2)
    return ffi::Error::InvalidArgument("pk_jax attention: offsets must be int32[2] (q_offset, kv_offset)");
  if (lse->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("pk_jax attention: lse must be float32");
  const auto dl = lse->dimensions();
  if (with_lse && (dl.size() != 3 || dl[0] != dq[0] || dl[1] != dq[2] || dl[2] != dq[1]))
    return ffi::Error::InvalidArgument("pk_jax attention: lse " + dims_str(dl) + " must be (batch, heads, tq) of q " +
                                       dims_str(dq));
  pk::attention::Problem p{};
  if (!pk::to_elem_type(q.element_type(), p.type) || p.type == pk::ElemType::kF32 ||
      k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      o->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("pk_jax attention: q, k, v and o must all be bfloat16 or all float16");
  p.q = q.untyped_data(), p.k = k.untyped_data(), p.v = v.untyped_data(), p.o = o->untyped_data();
  p.lse = with_lse ? static_cast<float*>(lse->untyped_data()) : nullptr;
  p.offsets = static_cast<const int*>(offsets.untyped_data());
  p.batch = int(dq[0]), p.tq = int(dq[1]), p.heads = int(dq[2]), p.head_dim = int(dq[3]);
  p.tk = int(dk[1]), p.kv_heads = int(dk[2]);
  p.scale = scale;
  p.causal = causal == 1;
  p.pipelined = pipelined == 1;
  p.variant = variant;
  if (cudaError_t e = pk::attention::configure_once(ordinal); e != cudaSuccess)
    return ffi::Error::Internal(std::string("pk_jax attention: configuring kernels: ") + cudaGetErrorString(e));
  const int sms = pk::sms_after_reserve(pk::attention::num_sms(ordinal), reserve_sms);
  return pk::launch_as_ffi_error([&] { pk::attention::launch(p, sms, stream); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAttention, attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("with_lse")
                                  .Attr<int32_t>("pipelined")
                                  .Attr<int32_t>("variant")
                                  .Attr<int32_t>("reserve_sms"),
                              {ffi::Traits::kCmdBufferCompatible});
