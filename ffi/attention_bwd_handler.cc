// XLA FFI handler `pk_attention_bwd`: the attention backward kernel (kernels/attention_bwd.cuh) on one GPU.
// Operands q (B, Tq, N, D), k and v (B, Tk, Nkv, D), dout (B, Tq, N, D), lse2 and delta (B, N, Tq_pad)
// float32 (Tq_pad = Tq rounded up to 64; see attention_bwd.cuh for their contents), offsets int32[2]
// (q_offset, kv_offset); results dq (B, Tq, N, D) in the input dtype or float32, dk and dv (B, Tk, Nkv, D)
// in the input dtype, dq_acc (B, N, Tq_pad, D) float32 (dQ / scale in the kernel's chunk order: the
// kernel's scratch, which a second kernel turns into dq when `convert_dq` is 1; with 0 dq is left unwritten
// and pk_jax/attention.py converts dq_acc with XLA, the A/B baseline), and dkv_acc, float32 (2, B, Tk, Nkv, D)
// scratch for `head_split` > 1 (GQA: each kv head's query heads over head_split tasks, their dK / dV partials
// summed there; (1,) otherwise); `variant` the backward variant
// (0 base, 1 dqfirst, 2 l2order_dqfirst, 3 w3: kernels/attention_bwd_kernel.cuh). Stateless per call (tensor
// maps rebuilt, dq_acc zeroed on the stream each time), so it can be captured into command buffers.
// `pk_attention_bwd_accumulate` (below): the same, with dQ added into ring attention's float32 dQ state in place.
#include <cuda_runtime.h>

#include <string>

#include "../kernels/attention_bwd.cuh"
#include "../kernels/attention_bwd_dq.cuh"
#include "ffi_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + ")";
}

bool same_dims(ffi::Span<const int64_t> a, std::initializer_list<int64_t> b) {
  if (a.size() != b.size()) return false;
  size_t i = 0;
  for (int64_t x : b)
    if (a[i++] != x) return false;
  return true;
}

// Where dQ goes after the kernel: `ptr` (the row of this call's first query) in `type`, rows of `seq` per batch;
// add: float32 only, added to what is there (ring attention's dQ state, in place); convert 0: left unwritten.
struct DqTarget {
  void* ptr;
  pk::ElemType type;
  int64_t seq;
  bool add;
  bool convert;
};

// Ring attention's pair read and written in place (pk_attention_bwd_accumulate): its queries are rows
// [q_row0, q_row0 + tq) of q and dout (tq 0: all of them), and with dq_state set the kernel adds dQ straight
// into rows [dq_row0, dq_row0 + tq) of that float32 (B, state_rows, N, D) array (no dq_acc, no conversion).
struct InPlace {
  int64_t q_row0 = 0, tq = 0;
  float* dq_state = nullptr;
  int64_t state_rows = 0, dq_row0 = 0;
};

