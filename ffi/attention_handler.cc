// XLA FFI handler `pk_attention`: the attention forward kernel (kernels/attention.cuh) on one GPU.
// Operands q (B, Tq, N, D), k and v (B, Tk, Nkv, D), offsets int32[2] (q_offset, kv_offset);
// results o (B, Tq, N, D) in the input dtype and lse (B, N, Tq) float32 (written only when
// `with_lse` is 1; otherwise XLA still allocates it, as a (1,1,1) placeholder); `pipelined` picks the
// consumer schedule of variant 0 and `variant` the forward variant (0 default, 1 l2order, 2 pingpong,
// 3 fa3, 4 fa3n160, 5 fa3n176, 6 fa3w3: kernels/attention_kernel.cuh; pk_jax/attention.py sets both when it lowers). Stateless per call
// (tensor maps rebuilt each time), so it can be captured into command buffers. `pk_attention_accumulate`
// (below): the same kernel writing or merging a block into ring attention's float32 state in place.
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

// q, k, v and offsets checked and copied into `p` (type, pointers, shapes, scale, causal, variant), or the error.
ffi::Error problem_of(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer offsets, float scale,
                      int32_t causal, int32_t variant, pk::attention::Problem& p) {
  const auto dq = q.dimensions(), dk = k.dimensions(), dv = v.dimensions();
  if (dq.size() != 4 || dk.size() != 4 || dv.size() != 4)
    return ffi::Error::InvalidArgument("pk_jax attention: q, k and v must be 4-D (batch, seq, heads, head_dim)");
  if (dk[0] != dq[0] || dk[3] != dq[3])
    return ffi::Error::InvalidArgument("pk_jax attention: k " + dims_str(dk) + " must share batch and head_dim with q " +
                                       dims_str(dq));
  for (int i = 0; i < 4; ++i)
    if (dv[i] != dk[i]) return ffi::Error::InvalidArgument("pk_jax attention: v " + dims_str(dv) + " must match k " + dims_str(dk));
  if (causal != 0 && causal != 1) return ffi::Error::InvalidArgument("pk_jax attention: causal must be 0 or 1");
  if (variant < 0 || variant > 6)
    return ffi::Error::InvalidArgument(
        "pk_jax attention: variant must be 0..6 (default, l2order, pingpong, fa3, fa3n160, fa3n176, fa3w3)");
  if (offsets.element_type() != ffi::DataType::S32 || offsets.element_count() != 2)
    return ffi::Error::InvalidArgument("pk_jax attention: offsets must be int32[2] (q_offset, kv_offset)");
  if (!pk::to_elem_type(q.element_type(), p.type) || p.type == pk::ElemType::kF32 ||
      k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return ffi::Error::InvalidArgument("pk_jax attention: q, k and v must all be bfloat16 or all float16");
  p.q = q.untyped_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.offsets = static_cast<const int*>(offsets.untyped_data());
  p.batch = int(dq[0]), p.tq = int(dq[1]), p.heads = int(dq[2]), p.head_dim = int(dq[3]);
  p.tk = int(dk[1]), p.kv_heads = int(dk[2]);
  p.scale = scale;
  p.causal = causal == 1;
  p.variant = variant;
  return ffi::Error::Success();
}

ffi::Error run(const pk::attention::Problem& p, cudaStream_t stream, int32_t ordinal, int32_t reserve_sms) {
  if (cudaError_t e = pk::attention::configure_once(ordinal); e != cudaSuccess)
    return ffi::Error::Internal(std::string("pk_jax attention: configuring kernels: ") + cudaGetErrorString(e));
  const int sms = pk::sms_after_reserve(pk::attention::num_sms(ordinal), reserve_sms);
  return pk::launch_as_ffi_error([&] { pk::attention::launch(p, sms, stream); });
}

ffi::Error attention(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                     float scale, int32_t causal, int32_t with_lse, int32_t pipelined, int32_t variant,
                     int32_t reserve_sms) {
  pk::attention::Problem p{};
  if (ffi::Error e = problem_of(q, k, v, offsets, scale, causal, variant, p); e.failure()) return e;
  const auto dq = q.dimensions(), dout = o->dimensions();
  if (dout.size() != 4) return ffi::Error::InvalidArgument("pk_jax attention: o must be 4-D like q");
  for (int i = 0; i < 4; ++i)
    if (dout[i] != dq[i]) return ffi::Error::InvalidArgument("pk_jax attention: o " + dims_str(dout) + " must match q " + dims_str(dq));
  if (o->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("pk_jax attention: o must have q's dtype");
  if (with_lse != 0 && with_lse != 1) return ffi::Error::InvalidArgument("pk_jax attention: with_lse must be 0 or 1");
  if (pipelined != 0 && pipelined != 1) return ffi::Error::InvalidArgument("pk_jax attention: pipelined must be 0 or 1");
  if (lse->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("pk_jax attention: lse must be float32");
  const auto dl = lse->dimensions();
  if (with_lse && (dl.size() != 3 || dl[0] != dq[0] || dl[1] != dq[2] || dl[2] != dq[1]))
    return ffi::Error::InvalidArgument("pk_jax attention: lse " + dims_str(dl) + " must be (batch, heads, tq) of q " +
                                       dims_str(dq));
  p.o = o->untyped_data();
  p.lse = with_lse ? static_cast<float*>(lse->untyped_data()) : nullptr;
  p.pipelined = pipelined == 1;
  return run(p, stream, ordinal, reserve_sms);
}

// pk_attention_accumulate: ring attention's block into its float32 state in place. Operands q, k, v, offsets,
// acc (B, S, N, D) float32 and lse (B, N, S) float32; results acc and lse (aliased to those operands). q's rows
// are rows [row_start, row_start + Tq) of the state; mode 1 writes them, 2 merges with them (the kernel's
// accumulate_rows). Stateless, as the forward.
ffi::Error accumulate(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::AnyBuffer offsets, ffi::AnyBuffer acc_in, ffi::AnyBuffer lse_in,
                      ffi::Result<ffi::AnyBuffer> acc, ffi::Result<ffi::AnyBuffer> lse, float scale, int32_t causal,
                      int32_t mode, int64_t row_start, int32_t variant, int32_t reserve_sms) {
  pk::attention::Problem p{};
  if (ffi::Error e = problem_of(q, k, v, offsets, scale, causal, variant, p); e.failure()) return e;
  const auto dq = q.dimensions(), da = acc->dimensions(), dl = lse->dimensions();
  if (mode != 1 && mode != 2) return ffi::Error::InvalidArgument("pk_jax attention accumulate: mode must be 1 or 2");
  if (acc->element_type() != ffi::DataType::F32 || lse->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("pk_jax attention accumulate: acc and lse must be float32");
  if (da.size() != 4 || da[0] != dq[0] || da[2] != dq[2] || da[3] != dq[3] || dl.size() != 3 || dl[0] != dq[0] ||
      dl[1] != dq[2] || dl[2] != da[1])
    return ffi::Error::InvalidArgument("pk_jax attention accumulate: acc " + dims_str(da) + " must be (B, S, N, D) and lse " +
                                       dims_str(dl) + " (B, N, S) for q " + dims_str(dq));
  if (row_start < 0 || row_start + dq[1] > da[1])
    return ffi::Error::InvalidArgument("pk_jax attention accumulate: rows [" + std::to_string(row_start) + ", " +
                                       std::to_string(row_start + dq[1]) + ") outside the state's " + std::to_string(da[1]));
  if (acc->untyped_data() != acc_in.untyped_data() || lse->untyped_data() != lse_in.untyped_data())
    return ffi::Error::Internal("pk_jax attention accumulate: acc and lse must alias their operands");
  p.acc = static_cast<float*>(acc->untyped_data()) + size_t(row_start) * size_t(dq[2]) * size_t(dq[3]);
  p.lse = static_cast<float*>(lse->untyped_data()) + row_start;
  p.lse_seq = int(da[1]);
  p.acc_mode = mode;
  p.o = nullptr;
  return run(p, stream, ordinal, reserve_sms);
}

// The operands both entry points start with: stream, device, q, k, v, offsets.
auto attention_operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAttention, attention,
                              attention_operands()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("with_lse")
                                  .Attr<int32_t>("pipelined")
                                  .Attr<int32_t>("variant")
                                  .Attr<int32_t>("reserve_sms"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAttentionAccumulate, accumulate,
                              attention_operands()
                                  .Arg<ffi::AnyBuffer>()  // acc
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("mode")
                                  .Attr<int64_t>("row_start")
                                  .Attr<int32_t>("variant")
                                  .Attr<int32_t>("reserve_sms"),
                              {ffi::Traits::kCmdBufferCompatible});
