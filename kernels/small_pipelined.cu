// all_reduce with the pushes and the sums pipelined ("small_pipelined", issue 25). The chunk-flag
// all_reduce (small_chunked) pushes a chunk, then every thread fences (~1 round trip) and only then sums:
// nothing overlaps the fence. Here each CTA has 8 data warps and 1 signal warp and cuts its share into
// rounds (pk/pipelined_schedule.h has the index math):
//   data warps, iteration i: push round i's chunk (plain 16-byte stores into the peers' chunk_data, as
//     small_chunked), arrive on a CTA-local mbarrier (a release point), then sum round i - lag's chunk
//     once its flags from every peer are seen (ld.acquire.sys, bounded), rank-order float32 into y.
//     Two-shot (G > 2) adds a stage: an owner's sum of its slice's chunk also goes to every peer's area
//     (then a second release point), and round i - 2 lag's chunks of the other slices are copied from
//     the owners' areas into y once their stage-2 flags are seen. (A sum never comes before the release
//     point of the pushes it follows, so lag = 0 cannot deadlock.)
//   signal warp: waits for the next release point and takes every later one already passed (batching:
//     when a fence is slower than a round of stores, one fence covers several rounds), then ONE
//     system-scope fence (fence.acq_rel.sys, one warp instruction) and relaxed system-scope stores of
//     those points' flags into every peer. The data warps never wait for a fence: they go on pushing the
//     next round while it drains.
// The data warps poll the flags themselves (the signal warp would poll only after its own fence, which
// would put up to a round trip per round on the sums). Flags carry this op's small-op epoch and code
// (ll_flag(ll_seq + 1, kOpAllReducePipelined)): stale ones hold older epochs, a member that ran another
// small op at this point shows its code (kOpMismatch); the last CTA advances ll_seq (device memory:
// command-buffer replays are safe, no per-call host state, nothing zeroed per call). Parity double
// buffering as the other small ops: every pair exchanges every flag of the op, even of empty chunks.
// Memory ordering: a data thread's stores -> its mbarrier.arrive (release.cta) -> the signal lane's wait
// (acquire.cta) -> fence.acq_rel.sys -> st.relaxed.sys flag -> the receiver's ld.acquire.sys -> its
// __syncwarp -> the warp's ld.global.cg of the data: causality order through a CTA-scope
// synchronization and a system-scope release pattern (NCCL's simple protocol: bar.sync, then one
// thread's fence and flag). PK_JAX_AR_PIPELINED_FENCE=data makes every data thread fence before arriving
// too, for A/B timing.
#include "small_pipelined.cuh"

#include <cstring>

#include "pk/env.h"
#include "pk/ll.cuh"
#include "pk/small_epochs.cuh"
#include "pk/tma.cuh"
#include "pk/vec.cuh"

namespace pk {
namespace {

constexpr int kDataWarps = 8;
constexpr int kDataThreads = kDataWarps * 32;         // threads 0..255; the signal warp is 256..287
constexpr int kPipelinedThreads = kDataThreads + 32;
constexpr int kVecsInFlight = 4;                      // 16-byte vectors per data thread per step
constexpr uint32_t kFullMask = 0xffffffffu;

enum FenceMode : int32_t { kFenceSignal = 0, kFenceData = 1 };

// Non-blocking: has the mbarrier's phase with `parity` completed?
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n"
      " mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(tma::smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ void st_relaxed_sys_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

template <typename T>
struct Pipeline {
  const Group& g;
  const PipelinedGeometry& geo;
  const char* x;
  char* y;
  int64_t n;
  const uint32_t* flag;  // shared memory, by rank: this op's flag with that member

  // Member r's area for this device's bytes / this device's area for member r's bytes (x's offsets).
  __device__ char* out_area(int r) const { return g.ctrl[r]->chunk_data[ll_parity(flag[r])][g.my_slot()]; }
  __device__ const char* in_area(int r) const { return g.self()->chunk_data[ll_parity(flag[r])][g.slot[r]]; }
  __device__ uint32_t* out_flag(int r, int idx) const {
    return &g.ctrl[r]->chunk_flag[ll_parity(flag[r])][g.my_slot()][idx];
  }
  __device__ const uint32_t* in_flag(int r, int idx) const {
    return &g.self()->chunk_flag[ll_parity(flag[r])][g.slot[r]][idx];
  }

