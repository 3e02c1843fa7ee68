// XLA FFI handlers of the asynchronous ring shift (kernels/ring_shift.cuh, docs/design.md):
//   pk_ring_shift_start: x_0..x_{n-1} -> y_0..y_{n-1}, token [attrs engine, ctas, unroll, dists, mesh_ids, mesh_shape,
//                                                             group_axes]
//       Records an event on XLA's stream, makes the device's side stream wait for it (everything XLA
//       issued before, including the writes of x, is done), and launches the shift kernel on the side
//       stream with `ctas` CTAs (engine 0), or, with engine 1 and every member in this process, enqueues
//       copy-engine copies and cross-device event waits there (ffi/copy_shift.h); returns at once. y_i receives x_i of member rank - dists[i] (the predecessor
//       for distance 1). The token is never
//       written: it only carries the dependency that keeps XLA from moving the step's attention before
//       this call (pk_jax/context/ring_shift.py).
//   pk_ring_shift_done: y_0..y_{n-1}, token, keep-alive and after operands... -> y_0..y_{n-1} (aliased)
//       Makes XLA's stream wait for every side-stream launch issued so far on this device (one event
//       recorded now; right with several shifts in flight too, they run in order on the side stream).
//       The extra operands are not read: they keep x alive (XLA would reuse its memory otherwise while
//       the side kernel still reads it) and place the wait after the step's compute.
//   pk_exchange_start: x [, into] -> y (aliasing into), token [attrs geometry, mesh_ids, mesh_shape, group_axes]
//       The windowed all-to-all by copy engines (ffi/copy_shift.h copy_engine_all_to_all; every member a GPU of
//       this process, else an error): ordered after XLA's stream like start, y's blocks written by every member
//       on the side stream. geometry: width, height, depth, src_pitch, src_slice, dst_pitch, dst_slice (bytes, a
//       Block3D), src_offset, src_stride, dst_offset, dst_stride, own (WindowExchange; own 0: the own block is
//       not copied, its window keeps `into`'s cells). Finished by
//       pk_ring_shift_done like a shift.
// Ranks come from the device ordinal at run time (build_group). The handlers keep host state (the
// side stream and its events), so they are NOT command-buffer compatible.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <mutex>
#include <string>
#include <vector>

#include "../kernels/ring_shift.cuh"
#include "copy_shift.h"
#include "group_builder.h"
#include "runtime.h"
#include "side_stream.h"
#include "staging.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pk {
namespace {

using Ids = ffi::Span<const int64_t>;

ffi::Error cuda_error(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("pk_jax ring shift: ") + what + ": " + cudaGetErrorString(e));
}

// The CUDA ordinals of the group's members by rank when every one is a GPU of this process, else empty.
std::vector<int> local_ordinals(const Group& g) {
  std::vector<int> out;
  const Runtime& rt = Runtime::get();
  if (rt.multiprocess()) return out;
  for (int r = 0; r < g.size; ++r)
    for (const LocalDevice& d : rt.devices())
      if (d.slot == g.slot[r]) out.push_back(d.ordinal);
  if (out.size() != size_t(g.size)) out.clear();
  return out;
}

// The side stream ordered after everything XLA's stream issued so far (x written, this member's y free).
ffi::Error side_after_main(SideStream& side, cudaStream_t stream) {
  if (cudaError_t e = cudaEventRecord(side.main_ready, stream); e != cudaSuccess) return cuda_error("event", e);
  if (cudaError_t e = cudaStreamWaitEvent(side.stream, side.main_ready, 0); e != cudaSuccess)
    return cuda_error("side stream wait", e);
  return ffi::Error::Success();
}

// The result of enqueuing copy-engine copies (`err` empty: done). On an error, copies already queued read x:
// XLA's stream waits for them before x can be reused.
ffi::Error copies_queued(SideStream& side, cudaStream_t stream, const std::string& err) {
  if (err.empty()) return ffi::Error::Success();
  if (cudaEventRecord(side.side_done, side.stream) == cudaSuccess) cudaStreamWaitEvent(stream, side.side_done, 0);
  return ffi::Error::Internal(err);
}

// The call's group (ranks from the device ordinal at run time) and this device.
ffi::Error group_of(int32_t ordinal, Ids mesh_ids, Ids mesh_shape, Ids group_axes, Group& g, const LocalDevice*& me) {
  bool invalid = false;
  const std::string error = build_group(ordinal, kOpRingShift, mesh_ids.begin(), mesh_ids.size(), mesh_shape.begin(),
                                        mesh_shape.size(), group_axes.begin(), group_axes.size(), g, me, invalid);
  if (error.empty()) return ffi::Error::Success();
  return invalid ? ffi::Error::InvalidArgument(error) : ffi::Error::Internal(error);
}

