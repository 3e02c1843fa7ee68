#include "multicast_group.h"

#include <unistd.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <stdexcept>

#include "../kernels/pk/control_block.h"
#include "multicast_policy.h"

namespace pk {
namespace {

// A failure in this process, or a peer process's, at one phase of the set-up.
struct SetUpFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs this process's part of a phase, then agrees with the other processes: every process learns
// that some process failed, so none waits for a step a failed peer will never take.
void phase(MulticastTransport& t, const char* name, const std::function<void()>& work) {
  std::string error;
  try {
    work();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const bool everyone_ok = t.all_agree(error.empty());
  if (!error.empty()) throw SetUpFailed(std::string("multicast set-up failed at ") + name + ": " + error);
  if (!everyone_ok) throw SetUpFailed(std::string("multicast set-up failed at ") + name + " in another process");
}

// Why the request cannot describe a group ("" when it can).
std::string malformed(const MulticastRequest& r) {
  if (r.group_size < 2 || r.group_size > kMaxGroup)
    return "group_size must be 2.." + std::to_string(kMaxGroup) + ", got " + std::to_string(r.group_size);
  if (r.local_devices.empty() || int(r.local_devices.size()) > r.group_size)
    return "local_devices must hold 1..group_size devices, got " + std::to_string(r.local_devices.size());
  std::vector<int> sorted = r.local_devices;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) return "local_devices lists a device twice";
  if (r.single_process && (int(r.local_devices.size()) != r.group_size || !r.is_root))
    return "a single-process group must list all group_size devices and be the root";
  if (r.bytes == 0) return "bytes must be positive";
  return "";
}

}  // namespace

std::unique_ptr<MulticastGroup> MulticastGroup::create(const MulticastRequest& req, const MulticastPolicy& policy,
                                                       MulticastDriver& driver, MulticastTransport& transport,
                                                       std::string& why_not) {
  // The policy comes first and alone decides a refusal: no driver call (not even the support query)
  // happens unless multicast was requested and the machine does not forbid it.
  std::string mine;
  if (!policy.allowed) mine = "multicast refused: " + policy.reason;
  if (mine.empty()) {
    const std::string bad = malformed(req);
    if (!bad.empty()) mine = "multicast request malformed: " + bad;
  }
  if (mine.empty()) {
    for (int dev : req.local_devices) {
      try {
        if (!driver.multicast_supported(dev)) {
          mine = "GPU " + std::to_string(dev) +
                 " reports no multicast support (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)";
          break;
        }
      } catch (const std::exception& e) {
        mine = std::string("multicast support query failed: ") + e.what();
        break;
      }
    }
  }
  // Collective: a process that refuses must not leave the others waiting in the set-up.
  const bool everyone = transport.all_agree(mine.empty());
  if (!mine.empty()) {
    why_not = mine;
    return nullptr;
  }
  if (!everyone) {
    why_not = "multicast refused by another process of the group";
    return nullptr;
  }
  std::unique_ptr<MulticastGroup> g(new MulticastGroup(driver));
  try {
    g->set_up(req, transport);
  } catch (const SetUpFailed& e) {
    why_not = e.what();
    return nullptr;  // the destructor undoes the steps taken
  }
  return g;
}

void MulticastGroup::set_up(const MulticastRequest& req, MulticastTransport& t) {
  // Sizes: the same inputs in every process, so the same result without an exchange.
  phase(t, "granularity", [&] {
    const size_t mc = driver_.multicast_granularity(req.group_size, req.bytes);
    size_t alloc = 1;
    for (int dev : req.local_devices) alloc = std::lcm(alloc, driver_.allocation_granularity(dev));
    if (mc == 0 || alloc == 0) throw std::runtime_error("the driver reported a zero granularity");
    alignment_ = std::lcm(mc, alloc);
    bytes_ = (req.bytes + alignment_ - 1) / alignment_ * alignment_;
  });
  int fd = -1;
  phase(t, "create", [&] {
    if (!req.is_root) return;
    multicast_ = driver_.create_multicast(req.group_size, bytes_);
    have_multicast_ = true;
    if (!req.single_process) fd = driver_.export_fd(multicast_);
  });
  if (!req.single_process) {
    struct Closer {
      int fd;
      ~Closer() {
        if (fd >= 0) ::close(fd);
      }
    } exported{fd};  // the root's copy; the driver keeps the object
    const int received = t.share_fd(req.is_root ? fd : -1);
    phase(t, "import", [&] {
      if (req.is_root) return;
      if (received < 0) throw std::runtime_error("no multicast handle arrived from the root process");
      Closer closer{received};
      multicast_ = driver_.import_fd(received);
      have_multicast_ = true;
    });
  }
  // Every member joins the team before any binds (a bind would otherwise block in the driver).
  phase(t, "add_device", [&] {
    for (int dev : req.local_devices) {
      driver_.add_device(multicast_, dev);
      added_.push_back(dev);
    }
  });
  phase(t, "bind_and_map", [&] {
    for (int dev : req.local_devices) {
      members_.push_back({dev, 0, 0, 0});
      bound_.push_back(false);
      MulticastMember& m = members_.back();
      m.physical = driver_.create_physical(dev, bytes_);
      driver_.bind(multicast_, dev, m.physical, bytes_);
      bound_.back() = true;
      m.unicast = driver_.map(m.physical, dev, bytes_, alignment_);
      m.multicast = driver_.map(multicast_, dev, bytes_, alignment_);
    }
  });
}

void MulticastGroup::tear_down() noexcept {
  for (size_t i = members_.size(); i-- > 0;) {
    MulticastMember& m = members_[i];
    try {
      if (m.multicast) driver_.unmap(m.multicast, bytes_);
      if (m.unicast) driver_.unmap(m.unicast, bytes_);
      if (bound_[i]) driver_.unbind(multicast_, m.device, bytes_);
      if (m.physical) driver_.release(m.physical);
    } catch (const std::exception&) {
      // Best effort: a destructor cannot report, and the process keeps running.
    }
  }
  members_.clear();
  bound_.clear();
  if (have_multicast_) {
    try {
      driver_.release(multicast_);
    } catch (const std::exception&) {
    }
    have_multicast_ = false;
  }
}

MulticastGroup::~MulticastGroup() { tear_down(); }

std::unique_ptr<MulticastGroup> create_local_multicast_group(const std::vector<int>& ordinals, size_t bytes,
                                                             std::string& why_not) {
  MulticastRequest req;
  req.group_size = int(ordinals.size());
  req.local_devices = ordinals;
  req.is_root = true;
  req.single_process = true;
  req.bytes = bytes;
  SingleProcessTransport transport;
  return MulticastGroup::create(req, multicast_policy(), cuda_multicast_driver(), transport, why_not);
}

}  // namespace pk
