// XLA FFI handlers of the fused MoE exchange (kernels/moe_dispatch.cuh, docs/design-moe.md):
//   pk_moe_dispatch: x (T, H), key (T*K,) s32, pos (T*K,) s32 -> recv (R, H), recv_counts (G, L) s32,
//                    send_row (T*K,) s32, src_of (R,) s32 scratch  [attrs num_experts, dedup]
//   pk_moe_send:     x (T, H), send_row (T*K,), scale (T*K,) f32, received () s32 -> recv (R, H)
//                    [attrs top_k, scaled]
//   pk_moe_combine:  y (R, H), send_row (T*K,), weights (T*K,) f32 -> out (T, H) or, gather, (T*K, H),
//                    partial ((G-1)*T*H,) f32 scratch with `partials`, else (1,)  [attrs top_k, gather, partials]
// Ranks come from the device ordinal at run time (build_group); the host work per call is table
// lookups, so the handlers are command-buffer compatible like pk_collective.
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "../kernels/moe_dispatch.cuh"
#include "group_builder.h"
#include "runtime.h"
#include "staging.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pk {
namespace {

using Ids = ffi::Span<const int64_t>;

bool to_dtype(ffi::DataType t, DType& out) {
  switch (t) {
    case ffi::DataType::F32: out = DType::kF32; return true;
    case ffi::DataType::BF16: out = DType::kBF16; return true;
    case ffi::DataType::F16: out = DType::kF16; return true;
    default: return false;
  }
}

int elem_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) == 0; }

// Widest vector that divides the row and every buffer's alignment: 16 bytes, else `fallback` (the
// element size for typed kernels; 4 or 2 for the untyped dispatch). 0 when none fits.
int vector_bytes(int64_t row_bytes, std::initializer_list<const void*> bufs, std::initializer_list<int> widths) {
  for (int v : widths) {
    bool ok = row_bytes % v == 0;
    for (const void* p : bufs) ok = ok && aligned(p, v);
    if (ok) return v;
  }
  return 0;
}

ffi::Error group_for(int32_t ordinal, int32_t op, Ids mesh_ids, Ids mesh_shape, Ids group_axes, Group& g,
                     const LocalDevice*& me) {
  bool invalid = false;
  const std::string error = build_group(ordinal, op, mesh_ids.begin(), mesh_ids.size(), mesh_shape.begin(),
                                        mesh_shape.size(), group_axes.begin(), group_axes.size(), g, me, invalid);
  if (error.empty()) return ffi::Error::Success();
  return invalid ? ffi::Error::InvalidArgument(error) : ffi::Error::Internal(error);
}

ffi::Error launched(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("pk_jax moe ") + what + " launch failed: " + cudaGetErrorString(e));
}

