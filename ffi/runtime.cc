#include "runtime.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include <unistd.h>

#include "../kernels/attention.cuh"
#include "../kernels/attention_bwd.cuh"
#include "../kernels/gemm.cuh"
#include "../kernels/grouped_gemm.cuh"
#include "../kernels/swiglu_rows.cuh"
#include "../kernels/multimem_collectives.cuh"
#include "../kernels/tp_gemm.cuh"
#include "../kernels/moe_gemm.cuh"
#include "copy_shift.h"
#include "cuda_check.h"
#include "peer_memory.h"

namespace pk {
namespace {

std::mutex init_mutex;

// Restores the calling thread's current device (XLA threads rely on their own).
struct DeviceGuard {
  int prev = 0;
  DeviceGuard() { cudaGetDevice(&prev); }
  ~DeviceGuard() { cudaSetDevice(prev); }
};

}  // namespace

const char* op_name(int32_t op) {
  switch (op) {
    case kOpAllGather: return "all_gather";
    case kOpReduceScatter: return "reduce_scatter";
    case kOpAllReduce: return "all_reduce";
    case kOpAllToAll: return "all_to_all";
    case kOpSelfTest: return "self-test wait";
    case kOpAllGatherMatmul: return "all_gather_matmul";
    case kOpMatmulReduceScatter: return "matmul_reduce_scatter";
    case kOpMatmulAllReduce: return "matmul_all_reduce";
    case kOpMoeDispatch: return "moe dispatch";
    case kOpMoeCombine: return "moe combine";
    case kOpMoeSend: return "moe send";
    case kOpRingShift: return "ring shift";
    case kOpAllReducePipelined: return "all_reduce (small_pipelined)";
    case kOpMoeDispatchMatmul: return "moe dispatch + grouped GEMM";
    case kOpAllReduceLL128: return "all_reduce (small_ll128)";
    case kOpAllReduceLL128OneShot: return "all_reduce (small_ll128, one-shot)";
    case kOpAllReduceLL128TwoShot: return "all_reduce (small_ll128, two-shot)";
  }
  return "unknown op";
}

Runtime& Runtime::get() {
  static Runtime* r = new Runtime();  // never destroyed: handlers may run during interpreter exit
  return *r;
}

void Runtime::initialize(const std::vector<int>& ordinals, const std::vector<int64_t>& global_ids) {
  std::lock_guard<std::mutex> lock(init_mutex);
  if (initialized()) {
    bool same = ordinals.size() == devices_.size();
    for (size_t i = 0; same && i < ordinals.size(); ++i)
      same = devices_[i].ordinal == ordinals[i] && devices_[i].global_id == global_ids[i];
    if (!same) throw std::runtime_error("pk_jax: runtime already initialized with other devices");
    return;
  }
  if (ordinals.empty() || ordinals.size() != global_ids.size())
    throw std::runtime_error("pk_jax: initialize needs one global id per device ordinal");
  if (ordinals.size() > size_t(kMaxSlots))
    throw std::runtime_error("pk_jax: at most " + std::to_string(kMaxSlots) + " local GPUs are supported");
  if (const char* t = std::getenv("PK_JAX_TIMEOUT_MS")) set_timeout_ms(std::strtoull(t, nullptr, 10));

  DeviceGuard guard;
  // Peer access makes XLA's own buffers (cuMemAlloc) reachable from every device; XLA usually
  // enabled it already.
  for (int a : ordinals) {
    PK_CUDA(cudaSetDevice(a));
    for (int b : ordinals) {
      if (a == b) continue;
      int can = 0;
      PK_CUDA(cudaDeviceCanAccessPeer(&can, a, b));
      if (!can)
        throw std::runtime_error("pk_jax: GPU " + std::to_string(a) + " cannot access GPU " + std::to_string(b) +
                                 " directly (no NVLink/P2P path)");
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) PK_CUDA(e);
      cudaGetLastError();  // clear the sticky "already enabled"
    }
  }

