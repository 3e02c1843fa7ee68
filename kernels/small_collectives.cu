// Small-message collectives: at most one cross-GPU trip per phase, no per-call handshakes. Each
// member's control block (mapped by every member) holds LL receive areas ll[parity][sender][line];
// a sender stores its payload straight into each receiver's area as LL lines (pk/ll.cuh) whose flag
// is the small-op epoch of that pair, and the receiver spins on its own (local) lines. Nothing of an
// XLA buffer is touched by a peer, so there is no ready (address publication) and no done handshake.
// Parity double-buffering makes the reuse safe: a member starts small op n+2 with peer p only after
// finishing op n+1, which needs p's op n+1 lines, which p sends only after its op n kernel ended,
// i.e. after p read everything of op n; so the writer is at most one op ahead of the reader and
// op n+2 lands in the parity op n used, never in the one op n+1 is still being read from.
// Reductions sum in float32 in rank order, as the pull-reduce kernel does: identical bits on every
// member and the same bits as the bulk path. Design and accounting: docs/design-small-collectives.md.
#include "small_collectives.cuh"

#include "small_ll128.cuh"
#include "small_pipelined.cuh"
#include "pk/env.h"
#include "pk/ll.cuh"
#include "pk/small_epochs.cuh"
#include "pk/vec.cuh"

namespace pk {
namespace {

constexpr int kSmallThreads = 256;  // launch_bounds(256, 1): up to 255 registers, the reductions use 138-148
constexpr int kWordsPerThread = 8;   // LL lines each thread has in flight per phase
// 128 lines (512 payload bytes) per CTA, as many CTAs as SMs: a 4 KiB op on 8 SMs, 64 KiB and up on every SM.
// Measured on 2x H200 (2026-11-23, scripts/latency_floor.py slopes, us per op at 4K / 16K / 64K / 256K / 1M):
// 128 lines 4.81 / 4.21 / 5.23 / 6.80 / 13.07; 512 lines 5.21 / 4.72 / 5.50 / 7.52 / 12.98; 2048 lines with
// 128 CTAs (the first choice) 5.56 / 7.39 / 8.01 / 8.71 / 13.54.
constexpr int kSmallLinesPerCta = 128;
constexpr int kSmallMaxCtas = 1024;  // capped by the SM count at launch
// Chunk-flag all_reduce: bytes per CTA, up to every SM; larger messages get larger chunks. Swept on 2x H200
// (2026-11-23, PK_JAX_SMALL_CHUNK_BYTES, slopes in us at 64 KiB / 256 KiB / 1 MiB / 8 MiB): 2048 7.8 / 9.7 /
// 12.1 / 37.4; 4096 8.0 / 8.3 / 10.9 / -; 8192 7.3 / 8.0 / 11.2 / 37.1; 16384 7.5 / 9.2 / 11.8 / 37.1.
constexpr int64_t kSmallChunkBytes = 8192;

// Grid geometry: lines per CTA (fewer: the sends spread over more SMs) and the grid's cap (at most the
// SMs, so every CTA is resident and no receiver waits on a sender that cannot start). Defaults above;
// PK_JAX_SMALL_LINES_PER_CTA / PK_JAX_SMALL_MAX_CTAS override them for the latency sweep
// (scripts/latency_floor.py). Read once per process: no per-call host state.
struct SmallGeometry {
  int64_t lines_per_cta;
  int64_t max_ctas;
  int64_t chunk_bytes;  // chunk-flag all_reduce: target bytes per CTA (PK_JAX_SMALL_CHUNK_BYTES)
};

const SmallGeometry& small_geometry() {
  static const SmallGeometry geo{
      env_or("PK_JAX_SMALL_LINES_PER_CTA", kSmallLinesPerCta, 32,
             int64_t(kSmallThreads) * kWordsPerThread * 64),
      env_or("PK_JAX_SMALL_MAX_CTAS", kSmallMaxCtas, 1, 1024),
      env_or("PK_JAX_SMALL_CHUNK_BYTES", kSmallChunkBytes, 256, kChunkedBytes) / 16 * 16};
  return geo;
}

// 4 bytes at byte offset `off` (even) of a buffer whose valid bytes end at `end`. 16-bit data may sit
// at 2 (mod 4) (odd chunk sizes) and may end in half a word: those go by 16-bit halves.
__device__ __forceinline__ uint32_t load_word(const char* base, int64_t off, int64_t end) {
  if ((off & 3) == 0 && off + 4 <= end) return *reinterpret_cast<const uint32_t*>(base + off);
  const uint32_t lo = *reinterpret_cast<const uint16_t*>(base + off);
  const uint32_t hi = off + 2 < end ? *reinterpret_cast<const uint16_t*>(base + off + 2) : 0u;
  return lo | (hi << 16);
}

__device__ __forceinline__ void store_word(char* base, int64_t off, int64_t end, uint32_t w) {
  if ((off & 3) == 0 && off + 4 <= end) {
    *reinterpret_cast<uint32_t*>(base + off) = w;
    return;
  }
  *reinterpret_cast<uint16_t*>(base + off) = uint16_t(w);
  if (off + 2 < end) *reinterpret_cast<uint16_t*>(base + off + 2) = uint16_t(w >> 16);
}

// A word holds one float or two 16-bit elements; sums run in float32.
template <typename T>
__device__ __forceinline__ void add_word(float (&acc)[2], uint32_t w) {
  if constexpr (sizeof(T) == 4) {
    acc[0] += __uint_as_float(w);
  } else {
    T e[2];
    memcpy(e, &w, 4);
    acc[0] += to_float(e[0]);
    acc[1] += to_float(e[1]);
  }
}

template <typename T>
__device__ __forceinline__ uint32_t pack_word(const float (&acc)[2]) {
  if constexpr (sizeof(T) == 4) {
    return __float_as_uint(acc[0]);
  } else {
    const T e[2] = {from_float<T>(acc[0]), from_float<T>(acc[1])};
    uint32_t w;
    memcpy(&w, e, 4);
    return w;
  }
}

// Per-launch state: this op's flag with each member (by rank) and the LL areas.
struct SmallOpState {
  const Group& g;
  uint32_t* flag;  // shared memory, by rank: this small op's LL flag with that member (ll_flag)

