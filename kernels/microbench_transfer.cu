// Transfer-mechanism microbenchmarks (paper 3.1.2): copy engine, TMA and register transfers between
// two GPUs, by message size and by SM count.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
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
// stages: loads run kStages-1 pieces ahead of the stores. `cta` of `ncta` CTAs takes pieces cta,
// cta + ncta, ... (the pair kernel: blockIdx.x of gridDim.x; the all-to-all kernel: its share of a peer).
template <bool ADD>
__device__ __forceinline__ void tma_copy_cta(const char* src, char* dst, size_t total, uint32_t piece, size_t cta,
                                             size_t ncta, char* smem, uint64_t* bar) {
  const size_t pieces = total / piece;
  const size_t mine = pieces > cta ? (pieces - cta + ncta - 1) / ncta : 0;
  auto offset = [&](size_t k) { return (cta + k * ncta) * size_t(piece); };
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

template <bool ADD>
__global__ void __launch_bounds__(32, 1) tma_copy_kernel(const char* src, char* dst, size_t total, uint32_t piece) {
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t bar[kStages];
  if (threadIdx.x != 0) return;
  tma_copy_cta<ADD>(src, dst, total, piece, blockIdx.x, gridDim.x, smem, bar);
}

// Each CTA copies whole messages (message / 16 vectors, at most kRegChunk bytes: larger messages come
// in as kRegChunk pieces), 4 loads in flight per thread; `cta` of `ncta` takes messages cta, cta + ncta, ...
__device__ __forceinline__ void reg_copy_cta(const uint4* src, uint4* dst, size_t vecs, size_t msg_vecs, size_t cta,
                                             size_t ncta) {
  const size_t messages = vecs / msg_vecs;
  for (size_t m = cta; m < messages; m += ncta) {
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

__global__ void __launch_bounds__(kRegThreads, 1) reg_copy_kernel(const uint4* src, uint4* dst, size_t vecs,
                                                                  size_t msg_vecs) {
  reg_copy_cta(src, dst, vecs, msg_vecs, blockIdx.x, gridDim.x);
}

// ---- All-to-all over G GPUs (a2a_*): GPU s sends slot d of its send buffer to slot s of GPU d's receive
// buffer, for every d != s, all GPUs at once. One kernel per GPU; CTA b serves peer b % (G-1).
constexpr int kMaxA2A = 8;
struct A2APeers {
  const char* src[kMaxA2A - 1];  // this GPU's send slot for peer p
  char* dst[kMaxA2A - 1];        // slot "this GPU" of peer p's receive buffer
  int n;                         // G - 1
};

// This CTA's peer, its rank among that peer's CTAs and their number; `src`/`dst` picked by unrolled
// compares (a dynamic index into the parameter array would copy it to the stack).
__device__ __forceinline__ void a2a_share(const A2APeers& p, const char*& src, char*& dst, size_t& cta, size_t& ncta) {
  const int peer = int(blockIdx.x % p.n);
  cta = blockIdx.x / p.n;
  ncta = (gridDim.x - peer + p.n - 1) / p.n;
  src = p.src[0];
  dst = p.dst[0];
#pragma unroll
  for (int k = 1; k < kMaxA2A - 1; ++k)
    if (peer == k) src = p.src[k], dst = p.dst[k];
}

__global__ void __launch_bounds__(32, 1) a2a_tma_store_kernel(A2APeers p, size_t bytes, uint32_t piece) {
  extern __shared__ __align__(128) char smem[];
  __shared__ uint64_t bar[kStages];
  if (threadIdx.x != 0) return;
  const char* src;
  char* dst;
  size_t cta, ncta;
  a2a_share(p, src, dst, cta, ncta);
  tma_copy_cta<false>(src, dst, bytes, piece, cta, ncta, smem, bar);
}

__global__ void __launch_bounds__(kRegThreads, 1) a2a_reg_store_kernel(A2APeers p, size_t bytes, size_t msg_vecs) {
  const char* src;
  char* dst;
  size_t cta, ncta;
  a2a_share(p, src, dst, cta, ncta);
  reg_copy_cta(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), bytes / 16, msg_vecs, cta, ncta);
}

// Word w of the message from GPU slot s to GPU slot d (distinct per (s, d, w), so a misplaced or
// missing message is caught).
__device__ __forceinline__ uint32_t a2a_word(uint32_t s, uint32_t d, size_t w) {
  uint32_t x = uint32_t(w) * 2654435761u + (s * kMaxA2A + d + 1) * 0x9e3779b9u + uint32_t(w >> 32);
  return x ^ (x >> 15);
}

// Send buffer of slot s: G slots of `words` words, slot d holding the message for d (own slot zero).
__global__ void a2a_fill_kernel(uint32_t* p, uint32_t s, uint32_t g, size_t words) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < g * words; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t d = uint32_t(i / words);
    p[i] = d == s ? 0u : a2a_word(s, d, i % words);
  }
}