// Checks every operand but dq (checked by the entry points) and runs the kernel, then the dQ conversion into
// `dq_target` (dq_target.seq 0: the query length; none with in_place.dq_state).
ffi::Error backward(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer dout, ffi::AnyBuffer lse2, ffi::AnyBuffer delta, ffi::AnyBuffer offsets,
                    ffi::Result<ffi::AnyBuffer>& dk, ffi::Result<ffi::AnyBuffer>& dv, ffi::Result<ffi::AnyBuffer>& dq_acc,
                    float scale, int32_t causal, int32_t reserve_sms, int32_t variant, DqTarget dq_target,
                    InPlace in_place = {}, int32_t head_split = 1, ffi::AnyBuffer* dkv_acc = nullptr) {
  const auto dq = q.dimensions(), dkk = k.dimensions();
  if (dq.size() != 4 || dkk.size() != 4)
    return ffi::Error::InvalidArgument("pk_jax attention backward: q and k must be 4-D (batch, seq, heads, head_dim)");
  const int64_t b = dq[0], n = dq[2], d = dq[3], tk = dkk[1], nkv = dkk[2];
  const int64_t tq = in_place.tq > 0 ? in_place.tq : dq[1];
  if (in_place.q_row0 < 0 || in_place.q_row0 + tq > dq[1])
    return ffi::Error::InvalidArgument("pk_jax attention backward: query rows [" + std::to_string(in_place.q_row0) +
                                       ", " + std::to_string(in_place.q_row0 + tq) + ") are not within q " +
                                       dims_str(dq));
  const int64_t tq_pad = (tq + 63) / 64 * 64;
  if (dkk[0] != b || dkk[3] != d)
    return ffi::Error::InvalidArgument("pk_jax attention backward: k " + dims_str(dkk) +
                                       " must share batch and head_dim with q " + dims_str(dq));
  if (!same_dims(v.dimensions(), {b, tk, nkv, d}) || !same_dims(dk->dimensions(), {b, tk, nkv, d}) ||
      !same_dims(dv->dimensions(), {b, tk, nkv, d}))
    return ffi::Error::InvalidArgument("pk_jax attention backward: v, dk and dv must match k " + dims_str(dkk));
  if (!same_dims(dout.dimensions(), {b, dq[1], n, d}))
    return ffi::Error::InvalidArgument("pk_jax attention backward: dout " + dims_str(dout.dimensions()) +
                                       " must match q " + dims_str(dq));
  if (!same_dims(lse2.dimensions(), {b, n, tq_pad}) || !same_dims(delta.dimensions(), {b, n, tq_pad}))
    return ffi::Error::InvalidArgument("pk_jax attention backward: lse2 " + dims_str(lse2.dimensions()) +
                                       " and delta " + dims_str(delta.dimensions()) + " must be (batch, heads, " +
                                       std::to_string(tq_pad) + ") (tq rounded up to 64)");
  if (in_place.dq_state == nullptr && !same_dims(dq_acc->dimensions(), {b, n, tq_pad, d}))
    return ffi::Error::InvalidArgument("pk_jax attention backward: dq_acc " + dims_str(dq_acc->dimensions()) +
                                       " must be (batch, heads, tq rounded up to 64, head_dim)");
  if (lse2.element_type() != ffi::DataType::F32 || delta.element_type() != ffi::DataType::F32 ||
      dq_acc->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("pk_jax attention backward: lse2, delta and dq_acc must be float32");
  if (offsets.element_type() != ffi::DataType::S32 || offsets.element_count() != 2)
    return ffi::Error::InvalidArgument("pk_jax attention backward: offsets must be int32[2] (q_offset, kv_offset)");
  if (causal != 0 && causal != 1) return ffi::Error::InvalidArgument("pk_jax attention backward: causal must be 0 or 1");
  if (variant < 0 || variant > 3)
    return ffi::Error::InvalidArgument(
        "pk_jax attention backward: variant must be 0..3 (base, dqfirst, l2order_dqfirst, w3)");
  if (head_split < 1 || (n % nkv == 0 && (n / nkv) % head_split != 0))
    return ffi::Error::InvalidArgument("pk_jax attention backward: head_split " + std::to_string(head_split) +
                                       " must divide heads / kv_heads");
  if (head_split > 1 && (dkv_acc == nullptr || !same_dims(dkv_acc->dimensions(), {2, b, tk, nkv, d}) ||
                         dkv_acc->element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("pk_jax attention backward: with head_split " + std::to_string(head_split) +
                                       " dkv_acc must be float32 (2, batch, tk, kv_heads, head_dim)");
  pk::attention_bwd::Problem p{};
  p.head_split = head_split;
  if (head_split > 1) p.dkv_acc = static_cast<float*>(dkv_acc->untyped_data());
  const auto t = q.element_type();
  if (!pk::to_elem_type(t, p.type) || p.type == pk::ElemType::kF32 || k.element_type() != t ||
      v.element_type() != t || dout.element_type() != t || dk->element_type() != t || dv->element_type() != t)
    return ffi::Error::InvalidArgument(
        "pk_jax attention backward: q, k, v, dout, dk and dv must all be bfloat16 or all float16");
  p.q = q.untyped_data(), p.k = k.untyped_data(), p.v = v.untyped_data(), p.dout = dout.untyped_data();
  p.lse2 = static_cast<const float*>(lse2.untyped_data());
  p.delta = static_cast<const float*>(delta.untyped_data());
  p.dq_acc = static_cast<float*>(dq_acc->untyped_data());
  p.dk = dk->untyped_data(), p.dv = dv->untyped_data();
  p.offsets = static_cast<const int*>(offsets.untyped_data());
  p.batch = int(b), p.tq = int(tq), p.heads = int(n), p.head_dim = int(d), p.tk = int(tk), p.kv_heads = int(nkv);
  p.tq_pad = int(tq_pad);
  p.q_rows = int(dq[1]), p.q_row0 = int(in_place.q_row0);
  p.dq_state = in_place.dq_state, p.dq_state_rows = int(in_place.state_rows), p.dq_row0 = int(in_place.dq_row0);
  p.scale = scale;
  p.causal = causal == 1;
  p.variant = variant;
  if (cudaError_t e = pk::attention_bwd::configure_once(ordinal); e != cudaSuccess)
    return ffi::Error::Internal(std::string("pk_jax attention backward: configuring kernels: ") +
                                cudaGetErrorString(e));
  const int sms = pk::sms_after_reserve(pk::attention_bwd::num_sms(ordinal), reserve_sms);
  if (ffi::Error err = pk::launch_as_ffi_error([&] { pk::attention_bwd::launch(p, sms, stream); }); err.failure())
    return err;
  if (!dq_target.convert || in_place.dq_state != nullptr) return ffi::Error::Success();
  pk::attention_bwd::DqConvert c{};
  c.acc = p.dq_acc, c.dq = dq_target.ptr;
  c.batch = p.batch, c.heads = p.heads, c.tq = p.tq, c.tq_pad = p.tq_pad, c.head_dim = p.head_dim;
  c.scale = scale;
  c.out_type = dq_target.type;
  c.dq_seq = int(dq_target.seq);
  c.add = dq_target.add;
  if (cudaError_t e = pk::attention_bwd::launch_dq_convert(c, stream); e != cudaSuccess)
    return ffi::Error::Internal(std::string("pk_jax attention backward: dQ conversion: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error attention_bwd(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::AnyBuffer dout, ffi::AnyBuffer lse2, ffi::AnyBuffer delta, ffi::AnyBuffer offsets,
                         ffi::Result<ffi::AnyBuffer> dq_out, ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dq_acc,
                         ffi::Result<ffi::AnyBuffer> dkv_acc, float scale, int32_t causal, int32_t reserve_sms,
                         int32_t variant, int32_t convert_dq, int32_t head_split) {
  const auto dq = q.dimensions();
  if (dq.size() != 4 || !same_dims(dq_out->dimensions(), {dq[0], dq[1], dq[2], dq[3]}) ||
      (dq_out->element_type() != q.element_type() && dq_out->element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("pk_jax attention backward: dq " + dims_str(dq_out->dimensions()) +
                                       " must match q " + dims_str(dq) + " in q's dtype or float32");
  if (convert_dq != 0 && convert_dq != 1)
    return ffi::Error::InvalidArgument("pk_jax attention backward: convert_dq must be 0 or 1");
  pk::ElemType type;
  if (!pk::to_elem_type(dq_out->element_type(), type))
    return ffi::Error::InvalidArgument("pk_jax attention backward: dq must be bfloat16, float16 or float32");
  return backward(stream, ordinal, q, k, v, dout, lse2, delta, offsets, dk, dv, dq_acc, scale, causal, reserve_sms,
                  variant, DqTarget{dq_out->untyped_data(), type, 0, false, convert_dq == 1}, InPlace{}, head_split,
                  &*dkv_acc);
}

// pk_attention_bwd_accumulate: the same kernels, with dQ added into ring attention's float32 dQ state in place:
// operands as pk_attention_bwd's plus dq_state (B, S, N, D) float32 (the pair's queries are its rows [row_start,
// row_start + tq)); results dq_state (aliased to that operand), dk, dv, dq_acc. Attributes: tq, the pair's query
// count (0: all of q's rows); q_row0, the row of q and dout holding its first query (q and dout may be the
// member's whole arrays, read in place); direct 1: the kernel adds dQ into the state itself (dq_acc, any shape,
// is not used), 0: into dq_acc, then the conversion kernel adds it.
ffi::Error attention_bwd_accumulate(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::AnyBuffer dout, ffi::AnyBuffer lse2, ffi::AnyBuffer delta,
                                    ffi::AnyBuffer offsets, ffi::AnyBuffer dq_state_in,
                                    ffi::Result<ffi::AnyBuffer> dq_state, ffi::Result<ffi::AnyBuffer> dk,
                                    ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dq_acc, float scale,
                                    int32_t causal, int32_t reserve_sms, int32_t variant, int64_t row_start,
                                    int64_t tq, int64_t q_row0, int32_t direct) {
  const auto dq = q.dimensions(), ds = dq_state->dimensions();
  if (dq.size() != 4 || ds.size() != 4 || ds[0] != dq[0] || ds[2] != dq[2] || ds[3] != dq[3] ||
      dq_state->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("pk_jax attention backward accumulate: dq_state " + dims_str(ds) +
                                       " must be float32 (B, S, N, D) for q " + dims_str(dq));
  if (tq < 0 || tq > dq[1] || (direct != 0 && direct != 1))
    return ffi::Error::InvalidArgument("pk_jax attention backward accumulate: tq must be 0..q's rows, direct 0 or 1");
  const int64_t rows = tq > 0 ? tq : dq[1];
  if (row_start < 0 || row_start + rows > ds[1])
    return ffi::Error::InvalidArgument("pk_jax attention backward accumulate: rows [" + std::to_string(row_start) +
                                       ", " + std::to_string(row_start + rows) + ") outside the state's " +
                                       std::to_string(ds[1]));
  if (dq_state->untyped_data() != dq_state_in.untyped_data())
    return ffi::Error::Internal("pk_jax attention backward accumulate: dq_state must alias its operand");
  float* state = static_cast<float*>(dq_state->untyped_data());
  float* at = state + size_t(row_start) * size_t(dq[2]) * size_t(dq[3]);
  InPlace in_place{q_row0, rows, direct ? state : nullptr, ds[1], row_start};
  return backward(stream, ordinal, q, k, v, dout, lse2, delta, offsets, dk, dv, dq_acc, scale, causal, reserve_sms,
                  variant, DqTarget{at, pk::ElemType::kF32, ds[1], true, true}, in_place);
}

// The operands both entry points start with: stream, device, q, k, v, dout, lse2, delta, offsets.
auto backward_operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()   // q
      .Arg<ffi::AnyBuffer>()   // k
      .Arg<ffi::AnyBuffer>()   // v
      .Arg<ffi::AnyBuffer>()   // dout
      .Arg<ffi::AnyBuffer>()   // lse2
      .Arg<ffi::AnyBuffer>()   // delta
      .Arg<ffi::AnyBuffer>();  // offsets
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAttentionBwd, attention_bwd,
                              backward_operands()
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Ret<ffi::AnyBuffer>()  // dq_acc (scratch)
                                  .Ret<ffi::AnyBuffer>()  // dkv_acc (scratch; (1,) without a head split)
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("reserve_sms")
                                  .Attr<int32_t>("variant")
                                  .Attr<int32_t>("convert_dq")
                                  .Attr<int32_t>("head_split"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAttentionBwdAccumulate, attention_bwd_accumulate,
                              backward_operands()
                                  .Arg<ffi::AnyBuffer>()  // dq_state
                                  .Ret<ffi::AnyBuffer>()  // dq_state (aliased)
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Ret<ffi::AnyBuffer>()  // dq_acc (scratch)
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("causal")
                                  .Attr<int32_t>("reserve_sms")
                                  .Attr<int32_t>("variant")
                                  .Attr<int64_t>("row_start")
                                  .Attr<int64_t>("tq")
                                  .Attr<int64_t>("q_row0")
                                  .Attr<int32_t>("direct"),
                              {ffi::Traits::kCmdBufferCompatible});
