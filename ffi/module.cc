// The Python extension: FFI handler capsules and the runtime controls.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime.h>

#include "../kernels/collectives.cuh"
#include "../kernels/tma_selftest.cuh"
#include "group_resolver.h"
#include "cuda_check.h"
#include "multicast_policy.h"
#include "runtime.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* PkCollective(XLA_FFI_CallFrame*);

namespace {

nb::capsule handler_capsule(void* fn) { return nb::capsule(fn); }

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
  int prev = 0;
  PK_CUDA(cudaGetDevice(&prev));
  PK_CUDA(cudaSetDevice(ordinal));
  PK_CUDA(pk::launch_wait_for_peer(g, 1, nullptr));
  PK_CUDA(cudaDeviceSynchronize());
  PK_CUDA(cudaSetDevice(prev));
  return rt.first_error();
}

}  // namespace

NB_MODULE(_pk_jax_ext, m) {
  m.def("registrations", [] {
    nb::dict d;
    d["pk_collective"] = handler_capsule(reinterpret_cast<void*>(&PkCollective));
    return d;
  });
  m.def("initialize", [](const std::vector<int>& ordinals, const std::vector<int64_t>& ids) {
    pk::Runtime::get().initialize(ordinals, ids);
  });
  m.def("is_initialized", [] { return pk::Runtime::get().initialized(); });
  m.def("first_error", [] { return pk::Runtime::get().first_error(); });
  m.def("reset", [] { pk::Runtime::get().reset(); });
  m.def("set_timeout_ms", [](uint64_t ms) { pk::Runtime::get().set_timeout_ms(ms); });
  m.def("timeout_ms", [] { return pk::Runtime::get().timeout_ns() / 1000000ull; });
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
    int prev = 0;
    PK_CUDA(cudaGetDevice(&prev));
    std::string err = pk::tma_peer_selftest(me, peer, chunks);
    cudaSetDevice(prev);
    return err;
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
}