// Receive buffer of slot d: slot s must hold the message from s (own slot is not checked).
__global__ void a2a_count_bad_kernel(const uint32_t* p, uint32_t d, uint32_t g, size_t words,
                                     unsigned long long* bad) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < g * words; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t s = uint32_t(i / words);
    local += s != d && p[i] != a2a_word(s, d, i % words);
  }
  if (local) atomicAdd(bad, local);
}

// Holds a stream until the host writes 1 to `flag` (mapped pinned memory), so every GPU starts the
// all-to-all within a PCIe round trip of the others; gives up after 10 s (a host that threw).
__global__ void a2a_gate_kernel(const volatile int* flag) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (*flag == 0) {
    __nanosleep(200);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 10000000000ull) break;
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
  check(cudaFuncSetAttribute(a2a_tma_store_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem");
  check(cudaFuncSetAttribute(a2a_reg_store_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kPinSmem)),
        "smem");
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

const std::vector<std::string>& a2a_mechanisms() {
  static const std::vector<std::string> m = {"copy_engine", "tma_store", "reg_store"};
  return m;
}

std::vector<std::pair<int, int>> missing_peer_access(const std::vector<int>& devices) {
  std::vector<std::pair<int, int>> out;
  for (int a : devices)
    for (int b : devices) {
      if (a == b) continue;
      int can = 0;
      check(cudaDeviceCanAccessPeer(&can, a, b), "cudaDeviceCanAccessPeer");
      if (!can) out.emplace_back(a, b);
    }
  return out;
}

AllToAllResult all_to_all(const std::string& m, const std::vector<int>& devices, size_t bytes_per_peer, int sms,
                          int reps) {
  const int g = int(devices.size());
  if (g < 2 || g > kMaxA2A) throw std::runtime_error("all_to_all needs 2..8 devices");
  if (reps < 1) throw std::runtime_error("reps must be >= 1");
  if (std::find(a2a_mechanisms().begin(), a2a_mechanisms().end(), m) == a2a_mechanisms().end())
    throw std::runtime_error("unknown all-to-all mechanism '" + m + "'");
  const size_t piece = std::min<size_t>(bytes_per_peer, kStageBytes);  // == kRegChunk
  if (bytes_per_peer < 16 || bytes_per_peer % 16 || bytes_per_peer % piece)
    throw std::runtime_error("bytes_per_peer must be a multiple of 16 bytes, and of 32 KiB above 32 KiB");
  const bool ce = m == "copy_engine";
  if (!ce && sms < g - 1) throw std::runtime_error("all_to_all needs at least one CTA per peer (sms >= G-1)");
  // Kernels need peer access both ways between every pair (enable_peer_access throws naming the
  // pair); the copy engine takes it where there is a path and stages through the host elsewhere.
  // Without a peer path a copy may be staged through the host and block it, so then no gate (below).
  bool use_gate = true;
  for (int i = 0; i < g; ++i)
    for (int j = i + 1; j < g; ++j) {
      if (ce) {
        int ab = 0, ba = 0;
        check(cudaDeviceCanAccessPeer(&ab, devices[i], devices[j]), "cudaDeviceCanAccessPeer");
        check(cudaDeviceCanAccessPeer(&ba, devices[j], devices[i]), "cudaDeviceCanAccessPeer");
        if (!ab || !ba) {
          use_gate = false;
          continue;
        }
      }
      enable_peer_access(devices[i], devices[j]);
    }
  const size_t slots = size_t(g) * bytes_per_peer, words = bytes_per_peer / 4;
  std::vector<std::unique_ptr<DeviceBuffer>> send, recv;  // on devices[i]: G slots each
  for (int i = 0; i < g; ++i) {
    configure(devices[i]);
    send.push_back(std::make_unique<DeviceBuffer>(devices[i], slots, false));
    recv.push_back(std::make_unique<DeviceBuffer>(devices[i], slots, false));
    a2a_fill_kernel<<<1024, 256>>>(reinterpret_cast<uint32_t*>(send[i]->ptr), uint32_t(i), uint32_t(g), words);
    check(cudaGetLastError(), "a2a fill launch");
    check(cudaDeviceSynchronize(), "a2a fill");
  }
  // Per GPU: a main stream (gate, events, the kernel) and, for the copy engine, one stream per peer.
  struct PerGpu {
    cudaStream_t main = nullptr;
    std::vector<cudaStream_t> peer;
    cudaEvent_t start = nullptr, end = nullptr;
    std::vector<cudaEvent_t> done;
  };
  std::vector<PerGpu> gpu(g);
  int* flag = nullptr;
  auto cleanup = [&] {
    if (flag) *reinterpret_cast<volatile int*>(flag) = 1;  // release any gate still waiting
    for (int i = 0; i < g; ++i) {
      cudaSetDevice(devices[i]);
      cudaDeviceSynchronize();
      for (auto s : gpu[i].peer) cudaStreamDestroy(s);
      for (auto e : gpu[i].done) cudaEventDestroy(e);
      if (gpu[i].main) cudaStreamDestroy(gpu[i].main);
      if (gpu[i].start) cudaEventDestroy(gpu[i].start);
      if (gpu[i].end) cudaEventDestroy(gpu[i].end);
    }
    if (flag) cudaFreeHost(flag);
  };
  std::vector<double> rep_ms;
  std::vector<std::vector<float>> gpu_ms(g);
  try {
    check(cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc");
    for (int i = 0; i < g; ++i) {
      check(cudaSetDevice(devices[i]), "cudaSetDevice");
      check(cudaStreamCreateWithFlags(&gpu[i].main, cudaStreamNonBlocking), "cudaStreamCreate");
      check(cudaEventCreate(&gpu[i].start), "cudaEventCreate");
      check(cudaEventCreate(&gpu[i].end), "cudaEventCreate");
      for (int p = 0; ce && p < g - 1; ++p) {
        cudaStream_t s;
        cudaEvent_t e;
        check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
        gpu[i].peer.push_back(s);
        check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
        gpu[i].done.push_back(e);
      }
    }
    int* dflag = nullptr;
    check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dflag), flag, 0), "cudaHostGetDevicePointer");
    for (int r = -2; r < reps; ++r) {  // two warm-up rounds; receive buffers zeroed before each round
      *reinterpret_cast<volatile int*>(flag) = 0;
      for (int i = 0; i < g; ++i) {
        check(cudaSetDevice(devices[i]), "cudaSetDevice");
        check(cudaMemsetAsync(recv[i]->ptr, 0, slots, gpu[i].main), "cudaMemsetAsync");
      }
      for (int i = 0; i < g; ++i)  // host barrier: every GPU idle before any starts
        check(cudaSetDevice(devices[i]), "cudaSetDevice"), check(cudaDeviceSynchronize(), "sync");
      for (int i = 0; i < g; ++i) {
        PerGpu& me = gpu[i];
        check(cudaSetDevice(devices[i]), "cudaSetDevice");
        if (use_gate) {
          a2a_gate_kernel<<<1, 1, 0, me.main>>>(dflag);
          check(cudaGetLastError(), "a2a gate launch");
        }
        check(cudaEventRecord(me.start, me.main), "cudaEventRecord");
        A2APeers peers{};
        peers.n = g - 1;
        for (int p = 0; p < g - 1; ++p) {
          const int d = p < i ? p : p + 1;  // peer p of GPU i
          peers.src[p] = send[i]->ptr + size_t(d) * bytes_per_peer;
          peers.dst[p] = recv[d]->ptr + size_t(i) * bytes_per_peer;
        }
        if (ce) {
          for (int p = 0; p < g - 1; ++p) {
            const int d = p < i ? p : p + 1;
            check(cudaStreamWaitEvent(me.peer[p], me.start, 0), "cudaStreamWaitEvent");
            check(cudaMemcpyPeerAsync(peers.dst[p], devices[d], peers.src[p], devices[i], bytes_per_peer, me.peer[p]),
                  "cudaMemcpyPeerAsync");
            check(cudaEventRecord(me.done[p], me.peer[p]), "cudaEventRecord");
            check(cudaStreamWaitEvent(me.main, me.done[p], 0), "cudaStreamWaitEvent");
          }
        } else if (m == "tma_store") {
          a2a_tma_store_kernel<<<sms, 32, size_t(kStages) * kStageBytes, me.main>>>(peers, bytes_per_peer,
                                                                                   uint32_t(piece));
        } else {
          a2a_reg_store_kernel<<<sms, kRegThreads, kPinSmem, me.main>>>(peers, bytes_per_peer, piece / 16);
        }
        check(cudaGetLastError(), "a2a launch");
        check(cudaEventRecord(me.end, me.main), "cudaEventRecord");
      }
      std::atomic_thread_fence(std::memory_order_seq_cst);
      *reinterpret_cast<volatile int*>(flag) = 1;  // all GPUs go
      double worst = 0;
      for (int i = 0; i < g; ++i) {
        check(cudaSetDevice(devices[i]), "cudaSetDevice");
        check(cudaEventSynchronize(gpu[i].end), "cudaEventSynchronize");
        float ms = 0;
        check(cudaEventElapsedTime(&ms, gpu[i].start, gpu[i].end), "cudaEventElapsedTime");
        worst = std::max(worst, double(ms));
        if (r >= 0) gpu_ms[i].push_back(ms);
      }
      if (r >= 0) rep_ms.push_back(worst);
    }
    // The last round's receive buffers, every slot but the own one, against the pattern.
    for (int d = 0; d < g; ++d) {
      check(cudaSetDevice(devices[d]), "cudaSetDevice");
      unsigned long long* bad;
      unsigned long long n = 0;
      check(cudaMalloc(&bad, sizeof(*bad)), "cudaMalloc");
      check(cudaMemset(bad, 0, sizeof(*bad)), "cudaMemset");
      a2a_count_bad_kernel<<<1024, 256>>>(reinterpret_cast<const uint32_t*>(recv[d]->ptr), uint32_t(d), uint32_t(g),
                                          words, bad);
      check(cudaGetLastError(), "a2a verify launch");
      const cudaError_t e = cudaMemcpy(&n, bad, sizeof(n), cudaMemcpyDeviceToHost);
      cudaFree(bad);
      check(e, "a2a verify");
      if (n)
        throw std::runtime_error(m + " all-to-all: GPU " + std::to_string(devices[d]) + " received " +
                                 std::to_string(n) + " of " + std::to_string(words * (g - 1)) + " words wrong");
    }
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  auto median = [](auto v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return double(v[v.size() / 2]);
  };
  AllToAllResult out;
  out.ms = median(rep_ms);
  for (int i = 0; i < g; ++i) out.gpu_ms.push_back(median(gpu_ms[i]));
  return out;
}

}  // namespace pk::microbench
