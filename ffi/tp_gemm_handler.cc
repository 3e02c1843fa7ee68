// XLA FFI handler `pk_tp_gemm`: the fused tensor-parallel GEMMs (kernels/tp_gemm.cuh). Operands x, w;
// results out and aux (AG: the gathered x; RS/AR: the partial product, scratch). Like the
// collectives, all cross-device state is on the GPUs, so the handler is command-buffer safe.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "../kernels/collectives.cuh"
#include "../kernels/tp_gemm.cuh"
#include "ffi_types.h"
#include "group_builder.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pk {
namespace {

constexpr int32_t kOpOfKind[6] = {kOpAllGatherMatmul,     kOpMatmulReduceScatter, kOpMatmulAllReduce,
                                  kOpMatmulReduceScatter, kOpMatmulAllReduce,     kOpAllGatherMatmul};

ffi::Error tp_gemm(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> aux, int32_t kind, int32_t tile,
                   int32_t num_comm_sms, ffi::Span<const int64_t> mesh_ids, ffi::Span<const int64_t> mesh_shape,
                   ffi::Span<const int64_t> group_axes, int32_t transpose_w) {
  if (kind < 0 || kind > 5) return ffi::Error::InvalidArgument("pk_jax fused GEMM: unknown kind");
  if (transpose_w != 0 && transpose_w != 1)
    return ffi::Error::InvalidArgument("pk_jax fused GEMM: transpose_w must be 0 or 1");
  tp::Problem p{};
  p.kind = tp::Kind(kind);
  const LocalDevice* me = nullptr;
  bool invalid = false;
  const std::string error = build_group(ordinal, kOpOfKind[kind], mesh_ids.begin(), mesh_ids.size(),
                                        mesh_shape.begin(), mesh_shape.size(), group_axes.begin(),
                                        group_axes.size(), p.group, me, invalid);
  if (!error.empty()) return invalid ? ffi::Error::InvalidArgument(error) : ffi::Error::Internal(error);
  const auto dx = x.dimensions(), dw = w.dimensions();
  if (dx.size() != 2 || dw.size() != 2 || dx[1] != dw[transpose_w])
    return ffi::Error::InvalidArgument(transpose_w ? "pk_jax fused GEMM: expected x (m, k) and w (n, k) (transpose_w=1)"
                                                   : "pk_jax fused GEMM: expected x (m, k) and w (k, n) (transpose_w=0)");
  if (!to_elem_type(x.element_type(), p.type) || p.type == ElemType::kF32 || w.element_type() != x.element_type() ||
      out->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("pk_jax fused GEMM: x, w and the output must share a bf16/f16 dtype");
  p.x = x.untyped_data();
  p.w = w.untyped_data();
  p.out = out->untyped_data();
  p.aux = aux->untyped_data();
  p.m = int(dx[0]), p.k = int(dx[1]), p.n = int(dw[1 - transpose_w]);
  p.transpose_w = transpose_w == 1;
  // out: AG (G m, n), RS (m / G, n), AR (m, n). aux: AG gathered x (G m, k); RS/AR the partial product
  // (m, n), which store-add kernels leave untouched (then (0, n) where store-add was fixed at trace time).
  const int64_t g = p.group.size, op = kOpOfKind[kind];
  const int64_t out_rows = op == kOpAllGatherMatmul ? g * p.m : op == kOpMatmulReduceScatter ? p.m / g : p.m;
  const int64_t aux_rows = op == kOpAllGatherMatmul ? g * p.m : p.m;
  const auto d_out = out->dimensions(), d_aux = aux->dimensions();
  const bool aux_ok = d_aux.size() == 2 && d_aux[1] == (op == kOpAllGatherMatmul ? p.k : p.n) &&
                      (d_aux[0] == aux_rows || (tp::is_store_add(p.kind) && d_aux[0] == 0));
  if (d_out.size() != 2 || d_out[0] != out_rows || d_out[1] != p.n || !aux_ok)
    return ffi::Error::InvalidArgument("pk_jax fused GEMM: output shapes do not match the op");
  p.tile = tile;
  p.num_comm_sms = num_comm_sms;
  p.num_sms = me->num_sms;
  return launch_as_ffi_error([&] { tp::launch(p, stream); });
}

}  // namespace
}  // namespace pk

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkTpGemm, pk::tp_gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("num_comm_sms")
                                  .Attr<ffi::Span<const int64_t>>("mesh_ids")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<ffi::Span<const int64_t>>("group_axes")
                                  .Attr<int32_t>("transpose_w"),
                              {ffi::Traits::kCmdBufferCompatible});