ffi::Error start(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t engine,
                 int32_t ctas, int32_t unroll, Ids dists, Ids mesh_ids, Ids mesh_shape, Ids group_axes) {
  const size_t n = args.size();
  if (n < 1 || n > size_t(kMaxShiftBuffers) || rets.size() != n + 1)
    return ffi::Error::InvalidArgument("pk_jax ring shift: 1.." + std::to_string(kMaxShiftBuffers) +
                                       " buffers in, as many plus a token out");
  if (ctas < 1) return ffi::Error::InvalidArgument("pk_jax ring shift: ctas must be >= 1");
  if (engine != 0 && engine != 1)
    return ffi::Error::InvalidArgument("pk_jax ring shift: engine must be 0 (SM kernel) or 1 (copy engine)");
  if (std::find(std::begin(kShiftUnrolls), std::end(kShiftUnrolls), unroll) == std::end(kShiftUnrolls))
    return ffi::Error::InvalidArgument("pk_jax ring shift: unroll must be 4, 8 or 16, got " + std::to_string(unroll));
  Group g;
  const LocalDevice* me = nullptr;
  if (ffi::Error e = group_of(ordinal, mesh_ids, mesh_shape, group_axes, g, me); e.failure()) return e;
  if (dists.size() != n)
    return ffi::Error::InvalidArgument("pk_jax ring shift: one distance per buffer (" + std::to_string(n) + "), got " +
                                       std::to_string(dists.size()));
  ShiftBuffers b{};
  b.n = int32_t(n);
  for (size_t i = 0; i < n; ++i) {
    if (dists[i] < 1 || dists[i] >= g.size)
      return ffi::Error::InvalidArgument("pk_jax ring shift: distance " + std::to_string(dists[i]) + " outside 1.." +
                                         std::to_string(g.size - 1));
    b.dist[i] = int32_t(dists[i]);
    auto x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (y.has_error()) return y.error();
    if (x->size_bytes() != (*y)->size_bytes())
      return ffi::Error::InvalidArgument("pk_jax ring shift: output " + std::to_string(i) + " differs from its input");
    b.x[i] = static_cast<const char*>(x->untyped_data());
    b.y[i] = static_cast<char*>((*y)->untyped_data());
    b.bytes[i] = int64_t(x->size_bytes());
    if (reinterpret_cast<uintptr_t>(b.x[i]) % 16 || reinterpret_cast<uintptr_t>(b.y[i]) % 16)
      return ffi::Error::Internal("pk_jax ring shift: buffers must be 16-byte aligned");
  }
  try {
    SideStream& side = side_stream(ordinal);
    std::lock_guard<std::mutex> lock(side.mutex);
    if (ffi::Error e = side_after_main(side, stream); e.failure()) return e;
    // Copy engines where every member is a GPU of this process (their buffers are addresses here);
    // multi-process jobs keep the kernel, which learns the peers' addresses from their mailboxes.
    if (engine == 1) {
      if (const std::vector<int> ordinals = local_ordinals(g); !ordinals.empty()) {
        return copies_queued(side, stream, copy_engine_shift(g, ordinals.data(), b, side.stream));
      }
    }
    // Multi-process: an output the predecessor cannot reach goes through the staging heap's side window,
    // copied back on the side stream (so before `done`'s event).
    BufferStaging staging(*me, side.stream, StagingWindow::kSide);
    for (int i = 0; i < b.n; ++i)
      b.y[i] = static_cast<char*>(staging.reachable(b.y[i], size_t(b.bytes[i]), /*copy_in=*/false, /*copy_out=*/true));
    cudaError_t e = launch_ring_shift(g, b, ctas, unroll, side.stream);
    if (e == cudaSuccess) e = staging.copy_back();
    if (e != cudaSuccess) return cuda_error("launch", e);
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(ex.what());
  }
  return ffi::Error::Success();
}

// The last byte (exclusive) a window of `k` at `origin` touches, on the source or destination side.
int64_t window_end(const Block3D& k, int64_t origin, bool src) {
  return origin + (k.depth - 1) * (src ? k.src_slice : k.dst_slice) + (k.height - 1) * (src ? k.src_pitch : k.dst_pitch) +
         k.width;
}