  control_ = std::make_unique<SymmetricRegion>(ordinals, sizeof(ControlBlock));
  devices_.reserve(ordinals.size());
  for (size_t i = 0; i < ordinals.size(); ++i) {
    devices_.push_back(LocalDevice{ordinals[i], global_ids[i], int(i), static_cast<ControlBlock*>(control_->at(i)),
                                   nullptr, 0});
    members_.push_back(Member{global_ids[i], int(i), 0, devices_.back().ctrl});
    load_kernels_and_errors(i, ordinals[i]);
  }
  watchdog_ = std::thread([this] { watch_errors(); });
  watchdog_.detach();
  initialized_.store(true, std::memory_order_release);
}

// Clears the control block, loads every kernel on the device (a lazy load during a later launch
// takes a process-wide lock and can deadlock against one of our kernels spinning on another GPU),
// and points the device at its host-mapped error record.
void Runtime::load_kernels_and_errors(size_t i, int ordinal) {
  if (!errors_) {
    PK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&errors_), sizeof(ErrorRecord) * kMaxSlots,
                          cudaHostAllocMapped | cudaHostAllocPortable));
    std::fill(errors_, errors_ + kMaxSlots, ErrorRecord{});
  }
  LocalDevice& d = devices_[i];
  PK_CUDA(cudaSetDevice(ordinal));
  PK_CUDA(cudaMemset(d.ctrl, 0, sizeof(ControlBlock)));
  PK_CUDA(configure_kernels());
  PK_CUDA(gemm::configure_once(ordinal));
  PK_CUDA(attention::configure_once(ordinal));
  PK_CUDA(attention_bwd::configure_once(ordinal));
  PK_CUDA(tp::configure());
  PK_CUDA(moe::configure());  // DispatchMatmul spins on peers: loaded up front like the others
  PK_CUDA(grouped::configure_once(ordinal));  // moe_mlp runs them between its dispatch and combine
  PK_CUDA(swiglu::configure());
  PK_CUDA(multimem::configure());  // loads the multimem kernels only where the multicast policy allows it
  cudaDeviceProp prop;
  PK_CUDA(cudaGetDeviceProperties(&prop, ordinal));
  d.num_sms = prop.multiProcessorCount;  // under MPS: the SMs this process was given
  PK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d.err), errors_ + i, 0));
  PK_CUDA(cudaDeviceSynchronize());
}

LocalExport Runtime::add_local_device(int ordinal, int64_t global_id, int slot, int process, const void* probe,
                                      size_t staging_bytes, uint64_t region_limit, bool share_by_fd) {
  std::lock_guard<std::mutex> lock(init_mutex);
  if (initialized()) throw std::runtime_error("pk_jax: the runtime is already initialized");
  if (devices_.size() >= size_t(kMaxSlots) || slot < 0 || slot >= kMaxSlots)
    throw std::runtime_error("pk_jax: at most " + std::to_string(kMaxSlots) + " GPUs (ranks) per host are supported");
  if (const char* t = std::getenv("PK_JAX_TIMEOUT_MS")) set_timeout_ms(std::strtoull(t, nullptr, 10));
  multiprocess_ = true;
  DeviceGuard guard;
  PK_CUDA(cudaSetDevice(ordinal));
  // cudaMalloc'd memory exports as a legacy IPC handle (64 bytes) that peers on the same GPU (MPS)
  // or another GPU of the host map with cudaIpcOpenMemHandle.
  void* ctrl = nullptr;
  PK_CUDA(cudaMalloc(&ctrl, sizeof(ControlBlock)));
  if (devices_.capacity() < size_t(kMaxSlots)) devices_.reserve(kMaxSlots);  // pointers into it stay valid
  devices_.push_back(LocalDevice{ordinal, global_id, slot, static_cast<ControlBlock*>(ctrl), nullptr, 0});
  members_.push_back(Member{global_id, slot, process, static_cast<ControlBlock*>(ctrl)});
  LocalDevice& d = devices_.back();
  load_kernels_and_errors(devices_.size() - 1, ordinal);
  for (const auto& other : devices_) {  // several GPUs in this process: their blocks reach each other
    if (other.ordinal == ordinal) continue;
    for (auto [a, b] : {std::pair{ordinal, other.ordinal}, std::pair{other.ordinal, ordinal}}) {
      PK_CUDA(cudaSetDevice(a));
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) PK_CUDA(e);
      cudaGetLastError();
    }
  }

  LocalExport out;
  const ExportedRegion c = export_region(ctrl);
  if (c.handle.empty()) throw std::runtime_error("pk_jax: cannot export the control block: " + c.why_not);
  out.ctrl_handle = c.handle;
  auto add_region = [&](const ExportedRegion& r) {
    SharedRegion s;
    s.begin = r.begin;
    s.end = r.begin + r.size;
    d.regions.push_back(s);
    out.region_begin.push_back(r.begin);
    out.region_size.push_back(r.size);
    out.region_handle.push_back(r.handle);
    out.region_fds.push_back(r.fds);
  };
  const ExportedRegion xla = export_xla_region(probe, region_limit, share_by_fd);
  if (xla.handle.empty()) {
    out.why_not_shared = xla.why_not;
  } else {
    add_region(xla);
    out.xla_sharing = xla.sharing;
  }
  if (staging_bytes > 0) {
    try {
      PK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d.staging), staging_bytes));
      d.staging_bytes = staging_bytes;
      const ExportedRegion st = export_region(d.staging);
      if (st.handle.empty()) throw std::runtime_error("pk_jax: cannot export the staging heap: " + st.why_not);
      add_region(st);
    } catch (...) {
      for (const auto& fds : out.region_fds)  // nobody will send or close XLA's region's fds
        for (int fd : fds) ::close(fd);
      throw;
    }
  }
  return out;
}

