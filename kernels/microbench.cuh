// Host entry points of the transfer and synchronization microbenchmarks (microbench_*.cu): the
// measurements behind the paper's table 1 and figures 2, 3 and 5, on the user's own GPUs.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pk/group.cuh"

namespace pk::microbench {

// Dynamic shared memory that leaves room for only one CTA per SM, so "n CTAs" means "n SMs".
constexpr size_t kPinSmem = 120 * 1024;

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Peer access both ways between `a` and `b` (XLA normally turned it on already; "already enabled"
// is cleared so that it does not surface later through cudaGetLastError). Keeps the current device.
inline void enable_peer_access(int a, int b) {
  int prev = 0;
  check(cudaGetDevice(&prev), "cudaGetDevice");
  const int pairs[2][2] = {{a, b}, {b, a}};
  for (const auto& p : pairs) {
    int can = 0;
    check(cudaDeviceCanAccessPeer(&can, p[0], p[1]), "cudaDeviceCanAccessPeer");
    if (!can)
      throw std::runtime_error("GPU " + std::to_string(p[0]) + " cannot access GPU " + std::to_string(p[1]) +
                               " (no peer-to-peer path)");
    check(cudaSetDevice(p[0]), "cudaSetDevice");
    const cudaError_t e = cudaDeviceEnablePeerAccess(p[1], 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled)
      (void)cudaGetLastError();
    else
      check(e, "cudaDeviceEnablePeerAccess");
  }
  check(cudaSetDevice(prev), "cudaSetDevice");
}

// Mechanisms that move data from GPU `src` to GPU `dst`:
//   copy_engine    cudaMemcpyPeerAsync, one call per message (at most kMaxCopyCalls calls per transfer)
//   tma_store      kernel on src: TMA load (local) -> TMA store to dst
//   tma_load       kernel on dst: TMA load from src -> TMA store (local)
//   tma_store_add  kernel on src: TMA load (local) -> TMA add-store (bf16) into dst
//   reg_store      kernel on src: 16-byte loads (local) -> 16-byte stores to dst
//   reg_load       kernel on dst: 16-byte loads from src -> 16-byte stores (local)
// A kernel's "message" is the contiguous run one CTA moves at a time; messages above 32 KiB (one
// TMA stage; one pass of a register CTA) are moved as 32 KiB pieces spread over the CTAs.
constexpr size_t kMaxCopyCalls = 16384;
const std::vector<std::string>& mechanisms();

struct TransferResult {
  double ms;          // median time of one transfer of `total` bytes
  double gbps;        // total / ms
  size_t total;       // bytes moved per transfer (reduced to kMaxCopyCalls messages for the copy engine)
};

// One mechanism, one pair, `sms` CTAs (one per SM; ignored by the copy engine), median of `reps`.
// The destination is then checked byte for byte against the source (store-add: after one more
// transfer into a zeroed destination). Throws std::runtime_error on CUDA errors, a wrong byte or
// an unknown mechanism.
TransferResult transfer(const std::string& mechanism, int src, int dst, size_t total, size_t message, int sms,
                        int reps);

// Every GPU of `devices` sends `total` bytes to every other one at once, with `sms` CTAs split across
// its peers. Returns the per-GPU send bandwidth (GB/s), median of `reps`; every destination is
// checked byte for byte afterwards.
double all_pairs(const std::string& mechanism, const std::vector<int>& devices, size_t total, int sms, int reps);

// All-to-all over `devices` (2..8 GPUs): GPU s sends its own `bytes_per_peer` message (a pattern of
// (s, d, index)) to every other GPU d, all at once. Mechanisms (a2a_mechanisms): copy_engine (one
// cudaMemcpyPeerAsync per peer, one stream per peer), tma_store and reg_store (one kernel per GPU, its
// `sms` CTAs split round-robin over the G-1 peers, 32 KiB pieces). Every GPU's stream is held by a
// gate kernel until the host has enqueued all of them (not for a copy engine over a pair without peer
// access: host-staged copies may block the host); then start event, transfer, end event. `ms`:
// median over `reps` of the slowest GPU's end - start; `gpu_ms`: each GPU's own median. Every
// received slot is checked against the pattern after the last round (receive buffers are zeroed
// before each round). Kernels need peer access between every pair and throw naming the pair that
// lacks it; the copy engine does not.
struct AllToAllResult {
  double ms;
  std::vector<double> gpu_ms;
};
const std::vector<std::string>& a2a_mechanisms();
// Ordered (a, b) pairs of `devices` where a cannot access b's memory (cudaDeviceCanAccessPeer == 0).
std::vector<std::pair<int, int>> missing_peer_access(const std::vector<int>& devices);
AllToAllResult all_to_all(const std::string& mechanism, const std::vector<int>& devices, size_t bytes_per_peer,
                          int sms, int reps);

// Median latencies in nanoseconds over `iters` round trips:
double mbarrier_handoff_ns(int device, int iters);      // two warps of one SM, through an mbarrier
double hbm_flag_handoff_ns(int device, int iters);      // two SMs, through a flag in global memory
double peer_signal_round_trip_ns(int a, int b, int iters);  // signal/wait between two GPUs, there and back
// Full barrier across `g` (runtime control blocks; the caller resets them first), per barrier.
double group_barrier_ns(const std::vector<Group>& groups, const std::vector<int>& devices, int iters);

}  // namespace pk::microbench