  // Where this device's lines for member r go (r's area, this device's sender slot).
  __device__ uint64_t* out(int r) const { return g.ctrl[r]->ll[ll_parity(flag[r])][g.my_slot()]; }
  // Where member r's lines for this device arrive (own area, r's sender slot).
  __device__ const uint64_t* in(int r) const { return g.self()->ll[ll_parity(flag[r])][g.slot[r]]; }

  // Last CTA to finish advances the per-peer epochs (pk/small_epochs.cuh).
  __device__ void finish() const { finish_small_op(g); }
};

#define PK_SMALL_PROLOGUE                                                          \
  __shared__ uint32_t flag_smem[kMaxGroup];                                        \
  load_small_flags(g, flag_smem, g.op);                                            \
  __syncthreads();                                                                 \
  const SmallOpState st{g, flag_smem};

// Calls f(idx, valid) for this thread's words of [0, n), kWordsPerThread at a time; consecutive
// threads take consecutive words (coalesced lines).
template <typename F>
__device__ __forceinline__ void for_words(int64_t n, F f) {
  constexpr int U = kWordsPerThread;
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t base = 0; base < n; base += U * threads) {
    int64_t idx[U];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      idx[u] = base + u * threads + t;
      valid[u] = idx[u] < n;
    }
    f(idx, valid);
  }
}

// Sums word idx[u] over the members in rank order: own from x (bytes [x_off, x_end) hold the words),
// the others from their LL lines at line idx[u] of this device's area. Two members in flight: the
// next member's lines load while this one's are checked and added (the loop over kMaxGroup unrolls,
// so the two buffers stay in registers).
template <typename T>
__device__ __forceinline__ bool reduce_words(const SmallOpState& st, const char* x, int64_t x_off, int64_t x_end,
                                             const int64_t (&idx)[kWordsPerThread],
                                             const bool (&valid)[kWordsPerThread], uint32_t (&out)[kWordsPerThread]) {
  constexpr int U = kWordsPerThread;
  const Group& g = st.g;
  const auto fetch = [&](int r, uint64_t(&v)[U]) {
    const uint64_t* lines = st.in(r);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!valid[u]) continue;
      v[u] = r == g.rank ? uint64_t(load_word(x, x_off + 4 * idx[u], x_end)) : ll_load(lines + idx[u]);
    }
  };
  float acc[U][2] = {};
  uint64_t v[2][U];
  bool ok = true;
  fetch(0, v[0]);
