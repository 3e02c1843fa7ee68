// XLA FFI handler of DispatchMatmul (kernels/moe_gemm.cuh): the MoE dispatch and the first grouped GEMM in one
// kernel.
//   pk_moe_dispatch_matmul: x (T, H), key / pos / order (T*K,) s32, w_gate / w_up (L, H, F)
//                           -> recv (R, H), recv_counts (G, L) s32, send_row (T*K,) s32, gate (R, F), up (R, F),
//                              totals (L,) s32 scratch  [attrs num_experts, num_comm_sms, mesh attrs]
// Like pk_moe_dispatch: ranks from the device ordinal at run time, table lookups only on the host, so the
// handler is command-buffer compatible.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../kernels/moe_gemm.cuh"
#include "ffi_types.h"
#include "group_builder.h"
#include "runtime.h"
#include "staging.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pk {
namespace {

using Ids = ffi::Span<const int64_t>;

ffi::Error dispatch_matmul(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> key,
                           ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> order, ffi::AnyBuffer w_gate,
                           ffi::AnyBuffer w_up, ffi::Result<ffi::AnyBuffer> recv,
                           ffi::Result<ffi::Buffer<ffi::S32>> recv_counts, ffi::Result<ffi::Buffer<ffi::S32>> send_row,
                           ffi::Result<ffi::AnyBuffer> gate, ffi::Result<ffi::AnyBuffer> up,
                           ffi::Result<ffi::Buffer<ffi::S32>> totals, int32_t num_experts, int32_t num_comm_sms,
                           Ids mesh_ids, Ids mesh_shape, Ids group_axes) {
  Group g;
  const LocalDevice* me = nullptr;
  bool invalid = false;
  const std::string error = build_group(ordinal, kOpMoeDispatchMatmul, mesh_ids.begin(), mesh_ids.size(),
                                        mesh_shape.begin(), mesh_shape.size(), group_axes.begin(), group_axes.size(),
                                        g, me, invalid);
  if (!error.empty()) return invalid ? ffi::Error::InvalidArgument(error) : ffi::Error::Internal(error);
  const auto dx = x.dimensions(), dr = recv->dimensions(), dw = w_gate.dimensions(), dg = gate->dimensions();
  const int64_t n = key.element_count();
  if (dx.size() != 2 || dx[0] <= 0 || n % dx[0] != 0 || pos.element_count() != n || order.element_count() != n ||
      send_row->element_count() != n || dr.size() != 2 || dr[1] != dx[1])
    return ffi::Error::InvalidArgument(
        "pk_jax moe dispatch_matmul: x (T, H), key/pos/order/send_row (T*K,), recv (R, H)");
  if (num_experts < g.size || num_experts % g.size != 0 || recv_counts->element_count() != int64_t(num_experts))
    return ffi::Error::InvalidArgument(
        "pk_jax moe dispatch_matmul: num_experts must be a multiple of the group size, with recv_counts (G, E / G)");
  const int64_t L = num_experts / g.size;
  if (dw.size() != 3 || dw[0] != L || dw[1] != dx[1] || !(w_up.dimensions() == dw) || dg.size() != 2 ||
      dg[0] != dr[0] || dg[1] != dw[2] || !(up->dimensions() == dg) || totals->element_count() != L)
    return ffi::Error::InvalidArgument(
        "pk_jax moe dispatch_matmul: w_gate / w_up (L, H, F) with L = num_experts / G, gate / up (R, F), totals (L,)");
  moe::Problem p{};
  if (!to_elem_type(x.element_type(), p.type) || w_gate.element_type() != x.element_type() ||
      w_up.element_type() != x.element_type() || recv->element_type() != x.element_type() ||
      gate->element_type() != x.element_type() || up->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("pk_jax moe dispatch_matmul: x, the weights and the outputs share one dtype");
  BufferStaging staging(*me, stream);  // multi-process: a receive buffer the peers cannot reach (rare)
  void* out = nullptr;
  try {
    out = staging.reachable(recv->untyped_data(), recv->size_bytes(), /*copy_in=*/false, /*copy_out=*/true);
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(ex.what());
  }
  p.group = g;
  p.hidden = int(dx[1]);
  p.ffn = int(dw[2]);
  p.dims = MoeDims{dx[0], int32_t(n / dx[0]), num_experts, dr[0], int64_t(dx[1]) * elem_bytes(p.type) / 16};
  p.x = x.untyped_data();
  p.key = key.typed_data(), p.pos = pos.typed_data(), p.order = order.typed_data();
  p.w_gate = w_gate.untyped_data(), p.w_up = w_up.untyped_data();
  p.recv = out;
  p.recv_counts = recv_counts->typed_data(), p.send_row = send_row->typed_data(), p.totals = totals->typed_data();
  p.gate = gate->untyped_data(), p.up = up->untyped_data();
  p.num_sms = Runtime::get().limits(*me).num_sms;
  p.num_comm_sms = num_comm_sms;
  if (const char* why = moe::unsupported(p); *why)
    return ffi::Error::InvalidArgument(std::string("pk_jax moe dispatch_matmul: ") + why);
  ffi::Error launched = launch_as_ffi_error([&] { moe::launch(p, stream); });
  if (launched.failure()) return launched;
  if (cudaError_t e = staging.copy_back(); e != cudaSuccess)
    return ffi::Error::Internal(std::string("pk_jax moe dispatch_matmul: staging copy-back: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pk

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMoeDispatchMatmul, pk::dispatch_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("num_experts")
                                  .Attr<int32_t>("num_comm_sms")
                                  .Attr<ffi::Span<const int64_t>>("mesh_ids")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<ffi::Span<const int64_t>>("group_axes"),
                              {ffi::Traits::kCmdBufferCompatible});
