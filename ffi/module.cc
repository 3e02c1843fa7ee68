// The Python extension: FFI handler capsules and the runtime controls.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime.h>

#include "../kernels/collectives.cuh"
#include "../kernels/gemm.cuh"
#include "../kernels/tp_gemm.cuh"
#include "../kernels/microbench.cuh"
#include "../kernels/small_pipelined.cuh"
#include "../kernels/tma_selftest.cuh"
#include "group_resolver.h"
#include "cuda_check.h"
#include "multicast_policy.h"
#include "runtime.h"
#include "staging.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

void bind_multicast(nb::module_& m);  // multicast_bindings.cc
void bind_vmm(nb::module_& m);        // vmm_bindings.cc

extern "C" XLA_FFI_Error* PkCollective(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkMatmul(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkGroupedMatmul(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkGroupedMatmulSum(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkSwigluRows(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkSwigluRowsBwd(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkTpGemm(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkAttention(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkAttentionAccumulate(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkAttentionBwd(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkAttentionBwdAccumulate(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkMoeDispatch(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkMoeSend(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkMoeCombine(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkMoeDispatchMatmul(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkRingShiftStart(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkRingShiftDone(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkUninitialized(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PkExchangeStart(XLA_FFI_CallFrame*);

namespace {

nb::capsule handler_capsule(void* fn) { return nb::capsule(fn); }

// Runs `fn` and restores the caller's current device (XLA threads rely on their own).
template <typename F>
auto keep_device(F fn) {
  int prev = 0;
  PK_CUDA(cudaGetDevice(&prev));
  auto out = fn();
  cudaSetDevice(prev);
  return out;
}

// Runs the bounded wait on GPU `ordinal` for a signal from GPU `peer_ordinal` that nobody sends,
// and returns the error the runtime recorded (the self-test of the timeout path).
std::string wait_for_absent_peer(int ordinal, int peer_ordinal, uint64_t timeout_ms) {
  pk::Runtime& rt = pk::Runtime::get();
  const pk::LocalDevice* me = rt.by_ordinal(ordinal);
  const pk::LocalDevice* peer = rt.by_ordinal(peer_ordinal);
  if (!me || !peer || me == peer) throw nb::value_error("wait_for_absent_peer: need two distinct managed GPUs");
  pk::Group g{};
  g.size = 2;
  g.rank = 0;
  g.ctrl[0] = me->ctrl;
  g.ctrl[1] = peer->ctrl;
  g.slot[0] = me->slot;
  g.slot[1] = peer->slot;
  g.op = pk::kOpSelfTest;
  rt.set_timeout_ms(timeout_ms);  // the report names this timeout
  g.timeout_ns = rt.timeout_ns();
  g.err = me->err;
  return keep_device([&] {
    PK_CUDA(cudaSetDevice(ordinal));
    PK_CUDA(pk::launch_wait_for_peer(g, 1, nullptr));
    PK_CUDA(cudaDeviceSynchronize());
    return rt.first_error();
  });
}

}  // namespace

// A group of all local devices (rank = slot) over the runtime's control blocks, one per device.
std::vector<pk::Group> all_device_groups() {
  pk::Runtime& rt = pk::Runtime::get();
  const auto& devs = rt.devices();
  std::vector<pk::Group> groups(devs.size());
  for (size_t i = 0; i < devs.size(); ++i) {
    pk::Group& g = groups[i];
    g.size = int(devs.size());
    g.rank = int(i);
    g.op = pk::kOpSelfTest;
    g.timeout_ns = rt.timeout_ns();
    g.err = devs[i].err;
    for (size_t r = 0; r < devs.size(); ++r) {
      g.ctrl[r] = devs[r].ctrl;
      g.slot[r] = devs[r].slot;
    }
  }
  return groups;
}

NB_MODULE(_pk_jax_ext, m) {
  m.def("registrations", [] {
    nb::dict d;
    d["pk_collective"] = handler_capsule(reinterpret_cast<void*>(&PkCollective));
    d["pk_matmul"] = handler_capsule(reinterpret_cast<void*>(&PkMatmul));
    d["pk_grouped_matmul"] = handler_capsule(reinterpret_cast<void*>(&PkGroupedMatmul));
    d["pk_grouped_matmul_sum"] = handler_capsule(reinterpret_cast<void*>(&PkGroupedMatmulSum));
    d["pk_swiglu_rows"] = handler_capsule(reinterpret_cast<void*>(&PkSwigluRows));
    d["pk_swiglu_rows_bwd"] = handler_capsule(reinterpret_cast<void*>(&PkSwigluRowsBwd));
    d["pk_tp_gemm"] = handler_capsule(reinterpret_cast<void*>(&PkTpGemm));
    d["pk_attention"] = handler_capsule(reinterpret_cast<void*>(&PkAttention));
    d["pk_attention_accumulate"] = handler_capsule(reinterpret_cast<void*>(&PkAttentionAccumulate));
    d["pk_attention_bwd"] = handler_capsule(reinterpret_cast<void*>(&PkAttentionBwd));
    d["pk_attention_bwd_accumulate"] = handler_capsule(reinterpret_cast<void*>(&PkAttentionBwdAccumulate));
    d["pk_moe_dispatch"] = handler_capsule(reinterpret_cast<void*>(&PkMoeDispatch));
    d["pk_moe_send"] = handler_capsule(reinterpret_cast<void*>(&PkMoeSend));
    d["pk_moe_combine"] = handler_capsule(reinterpret_cast<void*>(&PkMoeCombine));
    d["pk_moe_dispatch_matmul"] = handler_capsule(reinterpret_cast<void*>(&PkMoeDispatchMatmul));
    d["pk_ring_shift_start"] = handler_capsule(reinterpret_cast<void*>(&PkRingShiftStart));
    d["pk_ring_shift_done"] = handler_capsule(reinterpret_cast<void*>(&PkRingShiftDone));
    d["pk_exchange_start"] = handler_capsule(reinterpret_cast<void*>(&PkExchangeStart));
    d["pk_uninitialized"] = handler_capsule(reinterpret_cast<void*>(&PkUninitialized));
    return d;
  });
  m.def("initialize", [](const std::vector<int>& ordinals, const std::vector<int64_t>& ids) {
    pk::Runtime::get().initialize(ordinals, ids);
  });
  m.def("is_initialized", [] { return pk::Runtime::get().initialized(); });
  // Multi-process start-up (pk_jax/distributed.py drives it; see Runtime::add_local_device).
  m.def("mp_add_local_device", [](int ordinal, int64_t global_id, int slot, int process, uintptr_t probe,
                                  size_t staging_bytes, uint64_t region_limit, bool share_by_fd) {
    const pk::LocalExport e = pk::Runtime::get().add_local_device(
        ordinal, global_id, slot, process, reinterpret_cast<const void*>(probe), staging_bytes, region_limit,
        share_by_fd);
    std::vector<nb::bytes> handles;
    for (const auto& h : e.region_handle) handles.emplace_back(h.data(), h.size());
    // (ctrl handle, region begins, sizes, handles, fds per region (owned by the caller), why XLA's region
    // is not shared ("" when it is), how it is shared ("cuda_ipc" | "posix_fd" | ""))
    return nb::make_tuple(nb::bytes(e.ctrl_handle.data(), e.ctrl_handle.size()), e.region_begin, e.region_size,
                          handles, e.region_fds, e.why_not_shared, e.xla_sharing);
  }, nb::arg("ordinal"), nb::arg("global_id"), nb::arg("slot"), nb::arg("process"), nb::arg("probe"),
     nb::arg("staging_bytes"), nb::arg("region_limit") = 0, nb::arg("share_by_fd") = true);
  // region_fds[i]: the fds of region i when shared by POSIX fd (closed here, also on failure), else [].
  m.def("mp_attach_member", [](int64_t global_id, int slot, int process, nb::bytes ctrl_handle,
                               const std::vector<nb::bytes>& region_handles,
                               const std::vector<std::vector<int>>& region_fds) {
    std::vector<std::string> regions;
    for (const auto& h : region_handles) regions.emplace_back(h.c_str(), h.size());
    const std::string ctrl(ctrl_handle.c_str(), ctrl_handle.size());
    return pk::Runtime::get().attach_member(global_id, slot, process, ctrl, regions, region_fds);
  }, nb::arg("global_id"), nb::arg("slot"), nb::arg("process"), nb::arg("ctrl_handle"), nb::arg("region_handles"),
     nb::arg("region_fds") = std::vector<std::vector<int>>{});
  m.def("mp_set_region_delta", [](int64_t local_global_id, size_t region, int member_slot, uint64_t address) {
    pk::Runtime::get().set_region_delta(local_global_id, region, member_slot, address);
  });
  m.def("mp_finish", [] { pk::Runtime::get().finish_multiprocess(); });
  // The GPU's PCI bus id: tells ranks that share one GPU (MPS) apart from ranks on different GPUs.
  m.def("pci_bus_id", [](int ordinal) {
    char id[32] = {};
    PK_CUDA(cudaDeviceGetPCIBusId(id, sizeof(id), ordinal));
    return std::string(id);
  });
  m.def("is_multiprocess", [] { return pk::Runtime::get().multiprocess(); });
  m.def("staged_buffers", [] { return pk::staged_buffers(); });
  m.def("first_error", [] { return pk::Runtime::get().first_error(); });
  m.def("reset", [] { pk::Runtime::get().reset(); });
  m.def("set_timeout_ms", [](uint64_t ms) { pk::Runtime::get().set_timeout_ms(ms); });
  m.def("timeout_ms", [] { return pk::Runtime::get().timeout_ns() / 1000000ull; });
  m.def("tp_all_reduce_relays", [](int group_size) { return pk::tp::all_reduce_relays(group_size); });
  // The pipelined all_reduce's schedule as the kernel computes it (pk_jax/_pipelined_schedule.py mirrors
  // it; a CPU test compares the two): (vecs, slice, chunk, ctas, rounds, lag, two_shot).
  m.def("pipelined_geometry", [](int64_t bytes, int group, int num_sms, int rounds, int64_t min_chunk, int max_ctas,
                                 int lag, int shots) {
    const pk::PipelinedKnobs k{rounds, min_chunk, max_ctas, lag, shots};
    const pk::PipelinedGeometry geo = pk::pipelined_geometry(bytes, group, num_sms, k);
    return std::make_tuple(geo.vecs, geo.slice, geo.chunk, geo.ctas, geo.rounds, geo.lag, geo.two_shot);
  });
  // The knobs this process launches with (env PK_JAX_AR_PIPELINED_*): (rounds, min_chunk, max_ctas, lag, shots).
  m.def("pipelined_knobs", [] {
    const pk::PipelinedKnobs& k = pk::pipelined_knobs();
    return std::make_tuple(k.rounds, k.min_chunk, k.max_ctas, k.lag, k.shots);
  });
  m.def("multicast_policy", [] {
    const pk::MulticastPolicy p = pk::multicast_policy();
    return std::make_pair(p.allowed, p.reason);
  });
  m.def("devices", [] {
    std::vector<std::pair<int, int64_t>> out;
    for (const auto& d : pk::Runtime::get().devices()) out.emplace_back(d.ordinal, d.global_id);
    return out;
  });
  m.def("wait_for_absent_peer", &wait_for_absent_peer);
  m.def("tma_peer_selftest", [](int me, int peer, size_t chunks) {
    return keep_device([&] { return pk::tma_peer_selftest(me, peer, chunks); });
  });
  // Microbenchmarks (python -m pk_jax.bench transfer|sync).
  m.def("mb_mechanisms", [] { return pk::microbench::mechanisms(); });
  m.def("mb_transfer", [](const std::string& mech, int src, int dst, size_t total, size_t message, int sms, int reps) {
    return keep_device([&] {
      const auto r = pk::microbench::transfer(mech, src, dst, total, message, sms, reps);
      return std::make_tuple(r.ms, r.gbps, r.total);
    });
  });
  m.def("mb_all_pairs", [](const std::string& mech, const std::vector<int>& devices, size_t total, int sms, int reps) {
    return keep_device([&] { return pk::microbench::all_pairs(mech, devices, total, sms, reps); });
  });
  m.def("mb_a2a_mechanisms", [] { return pk::microbench::a2a_mechanisms(); });
  m.def("mb_missing_peer_access", [](const std::vector<int>& devices) {
    return keep_device([&] { return pk::microbench::missing_peer_access(devices); });
  });
  // (ms, per-GPU ms): see pk::microbench::all_to_all.
  m.def("mb_all_to_all", [](const std::string& mech, const std::vector<int>& devices, size_t bytes_per_peer, int sms,
                            int reps) {
    return keep_device([&] {
      const auto r = pk::microbench::all_to_all(mech, devices, bytes_per_peer, sms, reps);
      return std::make_pair(r.ms, r.gpu_ms);
    });
  });
  m.def("mb_mbarrier_handoff_ns", [](int dev, int iters) {
    return keep_device([&] { return pk::microbench::mbarrier_handoff_ns(dev, iters); });
  });
  m.def("mb_hbm_flag_handoff_ns", [](int dev, int iters) {
    return keep_device([&] { return pk::microbench::hbm_flag_handoff_ns(dev, iters); });
  });
  m.def("mb_peer_round_trip_ns", [](int a, int b, int iters) {
    return keep_device([&] { return pk::microbench::peer_signal_round_trip_ns(a, b, iters); });
  });
  m.def("mb_group_barrier_ns", [](int iters) {
    pk::Runtime& rt = pk::Runtime::get();
    if (!rt.initialized()) throw nb::value_error("mb_group_barrier_ns: runtime not initialized");
    rt.reset();  // barrier epochs start from zero
    std::vector<int> ordinals;
    for (const auto& d : rt.devices()) ordinals.push_back(d.ordinal);
    const double ns = keep_device([&] { return pk::microbench::group_barrier_ns(all_device_groups(), ordinals, iters); });
    const std::string err = rt.first_error();
    if (!err.empty()) throw std::runtime_error(err);
    return ns;
  });
  m.def("gemm_tile_names", [] {
    std::vector<std::string> names;
    for (int t = 0; t < pk::gemm::kNumTiles; ++t) names.push_back(pk::gemm::tile_name(t));
    return names;
  });
  // The tile `pk_jax.matmul` picks for bf16/f16 (m, n, k) on GPU `ordinal` (f32_out: float32 output).
  m.def("gemm_choose_tile", [](int m, int n, int k, bool f32_out, int ordinal) {
    pk::gemm::Problem p{nullptr, nullptr, nullptr, m, n, k, pk::ElemType::kBF16,
                        f32_out ? pk::ElemType::kF32 : pk::ElemType::kBF16};
    return pk::gemm::choose_tile(p, pk::gemm::num_sms(ordinal));
  });
  // Why the fused GEMM kernel cannot run a problem ("" when it can); kind 0 AG, 1 RS, 2 AR.
  m.def("tp_gemm_unsupported", [](int kind, int group, int m, int n, int k, int tile) {
    return std::string(pk::tp::unsupported(pk::tp::Kind(kind), group, m, n, k, tile));
  });
  m.def("num_sms", [](int dev) {
    int n = 0;
    PK_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  });
  // The C++ group resolution, exposed so CPU tests can check it against the Python mirror.
  m.def("resolve_group", [](int64_t my_id, const std::vector<int64_t>& mesh_ids, const std::vector<int64_t>& shape,
                            const std::vector<int64_t>& axes) {
    std::string error;
    pk::GroupMembers g = pk::resolve_group(my_id, mesh_ids.data(), mesh_ids.size(), shape.data(), shape.size(),
                                           axes.data(), axes.size(), error);
    if (!error.empty()) throw nb::value_error(error.c_str());
    return std::make_pair(g.ids, g.rank);
  });
  // Multicast: the transport plan, fd passing, MulticastGroup with injected driver/transport (CPU tests).
  bind_multicast(m);
  bind_vmm(m);
}