std::vector<uint64_t> Runtime::attach_member(int64_t global_id, int slot, int process, const std::string& ctrl_handle,
                                             const std::vector<std::string>& region_handles,
                                             const std::vector<std::vector<int>>& region_fds) {
  std::lock_guard<std::mutex> lock(init_mutex);
  struct CloseFds {  // every fd passed in is ours to close, whatever happens
    const std::vector<std::vector<int>>& fds;
    ~CloseFds() {
      for (const auto& region : fds)
        for (int fd : region)
          if (fd >= 0) ::close(fd);
    }
  } close_fds{region_fds};
  if (devices_.empty()) throw std::runtime_error("pk_jax: add the local devices before attaching peers");
  if (slot < 0 || slot >= kMaxSlots) throw std::runtime_error("pk_jax: member slot out of range");
  DeviceGuard guard;
  PK_CUDA(cudaSetDevice(devices_.front().ordinal));
  if (region_fds.size() > region_handles.size())
    throw std::runtime_error("pk_jax: attach_member: fds for more regions than handles");
  auto* ctrl = static_cast<ControlBlock*>(open_region(ctrl_handle));
  members_.push_back(Member{global_id, slot, process, ctrl});
  std::vector<int> ordinals;  // every GPU of this process reaches the peer's memory
  for (const auto& d : devices_) ordinals.push_back(d.ordinal);
  std::vector<uint64_t> mapped;
  for (size_t i = 0; i < region_handles.size(); ++i) {
    const std::string& h = region_handles[i];
    const bool by_fd = i < region_fds.size() && !region_fds[i].empty();
    if (!by_fd) {
      if (vmm::is_descriptor(h))
        throw std::runtime_error("pk_jax: region " + std::to_string(i) + " of rank " + std::to_string(process) +
                                 " is shared by POSIX fd, but no fds arrived for it");
      mapped.push_back(reinterpret_cast<uint64_t>(open_region(h)));
      continue;
    }
    try {
      auto imported = std::make_unique<vmm::ImportedRegion>(h, region_fds[i], ordinals);
      mapped.push_back(imported->address());
      imports_.push_back(std::move(imported));
    } catch (const std::exception& e) {
      throw std::runtime_error("pk_jax: mapping rank " + std::to_string(process) +
                               "'s XLA memory (shared by POSIX fd) failed: " + e.what() +
                               ". The processes' GPUs need a peer-to-peer path (NVLink or PCIe P2P), or the ranks "
                               "must share one GPU under MPS.");
    }
  }
  return mapped;
}

void Runtime::set_region_delta(int64_t local_global_id, size_t region, int member_slot, uint64_t member_address) {
  for (auto& d : devices_) {
    if (d.global_id != local_global_id) continue;
    if (region >= d.regions.size() || member_slot < 0 || member_slot >= kMaxSlots)
      throw std::runtime_error("pk_jax: set_region_delta: region or slot out of range");
    d.regions[region].delta[member_slot] = int64_t(member_address - d.regions[region].begin);
    return;
  }
  throw std::runtime_error("pk_jax: set_region_delta: device is not local");
}