ffi::Error exchange_start(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                          Ids geometry, Ids mesh_ids, Ids mesh_shape, Ids group_axes) {
  if (args.size() < 1 || args.size() > 2 || rets.size() != 2)
    return ffi::Error::InvalidArgument("pk_jax windowed all-to-all: x [, into] in, y and a token out");
  if (geometry.size() != 12)
    return ffi::Error::InvalidArgument("pk_jax windowed all-to-all: geometry has 12 values, got " +
                                       std::to_string(geometry.size()));
  Group g;
  const LocalDevice* me = nullptr;
  if (ffi::Error e = group_of(ordinal, mesh_ids, mesh_shape, group_axes, g, me); e.failure()) return e;
  auto x = args.get<ffi::AnyBuffer>(0);
  auto y = rets.get<ffi::AnyBuffer>(0);
  if (x.has_error()) return x.error();
  if (y.has_error()) return y.error();
  const int64_t* v = geometry.begin();
  WindowExchange w{static_cast<const char*>(x->untyped_data()), static_cast<char*>((*y)->untyped_data()),
                   Block3D{v[0], v[1], v[2], v[3], v[4], v[5], v[6]}, v[7], v[8], v[9], v[10], v[11] != 0};
  // Every window of every member inside its buffer (the copies would write elsewhere otherwise).
  const int64_t last = g.size - 1;
  if (w.src_offset < 0 || w.dst_offset < 0 || w.src_stride < 0 || w.dst_stride < 0 ||
      window_end(w.block, w.src_offset + last * w.src_stride, true) > int64_t(x->size_bytes()) ||
      window_end(w.block, w.dst_offset + last * w.dst_stride, false) > int64_t((*y)->size_bytes()))
    return ffi::Error::InvalidArgument("pk_jax windowed all-to-all: the windows of " + std::to_string(g.size) +
                                       " members do not fit x (" + std::to_string(x->size_bytes()) + " bytes) and y (" +
                                       std::to_string((*y)->size_bytes()) + " bytes)");
  const std::vector<int> ordinals = local_ordinals(g);
  if (ordinals.empty())
    return ffi::Error::InvalidArgument("pk_jax windowed all-to-all: every member must be a GPU of this process "
                                       "(multi-process jobs use the shift kernel's all-to-all)");
  if (args.size() == 2) {  // y aliases `into` (operand_output_aliases); copied, on XLA's stream, only if XLA chose
    auto into = args.get<ffi::AnyBuffer>(1);  // otherwise (there `into` is alive: the side stream never reads it)
    if (into.has_error()) return into.error();
    if (into->size_bytes() != (*y)->size_bytes())
      return ffi::Error::InvalidArgument("pk_jax windowed all-to-all: into and y differ in size");
    if (into->untyped_data() != (*y)->untyped_data())
      if (cudaError_t e = cudaMemcpyAsync((*y)->untyped_data(), into->untyped_data(), into->size_bytes(),
                                          cudaMemcpyDeviceToDevice, stream);
          e != cudaSuccess)
        return cuda_error("copy into y", e);
  }
  try {
    SideStream& side = side_stream(ordinal);
    std::lock_guard<std::mutex> lock(side.mutex);
    if (ffi::Error e = side_after_main(side, stream); e.failure()) return e;
    return copies_queued(side, stream, copy_engine_all_to_all(g, ordinals.data(), w, side.stream));
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(ex.what());
  }
}

ffi::Error done(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const size_t n = rets.size();
  if (n < 1 || args.size() < n + 1)
    return ffi::Error::InvalidArgument("pk_jax ring shift done: the shifted buffers and the token, then any others");
  if (SideStream* side = existing_side_stream(ordinal)) {
    std::lock_guard<std::mutex> lock(side->mutex);
    if (cudaError_t e = cudaEventRecord(side->side_done, side->stream); e != cudaSuccess) return cuda_error("event", e);
    if (cudaError_t e = cudaStreamWaitEvent(stream, side->side_done, 0); e != cudaSuccess)
      return cuda_error("stream wait", e);
  }
  // The outputs alias the inputs (operand_output_aliases); copy only if XLA chose otherwise.
  for (size_t i = 0; i < n; ++i) {
    auto y = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (y.has_error()) return y.error();
    if (out.has_error()) return out.error();
    if ((*out)->untyped_data() == y->untyped_data()) continue;
    if (cudaError_t e = cudaMemcpyAsync((*out)->untyped_data(), y->untyped_data(), y->size_bytes(),
                                        cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess)
      return cuda_error("copy", e);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pk

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkRingShiftStart, pk::start,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("engine")
                                  .Attr<int32_t>("ctas")
                                  .Attr<int32_t>("unroll")
                                  .Attr<ffi::Span<const int64_t>>("dists")
                                  .Attr<ffi::Span<const int64_t>>("mesh_ids")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<ffi::Span<const int64_t>>("group_axes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkExchangeStart, pk::exchange_start,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("geometry")
                                  .Attr<ffi::Span<const int64_t>>("mesh_ids")
                                  .Attr<ffi::Span<const int64_t>>("mesh_shape")
                                  .Attr<ffi::Span<const int64_t>>("group_axes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkRingShiftDone, pk::done,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets());
