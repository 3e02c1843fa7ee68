// Transfer-mechanism microbenchmarks (paper 3.1.2): copy engine, TMA and register transfers between
// two GPUs, by message size and by SM count.
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "microbench.cuh"
#include "pk/tma.cuh"

namespace pk::microbench {
namespace {

constexpr int kStages = 6;
constexpr uint32_t kStageBytes = 32 * 1024;  // largest single TMA message here (a power of two, so it
                                             // divides every power-of-two total); 6 stages = 192 KiB
constexpr int kRegThreads = 512;
constexpr int kRegUnroll = 4;
constexpr size_t kRegChunk = size_t(kRegThreads) * kRegUnroll * 16;  // one pass of a CTA: 32 KiB

// One thread per CTA streams pieces (min(message, stage) bytes each) through a ring of shared-memory
// stages: loads run kStages-1 pieces ahead of the stores.
template <bool ADD>
__global__ void __launch_bounds__(32, 1) tma_copy_kernel(const char* src, char* dst, size_t total, uint32_t piece) {
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t bar[kStages];
  if (threadIdx.x != 0) return;
  const size_t pieces = total / piece;
  const size_t mine = pieces > blockIdx.x ? (pieces - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto offset = [&](size_t k) { return (blockIdx.x + k * gridDim.x) * size_t(piece); };
  for (int s = 0; s < kStages; ++s) tma::mbar_init(&bar[s], 1);
  tma::fence_barrier_init();
  auto load = [&](size_t k) {
    const int s = int(k % kStages);
    tma::mbar_expect_tx(&bar[s], piece);
    tma::load_async(smem + s * kStageBytes, src + offset(k), piece, &bar[s]);
  };
  for (size_t k = 0; k < mine && k < kStages - 1; ++k) load(k);
  for (size_t k = 0; k < mine; ++k) {
    const int s = int(k % kStages);
    tma::mbar_wait(&bar[s], uint32_t((k / kStages) & 1));
    if constexpr (ADD) {
      tma::store_add_async(reinterpret_cast<__nv_bfloat16*>(dst + offset(k)),
                           reinterpret_cast<const __nv_bfloat16*>(smem + s * kStageBytes), piece);
    } else {
      tma::store_async(dst + offset(k), smem + s * kStageBytes, piece);
    }
    tma::commit_group();
    if (k + kStages - 1 < mine) {
      tma::wait_group_read<1>();  // the stage about to be refilled was read by store k-1
      load(k + kStages - 1);
    }
  }
  tma::wait_group<0>();
}

// Each CTA copies whole messages (message / 16 vectors, at most kRegChunk bytes: larger messages come
// in as kRegChunk pieces), 4 loads in flight per thread.
__global__ void __launch_bounds__(kRegThreads, 1) reg_copy_kernel(const uint4* src, uint4* dst, size_t vecs,
                                                                  size_t msg_vecs) {
  const size_t messages = vecs / msg_vecs;
  for (size_t m = blockIdx.x; m < messages; m += gridDim.x) {
    const uint4* s = src + m * msg_vecs;
    uint4* d = dst + m * msg_vecs;
    for (size_t i = threadIdx.x; i < msg_vecs; i += kRegThreads * kRegUnroll) {
      uint4 v[kRegUnroll];
#pragma unroll
      for (int u = 0; u < kRegUnroll; ++u)
        if (i + u * kRegThreads < msg_vecs) v[u] = s[i + u * kRegThreads];
#pragma unroll
      for (int u = 0; u < kRegUnroll; ++u)
        if (i + u * kRegThreads < msg_vecs) d[i + u * kRegThreads] = v[u];
    }
  }
}

__global__ void fill_kernel(uint32_t* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = 0x3c003c00u ^ (uint32_t(i * 2654435761u) & 0x00ff00ffu);  // finite bf16 pairs, all distinct-ish
}

__global__ void count_mismatches_kernel(const uint32_t* a, const uint32_t* b, size_t n, unsigned long long* bad) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    local += a[i] != b[i];
  if (local) atomicAdd(bad, local);
}

struct DeviceBuffer {
  int device;
  char* ptr = nullptr;
  // Sources get a position-dependent pattern (so misplaced data is caught), destinations zeros.
  DeviceBuffer(int dev, size_t bytes, bool pattern = true) : device(dev) {
    check(cudaSetDevice(dev), "cudaSetDevice");
    check(cudaMalloc(&ptr, bytes), "cudaMalloc");
    check(cudaMemset(ptr, 0, bytes), "cudaMemset");
    if (pattern) fill_kernel<<<1024, 256>>>(reinterpret_cast<uint32_t*>(ptr), bytes / 4);
    check(cudaDeviceSynchronize(), "fill");
  }
  ~DeviceBuffer() {
    cudaSetDevice(device);
    cudaFree(ptr);
  }
};

bool runs_on_dst(const std::string& m) { return m == "tma_load" || m == "reg_load"; }

// Enqueues one transfer on `stream` (current device = the one that runs it).
void enqueue(const std::string& m, const char* src, int src_dev, char* dst, int dst_dev, size_t total,
             size_t message, int sms, cudaStream_t stream) {
  if (m == "copy_engine") {
    for (size_t off = 0; off < total; off += message)
      check(cudaMemcpyPeerAsync(dst + off, dst_dev, src + off, src_dev, message, stream), "cudaMemcpyPeerAsync");
    return;
  }
  if (m == "reg_store" || m == "reg_load") {
    // Messages above one CTA pass are split, as the TMA splits them into stages: otherwise a 256 MiB
    // message would leave all but total/message CTAs idle.
    reg_copy_kernel<<<sms, kRegThreads, kPinSmem, stream>>>(reinterpret_cast<const uint4*>(src),
                                                           reinterpret_cast<uint4*>(dst), total / 16,
                                                           std::min(message, kRegChunk) / 16);
  } else {
    const uint32_t piece = uint32_t(std::min<size_t>(message, kStageBytes));
    const size_t smem = size_t(kStages) * kStageBytes;
    if (m == "tma_store_add")
      tma_copy_kernel<true><<<sms, 32, smem, stream>>>(src, dst, total, piece);
    else
      tma_copy_kernel<false><<<sms, 32, smem, stream>>>(src, dst, total, piece);
  }
  check(cudaGetLastError(), "transfer kernel launch");
}

// Counts the 32-bit words of `dst` (on `dst_dev`) that differ from `src` (any GPU) and throws if any do.
void verify(const char* src, char* dst, int dst_dev, size_t total, const std::string& what) {
  check(cudaSetDevice(dst_dev), "cudaSetDevice");
  unsigned long long* bad;
  unsigned long long n = 0;
  check(cudaMalloc(&bad, sizeof(*bad)), "cudaMalloc");
  check(cudaMemset(bad, 0, sizeof(*bad)), "cudaMemset");
  count_mismatches_kernel<<<1024, 256>>>(reinterpret_cast<const uint32_t*>(src),
                                         reinterpret_cast<const uint32_t*>(dst), total / 4, bad);
  check(cudaGetLastError(), "verify launch");
  const cudaError_t e = cudaMemcpy(&n, bad, sizeof(n), cudaMemcpyDeviceToHost);
  cudaFree(bad);
  check(e, "verify");
  if (n) throw std::runtime_error(what + ": " + std::to_string(n) + " of " + std::to_string(total / 4) +
                                  " words differ from the source after the transfer");
}

// Store-add accumulates, so its check is one more transfer into a zeroed destination (0 + x == x
// exactly in bf16; the source holds finite values only).
void prepare_check(const std::string& m, char* dst, int dst_dev, size_t total) {
  if (m != "tma_store_add") return;
  check(cudaSetDevice(dst_dev), "cudaSetDevice");
  check(cudaMemset(dst, 0, total), "cudaMemset");
  check(cudaDeviceSynchronize(), "sync");
}

void configure(int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  const int smem = kStages * int(kStageBytes);
  check(cudaFuncSetAttribute(tma_copy_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem");
  check(cudaFuncSetAttribute(tma_copy_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem");
  check(cudaFuncSetAttribute(reg_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kPinSmem)), "smem");
}

}  // namespace

const std::vector<std::string>& mechanisms() {
  static const std::vector<std::string> m = {"copy_engine", "tma_store", "tma_load", "tma_store_add", "reg_store",
                                             "reg_load"};
  return m;
}

TransferResult transfer(const std::string& m, int src, int dst, size_t total, size_t message, int sms, int reps) {
  if (std::find(mechanisms().begin(), mechanisms().end(), m) == mechanisms().end())
    throw std::runtime_error("unknown mechanism '" + m + "'");
  if (message < 16 || message % 16 || total % message)
    throw std::runtime_error("message must be a multiple of 16 bytes that divides the total");
  if (reps < 1) throw std::runtime_error("reps must be >= 1");
  if (src == dst) throw std::runtime_error("source and destination must be different GPUs");
  // Bounded number of calls: with 128 B messages the time is per-call overhead anyway.
  if (m == "copy_engine") total = std::min(total, message * kMaxCopyCalls);
  enable_peer_access(src, dst);
  DeviceBuffer a(src, total), b(dst, total, false);
  const int runner = runs_on_dst(m) ? dst : src;
  configure(src);
  configure(dst);
  check(cudaSetDevice(runner), "cudaSetDevice");
  cudaStream_t stream;
  cudaEvent_t start, stop;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> times;
  for (int r = -2; r < reps; ++r) {  // two warm-up transfers
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    enqueue(m, a.ptr, src, b.ptr, dst, total, message, sms, stream);
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (r >= 0) times.push_back(ms);
  }
  if (m == "tma_store_add") {
    prepare_check(m, b.ptr, dst, total);
    check(cudaSetDevice(runner), "cudaSetDevice");
    enqueue(m, a.ptr, src, b.ptr, dst, total, message, sms, stream);
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  verify(a.ptr, b.ptr, dst, total, m);  // the destination must now equal the source, byte for byte
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  const double ms = times[times.size() / 2];
  return {ms, double(total) / (ms * 1e-3) / 1e9, total};
}

double all_pairs(const std::string& m, const std::vector<int>& devices, size_t total, int sms, int reps) {
  const size_t g = devices.size();
  if (g < 2) throw std::runtime_error("all_pairs needs >= 2 devices");
  if (reps < 1) throw std::runtime_error("reps must be >= 1");
  if (std::find(mechanisms().begin(), mechanisms().end(), m) == mechanisms().end())
    throw std::runtime_error("unknown mechanism '" + m + "'");
  for (size_t i = 0; i < g; ++i)
    for (size_t j = i + 1; j < g; ++j) enable_peer_access(devices[i], devices[j]);
  std::vector<std::unique_ptr<DeviceBuffer>> src, dst;  // src[i]: data on i; dst[i*g+j]: on j, from i
  std::vector<cudaStream_t> streams(g * g);
  for (size_t i = 0; i < g; ++i) {
    configure(devices[i]);
    src.push_back(std::make_unique<DeviceBuffer>(devices[i], total));
  }
  for (size_t i = 0; i < g; ++i)
    for (size_t j = 0; j < g; ++j) {
      dst.push_back(i == j ? std::unique_ptr<DeviceBuffer>()
                           : std::make_unique<DeviceBuffer>(devices[j], total, false));
      const int runner = runs_on_dst(m) ? devices[j] : devices[i];
      check(cudaSetDevice(runner), "cudaSetDevice");
      check(cudaStreamCreateWithFlags(&streams[i * g + j], cudaStreamNonBlocking), "cudaStreamCreate");
    }
  const int per_peer = std::max(1, sms / int(g - 1));
  std::vector<double> times;
  for (int r = -1; r < reps; ++r) {
    for (int d : devices) check(cudaSetDevice(d), "cudaSetDevice"), check(cudaDeviceSynchronize(), "sync");
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < g; ++i)
      for (size_t j = 0; j < g; ++j) {
        if (i == j) continue;
        check(cudaSetDevice(runs_on_dst(m) ? devices[j] : devices[i]), "cudaSetDevice");
        enqueue(m, src[i]->ptr, devices[i], dst[i * g + j]->ptr, devices[j], total,
                m == "copy_engine" ? total : size_t(64) << 10, per_peer, streams[i * g + j]);
      }
    for (int d : devices) check(cudaSetDevice(d), "cudaSetDevice"), check(cudaDeviceSynchronize(), "sync");
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (r >= 0) times.push_back(ms);
  }
  for (size_t i = 0; i < g; ++i)  // store-add: one more round into zeroed destinations, for the check
    for (size_t j = 0; j < g && m == "tma_store_add"; ++j) {
      if (i == j) continue;
      prepare_check(m, dst[i * g + j]->ptr, devices[j], total);
      check(cudaSetDevice(devices[i]), "cudaSetDevice");
      enqueue(m, src[i]->ptr, devices[i], dst[i * g + j]->ptr, devices[j], total, size_t(64) << 10, per_peer,
              streams[i * g + j]);
      check(cudaStreamSynchronize(streams[i * g + j]), "cudaStreamSynchronize");
    }
  for (size_t k = 0; k < streams.size(); ++k) {
    if (k / g == k % g) continue;
    cudaStreamDestroy(streams[k]);
  }
  for (size_t i = 0; i < g; ++i)
    for (size_t j = 0; j < g; ++j)
      if (i != j)
        verify(src[i]->ptr, dst[i * g + j]->ptr, devices[j], total,
               m + " all pairs " + std::to_string(devices[i]) + "->" + std::to_string(devices[j]));
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return double(total) * double(g - 1) / (times[times.size() / 2] * 1e-3) / 1e9;
}

}  // namespace pk::microbench
