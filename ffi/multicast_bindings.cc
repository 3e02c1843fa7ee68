// Python bindings of the multicast pieces that CPU tests exercise: the transport plan, the fd exchange
// (job directory, credential check, endpoints, socket transport) and MulticastGroup with a driver and a
// transport implemented in Python (fakes in tests). Nothing here creates a multicast object unless a
// real driver is passed, which the bindings do not offer.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <nanobind/trampoline.h>

#include <cstdint>
#include <limits>
#include <memory>

#include "../kernels/multimem_collectives.cuh"
#include "fd_passing.h"
#include "multicast_group.h"
#include "multicast_plan.h"

namespace nb = nanobind;

namespace {

// "Type: message" of a Python exception, without the traceback (it ends up in a refusal reason).
std::string python_message(const nb::python_error& e) {
  return std::string(nb::type_name(e.type()).c_str()) + ": " + nb::str(e.value()).c_str();
}

}  // namespace

// Calls the Python override, taking the GIL (callers may have released it); a Python exception becomes
// a std::runtime_error carrying its type and message.
#define PK_PY_OVERRIDE(...)                                 \
  nb::gil_scoped_acquire gil;                               \
  try {                                                     \
    NB_OVERRIDE_PURE(__VA_ARGS__);                          \
  } catch (const nb::python_error& e) {                     \
    throw std::runtime_error(python_message(e));            \
  }

namespace {

// Python subclasses implement the driver; calls may come from a thread that released the GIL.
struct PyMulticastDriver : pk::MulticastDriver {
  NB_TRAMPOLINE(pk::MulticastDriver);
  bool multicast_supported(int device) override {
    PK_PY_OVERRIDE(multicast_supported, device);
  }
  size_t multicast_granularity(int num_devices, size_t bytes) override {
    PK_PY_OVERRIDE(multicast_granularity, num_devices, bytes);
  }
  size_t allocation_granularity(int device) override {
    PK_PY_OVERRIDE(allocation_granularity, device);
  }
  uint64_t create_multicast(int num_devices, size_t bytes) override {
    PK_PY_OVERRIDE(create_multicast, num_devices, bytes);
  }
  int export_fd(uint64_t handle) override {
    PK_PY_OVERRIDE(export_fd, handle);
  }
  uint64_t import_fd(int fd) override {
    PK_PY_OVERRIDE(import_fd, fd);
  }
  void add_device(uint64_t multicast, int device) override {
    PK_PY_OVERRIDE(add_device, multicast, device);
  }
  uint64_t create_physical(int device, size_t bytes) override {
    PK_PY_OVERRIDE(create_physical, device, bytes);
  }
  void bind(uint64_t multicast, int device, uint64_t physical, size_t bytes) override {
    PK_PY_OVERRIDE(bind, multicast, device, physical, bytes);
  }
  void unbind(uint64_t multicast, int device, size_t bytes) override {
    PK_PY_OVERRIDE(unbind, multicast, device, bytes);
  }
  uint64_t map(uint64_t handle, int device, size_t bytes, size_t alignment) override {
    PK_PY_OVERRIDE(map, handle, device, bytes, alignment);
  }
  void unmap(uint64_t address, size_t bytes) override {
    PK_PY_OVERRIDE(unmap, address, bytes);
  }
  void release(uint64_t handle) override {
    PK_PY_OVERRIDE(release, handle);
  }
};

struct PyMulticastTransport : pk::MulticastTransport {
  NB_TRAMPOLINE(pk::MulticastTransport);
  bool all_agree(bool mine) override {
    PK_PY_OVERRIDE(all_agree, mine);
  }
  int share_fd(int fd) override {
    PK_PY_OVERRIDE(share_fd, fd);
  }
  void barrier() override {
    PK_PY_OVERRIDE(barrier);
  }
};

// A group made through the bindings, holding its driver alive until the group is torn down.
struct PyGroup {
  nb::object driver;  // declared first: destroyed after `group`
  std::unique_ptr<pk::MulticastGroup> group;
  void close() {
    nb::gil_scoped_release nogil;
    group.reset();
  }
};

}  // namespace