#pragma unroll
  for (int r = 0; r < kMaxGroup; ++r) {
    if (r >= g.size) break;
    if (r + 1 < g.size) fetch(r + 1, v[(r + 1) & 1]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!valid[u]) continue;
      uint32_t w = uint32_t(v[r & 1][u]);
      if (r != g.rank && !ll_ready(v[r & 1][u], st.flag[r])) ok = ll_wait(st.in(r) + idx[u], st.flag[r], w, g, r) && ok;
      add_word<T>(acc[u], w);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (valid[u]) out[u] = pack_word<T>(acc[u]);
  return ok;
}

// Sends this thread's words of x (bytes [x_off, x_end)) to member r's line idx[u] + line_off.
__device__ __forceinline__ void send_words(const SmallOpState& st, int r, const char* x, int64_t x_off, int64_t x_end,
                                           const int64_t (&idx)[kWordsPerThread], const bool (&valid)[kWordsPerThread],
                                           int64_t line_off) {
  uint64_t* lines = st.out(r);
#pragma unroll
  for (int u = 0; u < kWordsPerThread; ++u)
    if (valid[u]) ll_store(lines + line_off + idx[u], load_word(x, x_off + 4 * idx[u], x_end), st.flag[r]);
}

// all_reduce one-shot: n bytes, W = ceil(n / 4) lines to every peer; every member sums all G.
template <typename T>
__global__ void __launch_bounds__(kSmallThreads, 1) small_all_reduce_one_shot(Group g, const char* x, char* y, int64_t n) {
  PK_SMALL_PROLOGUE
  const int64_t words = (n + 3) / 4;
  // Send everything first, so a peer's receive never waits on this device's receive.
  for_words(words, [&](const int64_t(&idx)[kWordsPerThread], const bool(&valid)[kWordsPerThread]) {
    for (int p = 1; p < g.size; ++p) send_words(st, (g.rank + p) % g.size, x, 0, n, idx, valid, 0);
  });
  for_words(words, [&](const int64_t(&idx)[kWordsPerThread], const bool(&valid)[kWordsPerThread]) {
    uint32_t w[kWordsPerThread];
    reduce_words<T>(st, x, 0, n, idx, valid, w);
#pragma unroll
    for (int u = 0; u < kWordsPerThread; ++u)
      if (valid[u]) store_word(y, 4 * idx[u], n, w[u]);
  });
  st.finish();
}

// all_reduce two-shot: W words (W % G == 0) in G chunks of C; word i belongs to owner i / C. (A) send
// the other owners' words to them; (B) sum own chunk over all members, keep it and send it to every
// peer (into their area's lines of this chunk: disjoint from the lines of (A)); (C) take the others'.
template <typename T>
__global__ void __launch_bounds__(kSmallThreads, 1) small_all_reduce_two_shot(Group g, const char* x, char* y, int64_t n) {
  PK_SMALL_PROLOGUE
  const int64_t words = (n + 3) / 4, chunk = words / g.size, mine = g.rank * chunk;
  const auto other_word = [&](int64_t j) { return j < mine ? j : j + chunk; };  // j in [0, W - C)
  for_words(words - chunk, [&](const int64_t(&idx)[kWordsPerThread], const bool(&valid)[kWordsPerThread]) {
#pragma unroll
    for (int u = 0; u < kWordsPerThread; ++u) {
      if (!valid[u]) continue;
      const int64_t i = other_word(idx[u]);
      const int owner = int(i / chunk);
      ll_store(st.out(owner) + i, load_word(x, 4 * i, n), st.flag[owner]);
    }
  });
  for_words(chunk, [&](const int64_t(&idx)[kWordsPerThread], const bool(&valid)[kWordsPerThread]) {
    int64_t at[kWordsPerThread];
#pragma unroll
    for (int u = 0; u < kWordsPerThread; ++u) at[u] = mine + idx[u];
    uint32_t w[kWordsPerThread];
    reduce_words<T>(st, x, 0, n, at, valid, w);
    for (int p = 1; p < g.size; ++p) {
      const int r = (g.rank + p) % g.size;
      uint64_t* lines = st.out(r);
#pragma unroll
      for (int u = 0; u < kWordsPerThread; ++u)
        if (valid[u]) ll_store(lines + at[u], w[u], st.flag[r]);
    }
#pragma unroll
    for (int u = 0; u < kWordsPerThread; ++u)
      if (valid[u]) store_word(y, 4 * at[u], n, w[u]);
  });
  for_words(words - chunk, [&](const int64_t(&idx)[kWordsPerThread], const bool(&valid)[kWordsPerThread]) {
    constexpr int U = kWordsPerThread;
    const uint64_t* line[U];
    uint32_t flag[U], w[U];
    int owner[U];
    int64_t at[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      at[u] = valid[u] ? other_word(idx[u]) : 0;
      owner[u] = int(at[u] / chunk);
      line[u] = st.in(owner[u]) + at[u];
      flag[u] = st.flag[owner[u]];
    }
    ll_receive_each<U>(line, flag, owner, valid, w, g);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (valid[u]) store_word(y, 4 * at[u], n, w[u]);
  });
  st.finish();
}