  // One data warp: waits (bounded, acquire) for flag `idx` from member `from`, or from every peer when
  // from < 0; afterwards every lane of the warp may read what the flags guard. False after a timeout or an
  // op mismatch (recorded).
  __device__ bool wait_flags(int idx, int from) const {
    const int lane = threadIdx.x & 31;
    bool ok = true;
    if (lane < g.size && lane != g.rank && (from < 0 || lane == from))
      ok = chunk_flag_wait(in_flag(lane, idx), flag[lane], g, lane);
    __syncwarp();  // orders the acquiring lane's load before the other lanes' data loads
    return __all_sync(kFullMask, ok);
  }

  // This thread's vectors vals[u] (vector v + u * kDataThreads, those below e) into each of dst[0..nd).
  __device__ __forceinline__ static void store_vecs(char* const (&dst)[kMaxGroup], int nd, int64_t v, int64_t e,
                                                    const uint4 (&vals)[kVecsInFlight]) {
    for (int k = 0; k < nd; ++k) {
#pragma unroll
      for (int u = 0; u < kVecsInFlight; ++u) {
        const int64_t w = v + u * kDataThreads;
        if (w < e) reinterpret_cast<uint4*>(dst[k])[w] = vals[u];
      }
    }
  }

  // Data threads: vectors [v0, v1) of src into each of dst[0..nd) at the same offsets. src_peer: a peer
  // wrote src (read through L2). The partial last vector of x (n % 16 bytes) goes by elements (thread 0).
  __device__ void copy(const char* src, bool src_peer, int64_t v0, int64_t v1, char* const (&dst)[kMaxGroup],
                       int nd) const {
    constexpr int U = kVecsInFlight;
    const int64_t full = n / 16, e = v1 < full ? v1 : full;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (int64_t v = v0 + threadIdx.x; v < e; v += U * kDataThreads) {
      uint4 d[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t w = v + u * kDataThreads;
        if (w < e) d[u] = src_peer ? __ldcg(s + w) : s[w];
      }
      store_vecs(dst, nd, v, e, d);
    }
    if (threadIdx.x == 0 && full >= v0 && full < v1) {
      for (int64_t i = full * 16 / int64_t(sizeof(T)); i < n / int64_t(sizeof(T)); ++i) {
        const T* sp = reinterpret_cast<const T*>(src) + i;
        const T val = src_peer ? ld_cg(sp) : *sp;
        for (int k = 0; k < nd; ++k) reinterpret_cast<T*>(dst[k])[i] = val;
      }
    }
  }