void bind_multicast(nb::module_& m) {
  // The policy of an environment given as a dict (tests: no test sets the opt-in in the real one).
  m.def("multicast_policy_of", [](const std::map<std::string, std::string>& env) {
    const pk::MulticastPolicy p = pk::multicast_policy_of([&](const char* name) -> const char* {
      const auto it = env.find(name);
      return it == env.end() ? nullptr : it->second.c_str();
    });
    return std::make_pair(p.allowed, p.reason);
  });
  // The plan under a policy (allowed, reason): pk_jax.runtime.multicast_plan passes the environment's.
  // region_bytes < 0: not limited by a region.
  m.def("multicast_plan", [](int group_size, size_t nbytes, const std::vector<bool>& supported, int num_hosts,
                             int64_t region_bytes, bool policy_allowed, const std::string& policy_reason) {
    pk::TransportPlanInput in;
    in.policy = {policy_allowed, policy_reason};
    in.group_size = group_size;
    in.supported = supported;
    in.num_hosts = num_hosts;
    in.nbytes = nbytes;
    in.region_bytes = region_bytes < 0 ? std::numeric_limits<size_t>::max() : size_t(region_bytes);
    const pk::TransportPlan p = pk::plan_transport(in);
    return std::make_tuple(std::string(p.name()), p.reason);
  });

  // fd passing.
  m.def("fd_create_job_dir", &pk::fdpass::create_job_dir);
  m.def("fd_check_job_dir", &pk::fdpass::check_job_dir);
  m.def("fd_check_peer", [](int64_t pid, int64_t uid, int64_t my_uid, const std::vector<int64_t>& job_pids) {
    std::vector<pid_t> pids(job_pids.begin(), job_pids.end());
    return pk::fdpass::check_peer({pid_t(pid), uid_t(uid)}, uid_t(my_uid), pids);
  });
  nb::class_<pk::fdpass::Endpoint>(m, "FdEndpoint")
      .def("__init__",
           [](pk::fdpass::Endpoint* self, const std::string& dir, int rank, const std::vector<int64_t>& job_pids) {
             new (self) pk::fdpass::Endpoint(dir, rank, std::vector<pid_t>(job_pids.begin(), job_pids.end()));
           },
           nb::arg("dir"), nb::arg("rank"), nb::arg("job_pids") = std::vector<int64_t>{})
      .def("send",
           [](pk::fdpass::Endpoint& e, int peer, int fd, nb::bytes payload, int timeout_ms) {
             std::string p(payload.c_str(), payload.size());
             nb::gil_scoped_release nogil;
             e.send(peer, fd, p, timeout_ms);
           },
           nb::arg("peer"), nb::arg("fd"), nb::arg("payload"), nb::arg("timeout_ms"))
      .def("receive",
           [](pk::fdpass::Endpoint& e, int timeout_ms) {
             pk::fdpass::Message msg;
             {
               nb::gil_scoped_release nogil;
               msg = e.receive(timeout_ms);
             }
             return std::make_tuple(msg.sender, msg.fd, nb::bytes(msg.payload.data(), msg.payload.size()));
           },
           nb::arg("timeout_ms"))
      .def("set_job_pids",
           [](pk::fdpass::Endpoint& e, const std::vector<int64_t>& pids) {
             e.set_job_pids(std::vector<pid_t>(pids.begin(), pids.end()));
           })
      .def_prop_ro("rejected", &pk::fdpass::Endpoint::rejected)
      .def_prop_ro("path", &pk::fdpass::Endpoint::path);

  // MulticastGroup with injected driver and transport.
  nb::class_<pk::MulticastDriver, PyMulticastDriver>(m, "MulticastDriver").def(nb::init<>());
  nb::class_<pk::MulticastTransport, PyMulticastTransport>(m, "MulticastTransport").def(nb::init<>());
  nb::class_<pk::fdpass::SocketTransport, pk::MulticastTransport>(m, "SocketTransport")
      .def(nb::init<pk::fdpass::Endpoint&, int, int>(), nb::arg("endpoint"), nb::arg("num_ranks"),
           nb::arg("timeout_ms"), nb::keep_alive<1, 2>());
  nb::class_<pk::SingleProcessTransport, pk::MulticastTransport>(m, "SingleProcessTransport").def(nb::init<>());
  nb::class_<PyGroup>(m, "MulticastGroup")
      .def_prop_ro("bytes", [](const PyGroup& g) { return g.group ? g.group->bytes() : size_t(0); })
      .def_prop_ro("members",
                   [](const PyGroup& g) {
                     std::vector<std::tuple<int, uint64_t, uint64_t, uint64_t>> out;
                     if (g.group)
                       for (const auto& mm : g.group->members())
                         out.emplace_back(mm.device, mm.physical, mm.unicast, mm.multicast);
                     return out;
                   })
      .def("close", &PyGroup::close);
  // (group or None, why_not). Runs without the GIL, so ranks in several Python threads proceed together.
  m.def("multicast_group_create",
        [](int group_size, const std::vector<int>& local_devices, bool is_root, bool single_process, size_t bytes,
           std::pair<bool, std::string> policy, nb::object driver, pk::MulticastTransport& transport) {
          pk::MulticastRequest req;
          req.group_size = group_size;
          req.local_devices = local_devices;
          req.is_root = is_root;
          req.single_process = single_process;
          req.bytes = bytes;
          pk::MulticastDriver& d = nb::cast<pk::MulticastDriver&>(driver);
          std::string why_not;
          std::unique_ptr<pk::MulticastGroup> g;
          {
            nb::gil_scoped_release nogil;
            g = pk::MulticastGroup::create(req, {policy.first, policy.second}, d, transport, why_not);
          }
          if (!g) return std::make_tuple(nb::object(nb::none()), why_not);
          auto* holder = new PyGroup{driver, std::move(g)};
          return std::make_tuple(nb::cast(holder, nb::rv_policy::take_ownership), why_not);
        },
        nb::arg("group_size"), nb::arg("local_devices"), nb::arg("is_root"), nb::arg("single_process"),
        nb::arg("bytes"), nb::arg("policy"), nb::arg("driver"), nb::arg("transport"));

  // The real driver and the runtime's set-up function, callable only while the policy refuses: then
  // they must refuse before any CUDA call (the tests check the messages). Return the refusal text.
  m.def("cuda_multicast_refusals", [](const std::vector<int>& ordinals, size_t bytes) {
    if (pk::multicast_policy().allowed)
      throw std::runtime_error("cuda_multicast_refusals: only callable while the multicast policy refuses");
    std::vector<std::string> out;
    for (int step = 0; step < 3; ++step) {
      try {
        pk::MulticastDriver& d = pk::cuda_multicast_driver();
        if (step == 0) d.multicast_supported(ordinals.at(0));
        if (step == 1) d.create_multicast(int(ordinals.size()), bytes);
        if (step == 2) d.create_physical(ordinals.at(0), bytes);
        out.push_back("");
      } catch (const std::exception& e) {
        out.push_back(e.what());
      }
    }
    std::string why_not;
    const auto g = pk::create_local_multicast_group(ordinals, bytes, why_not);
    out.push_back(g ? std::string("") : why_not);
    return out;
  });

  // The multimem kernels refuse to launch unless configure() ran under an allowing policy. Checked with
  // the policy refusing only (so nothing can launch); launches nothing.
  m.def("multimem_launch_refused", [] {
    if (pk::multicast_policy().allowed)
      throw std::runtime_error("multimem_launch_refused: only callable while the multicast policy refuses");
    if (pk::multimem::configure() != cudaSuccess) return false;
    pk::multimem::MulticastPgl p{};
    p.size = 2;
    return pk::multimem::launch_barrier(p, nullptr) == cudaErrorNotPermitted &&
           pk::multimem::launch_all_reduce(p, pk::DType::kBF16, 1024, 1, nullptr) == cudaErrorNotPermitted;
  });
}