// all_gather: x (nb bytes) to every peer; y = the G blocks in rank order (block s at s * nb).
__global__ void __launch_bounds__(kSmallThreads, 1) small_all_gather(Group g, const char* x, char* y, int64_t nb) {
  PK_SMALL_PROLOGUE
  const int64_t words = (nb + 3) / 4;
  for_words(words, [&](const int64_t(&idx)[kWordsPerThread], const bool(&valid)[kWordsPerThread]) {
    for (int p = 1; p < g.size; ++p) send_words(st, (g.rank + p) % g.size, x, 0, nb, idx, valid, 0);
  });
  for_words(words * g.size, [&](const int64_t(&idx)[kWordsPerThread], const bool(&valid)[kWordsPerThread]) {
    constexpr int U = kWordsPerThread;
    const uint64_t* line[U];
    uint32_t flag[U], w[U];
    int src[U];
    int64_t at[U];
    bool remote[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      src[u] = valid[u] ? int(idx[u] / words) : 0;
      at[u] = idx[u] - src[u] * words;
      remote[u] = valid[u] && src[u] != g.rank;
      line[u] = st.in(src[u]) + at[u];
      flag[u] = st.flag[src[u]];
      if (valid[u] && !remote[u]) w[u] = load_word(x, 4 * at[u], nb);
    }
    ll_receive_each<U>(line, flag, src, remote, w, g);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (valid[u]) store_word(y, src[u] * nb + 4 * at[u], (src[u] + 1) * nb, w[u]);
  });
  st.finish();
}

// reduce_scatter: x = G chunks of cb bytes; chunk r goes to member r, which sums all G in rank order.
template <typename T>
__global__ void __launch_bounds__(kSmallThreads, 1) small_reduce_scatter(Group g, const char* x, char* y, int64_t cb) {
  PK_SMALL_PROLOGUE
  const int64_t words = (cb + 3) / 4;
  for_words(words, [&](const int64_t(&idx)[kWordsPerThread], const bool(&valid)[kWordsPerThread]) {
    for (int p = 1; p < g.size; ++p) {
      const int r = (g.rank + p) % g.size;
      send_words(st, r, x, r * cb, (r + 1) * cb, idx, valid, 0);
    }
  });
  for_words(words, [&](const int64_t(&idx)[kWordsPerThread], const bool(&valid)[kWordsPerThread]) {
    uint32_t w[kWordsPerThread];
    reduce_words<T>(st, x, g.rank * cb, (g.rank + 1) * cb, idx, valid, w);
#pragma unroll
    for (int u = 0; u < kWordsPerThread; ++u)
      if (valid[u]) store_word(y, 4 * idx[u], cb, w[u]);
  });
  st.finish();
}

