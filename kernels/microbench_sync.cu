// Synchronization microbenchmarks (paper 3.1.3): an mbarrier handoff inside one SM, a flag through
// HBM between two SMs, a signal/wait round trip between two GPUs, and a full group barrier.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "microbench.cuh"
#include "pk/sync.cuh"
#include "pk/tma.cuh"

namespace pk::microbench {
namespace {

// Warps 0 and 1 pass a token back and forth through two mbarriers.
__global__ void mbarrier_pingpong_kernel(int iters) {
  __shared__ uint64_t bar[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    tma::mbar_init(&bar[0], 1);
    tma::mbar_init(&bar[1], 1);
    tma::fence_barrier_init();
  }
  __syncthreads();
  if (lane != 0) return;
  for (int i = 0; i < iters; ++i) {
    const uint32_t phase = i & 1;
    if (warp == 0) {
      tma::mbar_arrive(&bar[0]);
      tma::mbar_wait(&bar[1], phase);
    } else {
      tma::mbar_wait(&bar[0], phase);
      tma::mbar_arrive(&bar[1]);
    }
  }
}

__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// CTA 0 and CTA 1 (on different SMs) ping-pong a counter through global memory.
__global__ void hbm_flag_pingpong_kernel(uint32_t* flag, int iters) {
  if (threadIdx.x != 0) return;
  const uint32_t me = blockIdx.x;
  for (int i = 0; i < iters; ++i) {
    const uint32_t want = 2 * i + me;  // CTA 0 moves on even values, CTA 1 on odd ones
    while (ld_acquire_gpu(flag) != want) {
    }
    st_release_gpu(flag, want + 1);
  }
}

// Spins until *flag >= v; false once `deadline` (globaltimer ns) has passed (checked every 1024 spins).
__device__ __forceinline__ bool wait_at_least(const uint64_t* flag, uint64_t v, uint64_t deadline) {
  for (uint32_t s = 1;; ++s) {
    if (ld_acquire_sys(flag) >= v) return true;
    if ((s & 1023u) == 0 && global_timer_ns() > deadline) return false;
  }
}

// GPU `me` (0 or 1) and its peer ping-pong through counters in each other's memory. Gives up after
// `timeout_ns` (the host then finds the counters short of `iters` and reports it) instead of hanging.
__global__ void peer_pingpong_kernel(uint64_t* my_flag, uint64_t* peer_flag, int me, int iters, uint64_t timeout_ns) {
  if (threadIdx.x != 0) return;
  const uint64_t deadline = global_timer_ns() + timeout_ns;
  for (int i = 0; i < iters; ++i) {
    if (me == 0) {
      signal(peer_flag);
      if (!wait_at_least(my_flag, uint64_t(i + 1), deadline)) return;
    } else {
      if (!wait_at_least(my_flag, uint64_t(i + 1), deadline)) return;
      signal(peer_flag);
    }
  }
}

__global__ void group_barrier_kernel(Group g, int iters) {
  for (int i = 1; i <= iters; ++i)
    if (!barrier(g, uint64_t(i))) return;
}

// Loads the cross-GPU kernels on every device first: a lazy module load while a peer's kernel spins
// can deadlock (the load takes a process-wide lock).
void preload(const std::vector<int>& devices) {
  for (int d : devices) {
    check(cudaSetDevice(d), "cudaSetDevice");
    cudaFuncAttributes attr;
    check(cudaFuncGetAttributes(&attr, peer_pingpong_kernel), "load peer_pingpong_kernel");
    check(cudaFuncGetAttributes(&attr, group_barrier_kernel), "load group_barrier_kernel");
  }
}

template <typename Launch>
double timed_ms(int device, Launch launch) {
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  check(cudaEventRecord(a), "cudaEventRecord");
  launch();
  check(cudaGetLastError(), "launch");
  check(cudaEventRecord(b), "cudaEventRecord");
  check(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

}  // namespace

double mbarrier_handoff_ns(int device, int iters) {
  const double ms = timed_ms(device, [&] { mbarrier_pingpong_kernel<<<1, 64>>>(iters); });
  return ms * 1e6 / (2.0 * iters);
}

double hbm_flag_handoff_ns(int device, int iters) {
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaFuncSetAttribute(hbm_flag_pingpong_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kPinSmem)),
        "smem");
  uint32_t* flag;
  check(cudaMalloc(&flag, sizeof(uint32_t)), "cudaMalloc");
  check(cudaMemset(flag, 0, sizeof(uint32_t)), "cudaMemset");
  const double ms = timed_ms(device, [&] { hbm_flag_pingpong_kernel<<<2, 32, kPinSmem>>>(flag, iters); });
  cudaFree(flag);
  return ms * 1e6 / (2.0 * iters);
}

double peer_signal_round_trip_ns(int a, int b, int iters) {
  if (a == b) throw std::runtime_error("peer round trip needs two different GPUs");
  if (iters < 1) throw std::runtime_error("iters must be >= 1");
  enable_peer_access(a, b);
  preload({a, b});
  const uint64_t timeout_ns = 10'000'000'000ull;  // 10 s; a round trip takes microseconds
  uint64_t *fa, *fb;
  check(cudaSetDevice(a), "cudaSetDevice");
  check(cudaMalloc(&fa, 8), "cudaMalloc");
  check(cudaMemset(fa, 0, 8), "cudaMemset");
  check(cudaDeviceSynchronize(), "sync");
  check(cudaSetDevice(b), "cudaSetDevice");
  check(cudaMalloc(&fb, 8), "cudaMalloc");
  check(cudaMemset(fb, 0, 8), "cudaMemset");
  check(cudaDeviceSynchronize(), "sync");
  // The responder starts first; the initiator's kernel time covers all round trips.
  peer_pingpong_kernel<<<1, 32>>>(fb, fa, 1, iters, timeout_ns);
  check(cudaGetLastError(), "launch");
  const double ms = timed_ms(a, [&] { peer_pingpong_kernel<<<1, 32>>>(fa, fb, 0, iters, timeout_ns); });
  check(cudaSetDevice(b), "cudaSetDevice");
  check(cudaDeviceSynchronize(), "sync");
  uint64_t got_a = 0, got_b = 0;  // each side's counter must have reached iters
  check(cudaMemcpy(&got_b, fb, 8, cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(fb);
  check(cudaSetDevice(a), "cudaSetDevice");
  check(cudaMemcpy(&got_a, fa, 8, cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(fa);
  if (got_a != uint64_t(iters) || got_b != uint64_t(iters))
    throw std::runtime_error("peer round trip timed out: counters " + std::to_string(got_a) + "/" +
                             std::to_string(got_b) + " of " + std::to_string(iters));
  return ms * 1e6 / iters;
}

double group_barrier_ns(const std::vector<Group>& groups, const std::vector<int>& devices, int iters) {
  preload(devices);
  std::vector<cudaEvent_t> start(devices.size()), stop(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    check(cudaSetDevice(devices[i]), "cudaSetDevice");
    check(cudaEventCreate(&start[i]), "cudaEventCreate");
    check(cudaEventCreate(&stop[i]), "cudaEventCreate");
    check(cudaEventRecord(start[i]), "cudaEventRecord");
    group_barrier_kernel<<<1, 32>>>(groups[i], iters);
    check(cudaGetLastError(), "launch");
    check(cudaEventRecord(stop[i]), "cudaEventRecord");
  }
  double worst = 0;
  for (size_t i = 0; i < devices.size(); ++i) {
    check(cudaSetDevice(devices[i]), "cudaSetDevice");
    check(cudaEventSynchronize(stop[i]), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start[i], stop[i]), "cudaEventElapsedTime");
    worst = std::max(worst, double(ms));
    cudaEventDestroy(start[i]);
    cudaEventDestroy(stop[i]);
  }
  return worst * 1e6 / iters;
}

}  // namespace pk::microbench