ffi::Error dispatch(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> key,
                    ffi::Buffer<ffi::S32> pos, ffi::Result<ffi::AnyBuffer> recv,
                    ffi::Result<ffi::Buffer<ffi::S32>> recv_counts, ffi::Result<ffi::Buffer<ffi::S32>> send_row,
                    ffi::Result<ffi::Buffer<ffi::S32>> src_of, int32_t num_experts, int32_t dedup, int32_t zero_tail,
                    Ids mesh_ids, Ids mesh_shape, Ids group_axes) {
  Group g;
  const LocalDevice* me = nullptr;
  if (ffi::Error e = group_for(ordinal, kOpMoeDispatch, mesh_ids, mesh_shape, group_axes, g, me); e.failure())
    return e;
  const auto dx = x.dimensions(), dr = recv->dimensions();
  const int64_t n = key.element_count();
  if (dx.size() != 2 || dr.size() != 2 || dr[1] != dx[1] || dx[0] <= 0 || n % dx[0] != 0 ||
      pos.element_count() != n || send_row->element_count() != n || x.element_type() != recv->element_type() ||
      src_of->element_count() != dr[0])
    return ffi::Error::InvalidArgument(
        "pk_jax moe dispatch: x (T, H), key/pos/send_row (T*K,), recv (R, H), src_of (R,)");
  if (num_experts < g.size || num_experts % g.size != 0 || num_experts > kMoeMaxExperts ||
      recv_counts->element_count() != int64_t(num_experts))
    return ffi::Error::InvalidArgument(
        "pk_jax moe dispatch: num_experts must be a multiple of the group size, at most " +
        std::to_string(kMoeMaxExperts) + ", with recv_counts (G, E / G)");
  const int64_t row_bytes = int64_t(x.size_bytes()) / dx[0];
  BufferStaging staging(*me, stream);  // multi-process: a receive buffer the peers cannot reach (rare)
  void* out = nullptr;
  void* scratch = nullptr;  // written by the peers, read by the fill launch: never copied back
  try {
    out = staging.reachable(recv->untyped_data(), recv->size_bytes(), /*copy_in=*/false, /*copy_out=*/true);
    scratch = staging.reachable(src_of->untyped_data(), src_of->size_bytes(), /*copy_in=*/false, /*copy_out=*/false);
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(ex.what());
  }
  const int vec = vector_bytes(row_bytes, {x.untyped_data(), out}, {16, 4, 2});
  if (vec == 0) return ffi::Error::InvalidArgument("pk_jax moe dispatch: rows must be a multiple of 2 bytes");
  const MoeDims d{dx[0], int32_t(n / dx[0]), num_experts, dr[0], row_bytes / vec, zero_tail};
  cudaError_t e = launch_moe_dispatch(g, d, vec, dedup != 0, x.untyped_data(), key.typed_data(), pos.typed_data(),
                                      out, static_cast<int32_t*>(scratch), recv_counts->typed_data(),
                                      send_row->typed_data(), Runtime::get().limits(*me), stream);
  if (e == cudaSuccess) e = staging.copy_back();
  return launched("dispatch", e);
}