// all_reduce, chunk-flag protocol ("small_chunked"): plain 16-byte stores into each peer's chunk_data
// instead of LL lines (half the NVLink bytes), paid for with one fence and one flag per chunk. CTA c
// stores bytes [c C, (c+1) C) of x into every peer, fences (its stores acknowledged: ~1 round trip),
// sets chunk c's flag in each peer with release, then waits for chunk c's flag from every peer
// (acquire) and sums the G chunks in rank order from x and its own chunk_data (through L2: peers wrote
// them). Beats LL where the bytes, not the trip, dominate: docs/design-small-collectives.md.
template <typename T>
__global__ void __launch_bounds__(kSmallThreads, 1)
    small_all_reduce_chunked(Group g, const char* x, char* y, int64_t n, int64_t chunk) {
  PK_SMALL_PROLOGUE
  constexpr int U = 4;  // 16-byte vectors per thread in flight
  const int c = blockIdx.x;
  const int64_t begin = c * chunk, end = begin + chunk < n ? begin + chunk : n;
  const int64_t vb = begin / 16, ve = end / 16;  // chunk is a multiple of 16: only the last chunk has a tail
  const int64_t tail_elems = (end - ve * 16) / int64_t(sizeof(T)), tail_first = ve * 16 / int64_t(sizeof(T));
  const auto area = [&](int r) { return g.ctrl[r]->chunk_data[ll_parity(st.flag[r])][g.my_slot()]; };
  // (1) Send the chunk to every peer.
  for (int64_t v0 = vb + threadIdx.x; v0 < ve; v0 += U * blockDim.x) {
    uint4 d[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v0 + u * blockDim.x < ve) d[u] = reinterpret_cast<const uint4*>(x)[v0 + u * blockDim.x];
    for (int p = 1; p < g.size; ++p) {
      uint4* dst = reinterpret_cast<uint4*>(area((g.rank + p) % g.size));
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (v0 + u * blockDim.x < ve) dst[v0 + u * blockDim.x] = d[u];
    }
  }
  if (threadIdx.x < tail_elems)
    for (int p = 1; p < g.size; ++p)
      reinterpret_cast<T*>(area((g.rank + p) % g.size))[tail_first + threadIdx.x] =
          reinterpret_cast<const T*>(x)[tail_first + threadIdx.x];
  // (2) Chunk c's flag to every peer once all of this CTA's stores were acknowledged.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < g.size && threadIdx.x != g.rank) {
    const int r = threadIdx.x;
    st_release_sys_u32(&g.ctrl[r]->chunk_flag[ll_parity(st.flag[r])][g.my_slot()][c], st.flag[r]);
  }
  // (3) Every peer's chunk c (acquire), then the rank-order float32 sum.
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  if (threadIdx.x < g.size && threadIdx.x != g.rank) {
    const int r = threadIdx.x;
    if (!chunk_flag_wait(&g.self()->chunk_flag[ll_parity(st.flag[r])][g.slot[r]][c], st.flag[r], g, r)) ok = 0;
  }
  __syncthreads();
  const auto in = [&](int r) -> const char* {
    return r == g.rank ? x : g.self()->chunk_data[ll_parity(st.flag[r])][g.slot[r]];
  };
  using L = lanes<T, 16>;
  if (ok) {
    for (int64_t v0 = vb + threadIdx.x; v0 < ve; v0 += U * blockDim.x) {
      float acc[U][L::kCount] = {};
#pragma unroll
      for (int r = 0; r < kMaxGroup; ++r) {
        if (r >= g.size) break;
        const uint4* src = reinterpret_cast<const uint4*>(in(r));
        uint4 d[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (v0 + u * blockDim.x < ve) d[u] = r == g.rank ? src[v0 + u * blockDim.x] : __ldcg(src + v0 + u * blockDim.x);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (v0 + u * blockDim.x < ve) L::add(acc[u], d[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (v0 + u * blockDim.x < ve) reinterpret_cast<uint4*>(y)[v0 + u * blockDim.x] = L::pack(acc[u]);
    }
    if (threadIdx.x < tail_elems) {
      float acc = 0.f;
      for (int r = 0; r < g.size; ++r) {
        const T* src = reinterpret_cast<const T*>(in(r)) + tail_first + threadIdx.x;
        acc += to_float(r == g.rank ? *src : ld_cg(src));
      }
      reinterpret_cast<T*>(y)[tail_first + threadIdx.x] = from_float<T>(acc);
    }
  }
  st.finish();
}

#undef PK_SMALL_PROLOGUE

template <typename T>
const void* small_kernel_for(SmallOp op) {
  switch (op) {
    case SmallOp::kAllReduceOneShot: return reinterpret_cast<const void*>(&small_all_reduce_one_shot<T>);
    case SmallOp::kAllReduceTwoShot: return reinterpret_cast<const void*>(&small_all_reduce_two_shot<T>);
    case SmallOp::kAllGather: return reinterpret_cast<const void*>(&small_all_gather);
    case SmallOp::kReduceScatter: return reinterpret_cast<const void*>(&small_reduce_scatter<T>);
    case SmallOp::kAllReduceChunked: return reinterpret_cast<const void*>(&small_all_reduce_chunked<T>);
    case SmallOp::kAllReducePipelined: return nullptr;  // small_pipelined.cu
    case SmallOp::kAllReduceLL128: return nullptr;      // small_ll128.cu
  }
  return nullptr;
}

const void* small_kernel(SmallOp op, DType dtype) {
  switch (dtype) {
    case DType::kF32: return small_kernel_for<float>(op);
    case DType::kBF16: return small_kernel_for<__nv_bfloat16>(op);
    case DType::kF16: return small_kernel_for<__half>(op);
  }
  return nullptr;
}

}  // namespace

int64_t small_payload_words(SmallOp op, int64_t bytes) {
  (void)op;  // every op's per-peer payload is `bytes` (AR: x; AG: x; RS: one chunk = y)
  return (bytes + 3) / 4;
}

// Chunk-flag all_reduce: chunks of ~chunk_bytes (a multiple of 16), one per CTA, at most one CTA per SM.
cudaError_t launch_chunked(const Group& g, DType dtype, const void* x, void* y, int64_t bytes, const LaunchLimits& lim,
                           cudaStream_t stream) {
  if (bytes <= 0 || bytes > kChunkedBytes || g.size < 2) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y)) & 15) return cudaErrorMisalignedAddress;
  const void* k = small_kernel(SmallOp::kAllReduceChunked, dtype);
  if (!k) return cudaErrorInvalidValue;
  const SmallGeometry& geo = small_geometry();
  int64_t cap = lim.num_sms < geo.max_ctas ? lim.num_sms : geo.max_ctas;  // all CTAs co-resident
  cap = cap < kChunkedMaxChunks ? cap : kChunkedMaxChunks;
  int64_t grid = (bytes + geo.chunk_bytes - 1) / geo.chunk_bytes;
  grid = grid < 1 ? 1 : (grid > cap ? cap : grid);
  int64_t chunk = ((bytes + grid - 1) / grid + 15) / 16 * 16;
  grid = (bytes + chunk - 1) / chunk;
  const char* s = static_cast<const char*>(x);
  char* d = static_cast<char*>(y);
  void* args[] = {const_cast<Group*>(&g), &s, &d, &bytes, &chunk};
  return cudaLaunchKernel(k, dim3(unsigned(grid)), dim3(kSmallThreads), args, 0, stream);
}