void Runtime::finish_multiprocess() {
  std::lock_guard<std::mutex> lock(init_mutex);
  if (initialized()) return;
  watchdog_ = std::thread([this] { watch_errors(); });
  watchdog_.detach();
  initialized_.store(true, std::memory_order_release);
}

const LocalDevice* Runtime::by_ordinal(int ordinal) const {
  for (const auto& d : devices_)
    if (d.ordinal == ordinal) return &d;
  return nullptr;
}

const Member* Runtime::member(int64_t global_id) const {
  for (const auto& m : members_)
    if (m.global_id == global_id) return &m;
  return nullptr;
}

std::string Runtime::describe(const ErrorRecord& e) const {
  // One process: GPUs by CUDA ordinal. Several: ranks by jax process index (and device id).
  auto name = [this](int slot) {
    if (multiprocess_) {
      for (const auto& m : members_)
        if (m.slot == slot)
          return "rank " + std::to_string(m.process) + " (device id " + std::to_string(m.global_id) + ")";
      return std::string("an unknown rank");
    }
    return "GPU " + std::to_string(slot >= 0 && size_t(slot) < devices_.size() ? devices_[slot].ordinal : -1);
  };
  if (e.code == kOpMismatch)
    return std::string("pk_jax ") + op_name(e.op) + ": " + name(e.device_slot) + " ran " + op_name(e.op) + " while " +
           name(e.peer_slot) + " ran " + op_name(e.peer_op) +
           " at the same point: every member of the group must run the same pk_jax ops in the same order" +
           (e.peer_op == kOpAllReduceLL128OneShot || e.peer_op == kOpAllReduceLL128TwoShot
                ? " and pick the same LL128 kernel (set PK_JAX_AR_LL128_SHOTS and PK_JAX_AR_LL128_TWO_SHOT_MIN_BYTES "
                  "alike in every process)"
                : "") +
           ". The runtime is stopped; call pk_jax.runtime.reset() once all GPUs are idle.";
  std::string what = e.code == kTimeoutReady  ? "never started the op (its buffers were never published)"
                     : e.code == kTimeoutDone ? "never finished the op"
                     : e.code == kTimeoutItem ? "never delivered a tile or row chunk of the op"
                     : e.code == kTimeoutSmall ? "never delivered its data of the small-message op"
                                              : "never sent the expected signal";
  return std::string("pk_jax ") + op_name(e.op) + ": " + name(e.device_slot) + " waited more than " +
         std::to_string(timeout_ns() / 1000000) + " ms for " + name(e.peer_slot) + ", which " + what +
         ". Every member of the group must run the same collectives in the same order. The runtime is "
         "stopped; call pk_jax.runtime.reset() once all GPUs are idle (timeout: PK_JAX_TIMEOUT_MS).";
}

std::string Runtime::first_error() const {
  if (!errors_) return "";
  for (size_t i = 0; i < devices_.size(); ++i) {
    const volatile ErrorRecord* e = errors_ + i;
    if (e->code != kOk) {
      ErrorRecord copy{e->code, e->op, e->device_slot, e->peer_slot, e->peer_op};
      return describe(copy);
    }
  }
  return "";
}

void Runtime::watch_errors() {
  std::string reported;
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const std::string e = first_error();
    if (!e.empty() && e != reported) std::fprintf(stderr, "%s\n", e.c_str());
    reported = e;
  }
}

void Runtime::reset() {
  if (!initialized()) return;
  DeviceGuard guard;
  for (const auto& d : devices_) {
    PK_CUDA(cudaSetDevice(d.ordinal));
    PK_CUDA(cudaDeviceSynchronize());
  }
  for (const auto& d : devices_) {
    PK_CUDA(cudaSetDevice(d.ordinal));
    PK_CUDA(cudaMemset(d.ctrl, 0, sizeof(ControlBlock)));
    PK_CUDA(cudaDeviceSynchronize());
  }
  std::fill(errors_, errors_ + kMaxSlots, ErrorRecord{});
  reset_copy_shift_boards();
}

}  // namespace pk