ffi::Error send(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> send_row,
                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> received, ffi::Result<ffi::AnyBuffer> recv,
                int32_t top_k, int32_t scaled, int32_t zero_tail, Ids mesh_ids, Ids mesh_shape, Ids group_axes) {
  Group g;
  const LocalDevice* me = nullptr;
  if (ffi::Error e = group_for(ordinal, kOpMoeSend, mesh_ids, mesh_shape, group_axes, g, me); e.failure())
    return e;
  const auto dx = x.dimensions(), dr = recv->dimensions();
  DType dt{};
  if (!to_dtype(x.element_type(), dt) || recv->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("pk_jax moe send: float32, bfloat16 or float16 rows");
  if (dx.size() != 2 || dr.size() != 2 || dr[1] != dx[1] || top_k < 1 ||
      send_row.element_count() != dx[0] * top_k || scale.element_count() != dx[0] * top_k ||
      received.element_count() != 1)
    return ffi::Error::InvalidArgument("pk_jax moe send: x (T, H), send_row/scale (T*K,), received (), recv (R, H)");
  BufferStaging staging(*me, stream);
  void* out = nullptr;
  try {
    out = staging.reachable(recv->untyped_data(), recv->size_bytes(), /*copy_in=*/false, /*copy_out=*/true);
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(ex.what());
  }
  const int64_t row_bytes = dx[1] * elem_bytes(dt);
  const int vec = vector_bytes(row_bytes, {x.untyped_data(), out}, {16, elem_bytes(dt)});
  if (vec == 0) return ffi::Error::Internal("pk_jax moe send: misaligned buffers");
  const MoeDims d{dx[0], top_k, 0, dr[0], row_bytes / vec, zero_tail};
  cudaError_t e = launch_moe_send(g, d, vec, dt, scaled != 0, x.untyped_data(), send_row.typed_data(),
                                  scale.typed_data(), received.typed_data(), out, Runtime::get().limits(*me), stream);
  if (e == cudaSuccess) e = staging.copy_back();
  return launched("send", e);
}

ffi::Error combine(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> send_row,
                   ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> partial,
                   int32_t top_k, int32_t gather, int32_t partials, Ids mesh_ids, Ids mesh_shape, Ids group_axes) {
  Group g;
  const LocalDevice* me = nullptr;
  if (ffi::Error e = group_for(ordinal, kOpMoeCombine, mesh_ids, mesh_shape, group_axes, g, me); e.failure())
    return e;
  const auto dy = y.dimensions(), dout = out->dimensions();
  DType dt{};
  if (!to_dtype(y.element_type(), dt) || out->element_type() != y.element_type())
    return ffi::Error::InvalidArgument("pk_jax moe combine: float32, bfloat16 or float16 rows");
  const int64_t n = send_row.element_count();
  if (dy.size() != 2 || dout.size() != 2 || dout[1] != dy[1] || top_k < 1 || n % top_k != 0 ||
      weights.element_count() != n || dout[0] != (gather ? n : n / top_k))
    return ffi::Error::InvalidArgument("pk_jax moe combine: y (R, H), send_row/weights (T*K,), out (T, H) or (T*K, H)");
  const bool pushed = partials != 0 && gather == 0;
  if (partial->element_count() != (pushed ? (g.size - 1) * (n / top_k) * dy[1] : 1))
    return ffi::Error::InvalidArgument("pk_jax moe combine: the partials scratch holds (G - 1) * T * H floats");
  BufferStaging staging(*me, stream);  // multi-process: what the peers read or write
  void* src = y.untyped_data();
  void* rows = send_row.untyped_data();
  void* ws = weights.untyped_data();
  void* ps = partial->untyped_data();
  try {
    if (pushed) {  // the peers read the handle's rows and weights, and write their partials here
      rows = staging.reachable(rows, send_row.size_bytes(), /*copy_in=*/true, /*copy_out=*/false);
      ws = staging.reachable(ws, weights.size_bytes(), /*copy_in=*/true, /*copy_out=*/false);
      ps = staging.reachable(ps, partial->size_bytes(), /*copy_in=*/false, /*copy_out=*/false);
    } else {  // the peers pull y's rows
      src = staging.reachable(src, y.size_bytes(), /*copy_in=*/true, /*copy_out=*/false);
    }
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(ex.what());
  }
  const int64_t row_bytes = dy[1] * elem_bytes(dt);
  const int vec = vector_bytes(row_bytes, {src, out->untyped_data()}, {16, elem_bytes(dt)});
  if (vec == 0) return ffi::Error::Internal("pk_jax moe combine: misaligned buffers");
  const MoeDims d{n / top_k, top_k, 0, dy[0], row_bytes / vec};
  const LaunchLimits& lim = Runtime::get().limits(*me);
  if (pushed)
    return launched("combine", launch_moe_combine_partials(g, d, vec, dt, src, static_cast<const int32_t*>(rows),
                                                           static_cast<const float*>(ws), static_cast<float*>(ps),
                                                           out->untyped_data(), lim, stream));
  return launched("combine", launch_moe_combine(g, d, vec, dt, gather != 0, src, send_row.typed_data(),
                                                weights.typed_data(), out->untyped_data(), lim, stream));
}

}  // namespace
}  // namespace pk

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMoeDispatch, pk::dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("num_experts")
                                  .Attr<int32_t>("dedup")
                                  .Attr<int32_t>("zero_tail")
                                  .Attr<ffi::Span<const int64_t>>("mesh_ids")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<ffi::Span<const int64_t>>("group_axes"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMoeSend, pk::send,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("top_k")
                                  .Attr<int32_t>("scaled")
                                  .Attr<int32_t>("zero_tail")
                                  .Attr<ffi::Span<const int64_t>>("mesh_ids")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<ffi::Span<const int64_t>>("group_axes"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMoeCombine, pk::combine,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("top_k")
                                  .Attr<int32_t>("gather")
                                  .Attr<int32_t>("partials")
                                  .Attr<ffi::Span<const int64_t>>("mesh_ids")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<ffi::Span<const int64_t>>("group_axes"),
                              {ffi::Traits::kCmdBufferCompatible});