cudaError_t launch_small(const Group& g, SmallOp op, DType dtype, const void* x, void* y, int64_t bytes,
                         const LaunchLimits& lim, cudaStream_t stream) {
  if (op == SmallOp::kAllReduceChunked) return launch_chunked(g, dtype, x, y, bytes, lim, stream);
  if (op == SmallOp::kAllReducePipelined) return launch_pipelined(g, dtype, x, y, bytes, lim, stream);
  if (op == SmallOp::kAllReduceLL128) return launch_ll128(g, dtype, x, y, bytes, lim, stream);
  const int64_t words = small_payload_words(op, bytes);
  if (bytes <= 0 || words > kLLLines || g.size < 2) return cudaErrorInvalidValue;
  // Two-shot: every member must own a non-empty chunk, or some pair would exchange nothing in an op
  // and the parity argument (each op hears from every peer) would not hold.
  if (op == SmallOp::kAllReduceTwoShot && words % g.size != 0) return cudaErrorInvalidValue;
  const void* k = small_kernel(op, dtype);
  if (!k) return cudaErrorInvalidValue;
  const int64_t work = op == SmallOp::kAllGather ? words * g.size : words;
  const SmallGeometry& geo = small_geometry();
  const int64_t per_cta = geo.lines_per_cta;
  const int64_t cap = lim.num_sms < geo.max_ctas ? lim.num_sms : geo.max_ctas;  // all CTAs co-resident
  int64_t grid = (work + per_cta - 1) / per_cta;
  grid = grid < 1 ? 1 : (grid > cap ? cap : grid);
  const char* s = static_cast<const char*>(x);
  char* d = static_cast<char*>(y);
  void* args[] = {const_cast<Group*>(&g), &s, &d, &bytes};
  return cudaLaunchKernel(k, dim3(unsigned(grid)), dim3(kSmallThreads), args, 0, stream);
}

std::vector<const void*> small_collective_kernels() {
  std::vector<const void*> out;
  for (SmallOp op : {SmallOp::kAllReduceOneShot, SmallOp::kAllReduceTwoShot, SmallOp::kReduceScatter,
                     SmallOp::kAllReduceChunked}) {
    out.push_back(small_kernel_for<float>(op));
    out.push_back(small_kernel_for<__nv_bfloat16>(op));
    out.push_back(small_kernel_for<__half>(op));
  }
  out.push_back(small_kernel_for<float>(SmallOp::kAllGather));
  for (const void* k : pipelined_kernels()) out.push_back(k);
  for (const void* k : ll128_kernels()) out.push_back(k);
  return out;
}

}  // namespace pk