  // Data threads: the float32 rank-order sum of vectors [v0, v1) over the members (own from x, the
  // others from their areas), rounded once, into each of dst[0..nd). The same bits as every other path.
  __device__ void reduce(int64_t v0, int64_t v1, char* const (&dst)[kMaxGroup], int nd) const {
    constexpr int U = kVecsInFlight;
    using L = lanes<T, 16>;
    const int64_t full = n / 16, e = v1 < full ? v1 : full;
    for (int64_t v = v0 + threadIdx.x; v < e; v += U * kDataThreads) {
      float acc[U][L::kCount] = {};
#pragma unroll
      for (int r = 0; r < kMaxGroup; ++r) {
        if (r >= g.size) break;
        const uint4* s = reinterpret_cast<const uint4*>(r == g.rank ? x : in_area(r));
        uint4 d[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t w = v + u * kDataThreads;
          if (w < e) d[u] = r == g.rank ? s[w] : __ldcg(s + w);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (v + u * kDataThreads < e) L::add(acc[u], d[u]);
      }
      uint4 out[U];
#pragma unroll
      for (int u = 0; u < U; ++u) out[u] = L::pack(acc[u]);
      store_vecs(dst, nd, v, e, out);
    }
    if (threadIdx.x == 0 && full >= v0 && full < v1) {
      for (int64_t i = full * 16 / int64_t(sizeof(T)); i < n / int64_t(sizeof(T)); ++i) {
        float a = 0.f;
        for (int r = 0; r < g.size; ++r) {
          const T* sp = reinterpret_cast<const T*>(r == g.rank ? x : in_area(r)) + i;
          a += to_float(r == g.rank ? *sp : ld_cg(sp));
        }
        const T val = from_float<T>(a);
        for (int k = 0; k < nd; ++k) reinterpret_cast<T*>(dst[k])[i] = val;
      }
    }
  }

  // Stage 1 of chunk k: one-shot, all of it to every peer; two-shot, chunk k of slice o to its owner o.
  __device__ void push_contributions(int k) const {
    char* dst[kMaxGroup];
    int64_t v0, v1;
    if (!geo.two_shot) {
      for (int q = 1; q < g.size; ++q) dst[q - 1] = out_area((g.rank + q) % g.size);
      geo.chunk_range(0, k, v0, v1);
      copy(x, false, v0, v1, dst, g.size - 1);
      return;
    }
    for (int q = 1; q < g.size; ++q) {
      const int o = (g.rank + q) % g.size;
      dst[0] = out_area(o);
      geo.chunk_range(o, k, v0, v1);
      copy(x, false, v0, v1, dst, 1);
    }
  }

  // Chunk k's sum (its stage-1 flags seen): into y; two-shot, also into every peer's area (stage 2).
  __device__ void sum(int k) const {
    char* dst[kMaxGroup];
    int nd = 0;
    dst[nd++] = y;
    if (geo.two_shot)
      for (int q = 1; q < g.size; ++q) dst[nd++] = out_area((g.rank + q) % g.size);
    int64_t v0, v1;
    geo.chunk_range(geo.two_shot ? g.rank : 0, k, v0, v1);
    reduce(v0, v1, dst, nd);
  }

  // Data threads: arrive at release point rp (after every store it covers, in program order).
  __device__ void release(uint64_t* points, int rp, int32_t fence_mode) const {
    if (rp < 0) return;
    if (fence_mode == kFenceData) __threadfence_system();
    tma::mbar_arrive(&points[rp]);
  }

  __device__ void data_warps(uint64_t* points, int32_t fence_mode) const {
    const int b = blockIdx.x;
    bool ok = true;  // warp-uniform: false once a wait failed (then only the arrivals go on)
    for (int i = 0; i < geo.iters(); ++i) {
      if (i < geo.rounds && ok) push_contributions(geo.chunk_id(b, i));
      release(points, geo.release_point(i, 0), fence_mode);
      const int j = i - geo.lag;
      if (j >= 0 && j < geo.rounds) {
        const int k = geo.chunk_id(b, j);
        ok = ok && wait_flags(geo.flag_index(0, k), -1);
        if (ok) sum(k);
      }
      release(points, geo.release_point(i, 1), fence_mode);
      const int h = i - 2 * geo.lag;
      if (geo.two_shot && h >= 0 && h < geo.rounds) {  // the owners' sums of chunk h into y
        const int k = geo.chunk_id(b, h);
        for (int q = 1; q < g.size; ++q) {
          const int o = (g.rank + q) % g.size;
          ok = ok && wait_flags(geo.flag_index(1, k), o);
          if (!ok) break;
          char* dst[kMaxGroup] = {y};
          int64_t v0, v1;
          geo.chunk_range(o, k, v0, v1);
          copy(in_area(o), true, v0, v1, dst, 1);
        }
      }
    }
  }

  // The signal warp: release points in order, each batch of already-passed points behind one fence.
  __device__ void signal_warp(uint64_t* points) const {
    const int lane = threadIdx.x & 31, b = blockIdx.x;
    const volatile uint32_t* aborted = &g.self()->aborted;
    const int total = geo.release_points();
    for (int next = 0; next < total;) {
      tma::mbar_wait(&points[next], 0);
      int last = next;
      if (lane == 0)
        while (last + 1 < total && mbar_test(&points[last + 1], 0)) ++last;
      last = __shfl_sync(kFullMask, last, 0);
      bool any = false;
      for (int rp = next; rp <= last; ++rp) {
        int stage, round;
        geo.released_by(rp, stage, round);
        any = any || round >= 0;
      }
      if (any) {
        // Every lane acquires the arrivals up to `last` (each data thread arrives in order), then one
        // system-scope fence covers all the stores before them.
        tma::mbar_wait(&points[last], 0);
        fence_acq_rel_sys();
        // After a failure no flags: the peers time out too and report, instead of summing stale bytes.
        if (lane < g.size && lane != g.rank && !*aborted) {
          for (int rp = next; rp <= last; ++rp) {
            int stage, round;
            geo.released_by(rp, stage, round);
            if (round >= 0) st_relaxed_sys_u32(out_flag(lane, geo.flag_index(stage, geo.chunk_id(b, round))), flag[lane]);
          }
        }
      }
      next = last + 1;
    }
  }
};

template <typename T>
__global__ void __launch_bounds__(kPipelinedThreads, 1)
    small_all_reduce_pipelined(Group g, PipelinedGeometry geo, const char* x, char* y, int64_t n, int32_t fence_mode) {
  __shared__ uint32_t flag[kMaxGroup];
  __shared__ __align__(8) uint64_t points[kPipelinedMaxReleasePoints];
  load_small_flags(g, flag, kOpAllReducePipelined);
  if (threadIdx.x == 0) {
    for (int i = 0; i < geo.release_points(); ++i) tma::mbar_init(&points[i], kDataThreads);
    tma::fence_barrier_init();
  }
  __syncthreads();
  const Pipeline<T> p{g, geo, x, y, n, flag};
  if (threadIdx.x < kDataThreads) {
    p.data_warps(points, fence_mode);
  } else {
    p.signal_warp(points);
  }
  finish_small_op(g);
}

const void* pipelined_kernel(DType dtype) {
  switch (dtype) {
    case DType::kF32: return reinterpret_cast<const void*>(&small_all_reduce_pipelined<float>);
    case DType::kBF16: return reinterpret_cast<const void*>(&small_all_reduce_pipelined<__nv_bfloat16>);
    case DType::kF16: return reinterpret_cast<const void*>(&small_all_reduce_pipelined<__half>);
  }
  return nullptr;
}

int32_t fence_mode() {
  static const int32_t mode = [] {
    const char* v = std::getenv("PK_JAX_AR_PIPELINED_FENCE");
    return v && std::strcmp(v, "data") == 0 ? kFenceData : kFenceSignal;
  }();
  return mode;
}

}  // namespace

const PipelinedKnobs& pipelined_knobs() {
  static const PipelinedKnobs knobs = [] {
    const PipelinedKnobs d;
    PipelinedKnobs k;
    k.rounds = int32_t(env_or("PK_JAX_AR_PIPELINED_ROUNDS", d.rounds, 1, kPipelinedMaxRounds));
    k.min_chunk = env_or("PK_JAX_AR_PIPELINED_MIN_CHUNK", d.min_chunk, 16, kChunkedBytes);
    k.max_ctas = int32_t(env_or("PK_JAX_AR_PIPELINED_MAX_CTAS", d.max_ctas, 1, kChunkedMaxChunks));
    k.lag = int32_t(env_or("PK_JAX_AR_PIPELINED_LAG", d.lag, 0, kPipelinedMaxLag));
    k.shots = int32_t(env_or("PK_JAX_AR_PIPELINED_SHOTS", d.shots, 0, 2));
    return k;
  }();
  return knobs;
}

cudaError_t launch_pipelined(const Group& g, DType dtype, const void* x, void* y, int64_t bytes,
                             const LaunchLimits& lim, cudaStream_t stream) {
  if (bytes <= 0 || bytes > kChunkedBytes || g.size < 2) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y)) & 15) return cudaErrorMisalignedAddress;
  const void* k = pipelined_kernel(dtype);
  if (!k) return cudaErrorInvalidValue;
  PipelinedGeometry geo = pipelined_geometry(bytes, g.size, lim.num_sms, pipelined_knobs());
  const char* s = static_cast<const char*>(x);
  char* d = static_cast<char*>(y);
  int32_t fence = fence_mode();
  void* args[] = {const_cast<Group*>(&g), &geo, &s, &d, &bytes, &fence};
  return cudaLaunchKernel(k, dim3(unsigned(geo.ctas)), dim3(kPipelinedThreads), args, 0, stream);
}

std::vector<const void*> pipelined_kernels() {
  return {pipelined_kernel(DType::kF32), pipelined_kernel(DType::kBF16), pipelined_kernel(DType::kF16)};
}

}  // namespace pk
