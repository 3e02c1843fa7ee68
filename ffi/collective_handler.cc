// XLA FFI handler for the four collectives. One target, `pk_collective`; the `op` attribute picks
// the kernel. Host work per call is a few table lookups; all cross-device state lives on the GPU,
// so the handler is safe to capture in a CUDA graph (command buffer).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../kernels/collectives.cuh"
#include "../kernels/small_collectives.cuh"
#include "group_builder.h"
#include "runtime.h"
#include "staging.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pk {
namespace {

constexpr size_t kBoxFields = 15;
// `variant` values of the small-message path (pk_jax/_primitive.py VARIANT_SMALL*): all_gather and
// reduce_scatter take kVariantSmall, all_reduce kVariantSmall (one-shot), kVariantSmallTwoShot,
// kVariantSmallChunked (plain stores + chunk flags), kVariantSmallPipelined (the same, pipelined) or
// kVariantSmallLL128 (128-byte LL lines).
constexpr int32_t kVariantSmall = 2;
constexpr int32_t kVariantSmallTwoShot = 3;
constexpr int32_t kVariantSmallChunked = 4;
constexpr int32_t kVariantSmallPipelined = 5;  // all_reduce, pushes and sums pipelined (small_pipelined.cu)
constexpr int32_t kVariantSmallLL128 = 6;      // all_reduce, one-shot with 128-byte LL lines (small_ll128.cu)

// The small path's op for (op, variant); false when the pair names none.
bool small_op_for(int32_t op, int32_t variant, SmallOp& out) {
  if (variant == kVariantSmallTwoShot && op == kOpAllReduce) return out = SmallOp::kAllReduceTwoShot, true;
  if (variant == kVariantSmallChunked && op == kOpAllReduce) return out = SmallOp::kAllReduceChunked, true;
  if (variant == kVariantSmallPipelined && op == kOpAllReduce) return out = SmallOp::kAllReducePipelined, true;
  if (variant == kVariantSmallLL128 && op == kOpAllReduce) return out = SmallOp::kAllReduceLL128, true;
  if (variant != kVariantSmall) return false;
  switch (op) {
    case kOpAllReduce: out = SmallOp::kAllReduceOneShot; return true;
    case kOpAllGather: out = SmallOp::kAllGather; return true;
    case kOpReduceScatter: out = SmallOp::kReduceScatter; return true;
    default: return false;
  }
}

Box decode_box(ffi::Span<const int64_t> v) {
  Box b;
  b.rows = v[0];
  b.inner = v[1];
  for (int d = 0; d < kMaxOuterDims; ++d) {
    b.extent[d] = v[2 + d];
    b.src_stride[d] = v[5 + d];
    b.dst_stride[d] = v[8 + d];
  }
  b.src_rank_offset = v[11];
  b.src_peer_offset = v[12];
  b.dst_rank_offset = v[13];
  b.dst_peer_offset = v[14];
  return b;
}

bool to_dtype(ffi::DataType t, DType& out) {
  switch (t) {
    case ffi::DataType::F32: out = DType::kF32; return true;
    case ffi::DataType::BF16: out = DType::kBF16; return true;
    case ffi::DataType::F16: out = DType::kF16; return true;
    default: return false;
  }
}

ffi::Error collective(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                      int32_t op, int32_t variant, int32_t vec_bytes, ffi::Span<const int64_t> mesh_ids,
                      ffi::Span<const int64_t> mesh_shape, ffi::Span<const int64_t> group_axes,
                      ffi::Span<const int64_t> box_fields) {
  Group g;
  const LocalDevice* me = nullptr;
  bool invalid = false;
  const std::string error = build_group(ordinal, op, mesh_ids.begin(), mesh_ids.size(), mesh_shape.begin(),
                                        mesh_shape.size(), group_axes.begin(), group_axes.size(), g, me, invalid);
  if (!error.empty()) return invalid ? ffi::Error::InvalidArgument(error) : ffi::Error::Internal(error);
  if (box_fields.size() != kBoxFields) return ffi::Error::InvalidArgument("pk_jax: malformed box attribute");
  Runtime& rt = Runtime::get();
  // Box units are vec_bytes-wide vectors; XLA aligns buffers far beyond 16 bytes, but say so if not.
  const auto misaligned = [&](const void* p) { return reinterpret_cast<uintptr_t>(p) % uintptr_t(vec_bytes) != 0; };
  if (vec_bytes <= 0 || misaligned(x.untyped_data()) || misaligned(y->untyped_data()))
    return ffi::Error::Internal("pk_jax: buffer not aligned to the " + std::to_string(vec_bytes) + "-byte vectors");
  const Box box = decode_box(box_fields);
  const LaunchLimits lim = rt.limits(*me);
  DType dt{};
  const bool reduces = op == kOpReduceScatter || op == kOpAllReduce;
  if (!reduces && op != kOpAllGather && op != kOpAllToAll)
    return ffi::Error::InvalidArgument("pk_jax: unknown op code " + std::to_string(op));
  if (reduces && !to_dtype(x.element_type(), dt))
    return ffi::Error::InvalidArgument("pk_jax: reductions support float32, bfloat16 and float16");
  if (variant >= kVariantSmall) {
    // Small path: peers write only into this device's control block (mapped everywhere, in every
    // process), never into x or y, so no staging and no address publication.
    SmallOp sop{};
    if (!small_op_for(op, variant, sop))
      return ffi::Error::InvalidArgument("pk_jax: no small-message path for " + std::string(op_name(op)) +
                                         " variant " + std::to_string(variant));
    if (op == kOpAllGather) dt = DType::kF32;  // copies bits; the kernel does not depend on the type
    const int64_t bytes = op == kOpReduceScatter ? int64_t(y->size_bytes()) : int64_t(x.size_bytes());
    const cudaError_t e = launch_small(g, sop, dt, x.untyped_data(), y->untyped_data(), bytes, lim, stream);
    if (e != cudaSuccess)
      return ffi::Error::Internal(std::string("pk_jax ") + op_name(op) + " (small-message path, " +
                                  std::to_string(bytes) + " bytes) launch failed: " + cudaGetErrorString(e));
    return ffi::Error::Success();
  }
  BufferStaging staging(*me, stream);  // multi-process: buffers the peers cannot reach (rare)
  void *src = nullptr, *dst = nullptr;
  try {
    src = staging.reachable(x.untyped_data(), x.size_bytes(), /*copy_in=*/true, /*copy_out=*/false);
    dst = staging.reachable(y->untyped_data(), y->size_bytes(), /*copy_in=*/false, /*copy_out=*/true);
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(ex.what());
  }
  cudaError_t e = reduces ? launch_pull_reduce(g, box, vec_bytes, dt, variant == 1, src, dst, lim, stream)
                          : launch_copy(g, box, vec_bytes, variant == 1, src, dst, lim, stream);
  if (e == cudaSuccess) e = staging.copy_back();
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("pk_jax ") + op_name(op) + " launch failed: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pk

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkCollective, pk::collective,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("op")
                                  .Attr<int32_t>("variant")
                                  .Attr<int32_t>("vec_bytes")
                                  .Attr<ffi::Span<const int64_t>>("mesh_ids")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<ffi::Span<const int64_t>>("group_axes")
                                  .Attr<ffi::Span<const int64_t>>("box"),
                              {ffi::Traits::kCmdBufferCompatible});
