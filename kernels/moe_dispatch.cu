// Fused MoE dispatch and combine (issue 27). Rows move straight between the members' XLA buffers:
// dispatch pushes each token row from x into its expert's member's receive buffer (remote vector
// stores), combine pulls each expert output row back to its token's member and sums the top-k
// contributions there. The routing counts ride the OpProtocol publication: before its ready signal
// (release) a member writes its rows per global expert into every peer's control block
// (moe_counts[my slot]), so after acquiring ready every member knows the whole count matrix and
// computes every offset locally (prefix over sources in rank order: the layout is deterministic and
// identical to the reference path's). One handshake (publish/acquire), the rows, one done signal per
// pair after its rows landed (OpProtocol::finish). No host state per call: command-buffer safe.
// Docs: docs/design-moe.md.
#include "moe_dispatch.cuh"
#include "pk/op_protocol.cuh"
#include "moe_layout.cuh"
#include "moe_rows.cuh"
#include "pk/vec.cuh"

namespace pk {
namespace {

__device__ __forceinline__ int64_t segments(const MoeDims& d) { return moe_segments(d.row_vecs); }

__device__ __forceinline__ int32_t load_volatile(const int32_t* p) {
  return *reinterpret_cast<const volatile int32_t*>(p);
}

// Deduplicated rows (DEDUP): warp item = (token, row segment). The segment is loaded once and stored
// to the own member at every kept choice (local stores) and to each peer once, at the row of the token's
// first kept choice there (its primary; MoeRoute::primary). Each kept choice's src_of entry tells the
// destination where its data is; moe_fill_kernel copies the peers' non-primary rows after finish.
// One warp in kZeroEvery zeroes the unused tail meanwhile (local HBM, overlapping the NVLink stores), unless
// d.zero_tail is 0 (moe_mlp: nothing reads those rows; at G 4 they are ~3/4 of the buffer).
constexpr int kZeroEvery = 4;

template <int VEC>
__device__ __forceinline__ void dedup_rows(const MoeRoute& route, const MoeDims& d, const char* x,
                                           const pgl<char>& recv, int64_t arrived, char* own_recv) {
  const Warps w;
  const int64_t segs = segments(d), items = d.tokens * segs;
  const int64_t zero_from = (arrived < d.recv_rows ? arrived : d.recv_rows) * d.row_vecs;
  const bool split = d.zero_tail && w.nwarps >= kZeroEvery;  // some warps zero the tail, the rest move rows
  const bool zeroes = split && w.warp % kZeroEvery == kZeroEvery - 1;
  if (zeroes) {
    const int64_t zw = w.nwarps / kZeroEvery, me = w.warp / kZeroEvery;
    if (me < zw) zero_vecs<VEC>(own_recv, zero_from, d.recv_rows * d.row_vecs, me * 32 + w.lane, zw * 32);
    return;
  }
  const int64_t rw = split ? w.nwarps - w.nwarps / kZeroEvery : w.nwarps;
  const int64_t first = split ? w.warp - w.warp / kZeroEvery : w.warp;  // index among row warps
  for (int64_t it = first; it < items; it += rw) {
    const int64_t t = it / segs, seg = it % segs;
    const int64_t left = d.row_vecs - seg * kSegVecs;
    vec_t<VEC> v[kMoeUnroll];
    load_segment<VEC>(x, t * d.row_vecs + seg * kSegVecs, left, w.lane, v);
    uint32_t sent = 0;  // peers that already got this token (its primary there)
    for (int k = 0; k < d.top_k; ++k) {
      const int64_t a = t * d.top_k + k, row = route.row(a);
      if (row < 0) continue;
      const int m = route.dest(a);
      if (m != route.rank) {
        if (sent & (1u << m)) continue;
        sent |= 1u << m;
      }
      store_segment<VEC>(recv[m], row * d.row_vecs + seg * kSegVecs, left, w.lane, v);
    }
  }
  if (d.zero_tail && !split) zero_rows<VEC>(own_recv, zero_from / d.row_vecs, d.recv_rows, d.row_vecs);
}

// Forward dispatch with the count exchange (see moe_dispatch.cuh).
template <int VEC, bool DEDUP>
__global__ void __launch_bounds__(kMoeThreads)
    moe_dispatch_kernel(Group g, MoeDims d, const char* x, const int32_t* key, const int32_t* pos, char* recv,
                        int32_t* src_of, int32_t* recv_counts, int32_t* send_row) {
  __shared__ int32_t own[kMoeMaxExperts];   // this member's kept rows per global expert
  __shared__ int32_t base[kMoeMaxExperts];  // e = dest * L + l: row in dest of this member's first row of e
  __shared__ int32_t total[kMoeMaxExperts]; // rows of e from all sources
  __shared__ int64_t arrived;               // rows sent here by all sources (before the R bound)
  OpProtocol op(g);
  const int64_t n = d.tokens * d.top_k;
  const int E = d.experts, L = d.experts / g.size;
  // (1) Counts. Every CTA histograms the keys itself (T * K ints, from L2 after the first CTA): no
  // grid-wide dependency before the publication.
  for (int e = threadIdx.x; e < E; e += blockDim.x) own[e] = 0;
  __syncthreads();
  constexpr int kKeysInFlight = 8;  // loads issued before the shared-memory atomics that consume them
  for (int64_t a0 = threadIdx.x; a0 < n; a0 += kKeysInFlight * blockDim.x) {
    int32_t k[kKeysInFlight];
#pragma unroll
    for (int u = 0; u < kKeysInFlight; ++u) {
      const int64_t a = a0 + int64_t(u) * blockDim.x;
      k[u] = a < n ? key[a] : -1;
    }
#pragma unroll
    for (int u = 0; u < kKeysInFlight; ++u)
      if (k[u] >= 0 && k[u] < E) atomicAdd(&own[k[u]], 1);
  }
  __syncthreads();
  // CTA 0 writes them into every peer's block; the peer reads them after acquiring our ready (the
  // release in publish orders them, with the fence for the other threads' stores).
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < g.size * E; i += blockDim.x) {
      const int r = i / E, e = i % E;
      if (r != g.rank) g.ctrl[r]->moe_counts[g.my_slot()][e] = own[e];
    }
    __threadfence_system();
    __syncthreads();
  }
  void* const local[2] = {recv, src_of};
  op.publish(local, 2);
  pgl<char> bufs[2];
  if (op.acquire(local, bufs)) {
    // (2) Offsets: every source's counts, prefix over sources in rank order, then over local experts.
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      int32_t before = 0, all = 0;
      for (int s = 0; s < g.size; ++s) {
        const int32_t c = s == g.rank ? own[e] : load_volatile(&g.self()->moe_counts[g.slot[s]][e]);
        if (s < g.rank) before += c;
        all += c;
        if (blockIdx.x == 0 && e / L == g.rank) recv_counts[s * L + e % L] = c;
      }
      base[e] = before;
      total[e] = all;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const int first = (e / L) * L;
      int32_t start = 0;
      for (int j = first; j < e; ++j) start += total[j];
      base[e] += start;
    }
    if (threadIdx.x == 0) {
      int64_t sum = 0;
      for (int l = 0; l < L; ++l) sum += total[g.rank * L + l];
      arrived = sum;
    }
    __syncthreads();
    const MoeRoute route{key, pos, base, E, L, d.top_k, g.rank, d.recv_rows};
    if constexpr (DEDUP) {
      dedup_rows<VEC>(route, d, x, bufs[0], arrived, recv);
    } else {
      // (3) Rows: warp item = (assignment, row segment), assignment-major (a token's K rows are read
      // by neighbouring warps: x from L2 after the first).
      const Warps w;
      const int64_t segs = segments(d), items = n * segs;
      for (int64_t it = w.warp; it < items; it += w.nwarps) {
        const int64_t a = it / segs, seg = it % segs;
        const int64_t row = route.row(a);
        if (row < 0) continue;
        copy_segment<VEC>(x, (a / d.top_k) * d.row_vecs + seg * kSegVecs, bufs[0][route.dest(a)],
                          row * d.row_vecs + seg * kSegVecs, d.row_vecs - seg * kSegVecs, w.lane);
      }
    }
    // The layout for combine and the backward passes, and (DEDUP) each kept row's primary at its
    // destination (grid-strided: every CTA has the offsets).
    for (int64_t a = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; a < n; a += int64_t(gridDim.x) * blockDim.x) {
      const int64_t row = route.row(a);
      send_row[a] = row >= 0 ? int32_t(route.dest(a) * d.recv_rows + row) : -1;
      if (DEDUP && row >= 0)
        reinterpret_cast<int32_t*>(bufs[1][route.dest(a)])[row] = int32_t(route.primary(a));
    }
    if (!DEDUP && d.zero_tail) zero_rows<VEC>(recv, arrived < d.recv_rows ? arrived : d.recv_rows, d.recv_rows, d.row_vecs);
  }
  op.finish();
}

// After the dispatch's finish (every peer's rows and src_of entries landed): each received row whose
// data came as another row (a peer's non-primary choice) is copied from it. Local only, no protocol.
// Rows [received, R) stay as the dispatch zeroed them.
template <int VEC>
__global__ void __launch_bounds__(kMoeThreads)
    moe_fill_kernel(MoeDims d, int counts, const int32_t* recv_counts, const int32_t* src_of, char* recv) {
  __shared__ int64_t received;
  if (threadIdx.x < 32) {
    int64_t sum = 0;
    for (int i = threadIdx.x; i < counts; i += 32) sum += recv_counts[i];
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threadIdx.x == 0) received = sum < d.recv_rows ? sum : d.recv_rows;
  }
  __syncthreads();
  const Warps w;
  const int64_t segs = segments(d), items = received * segs;
  for (int64_t it = w.warp; it < items; it += w.nwarps) {
    const int64_t row = it / segs, seg = it % segs;
    const int64_t from = src_of[row];
    if (from == row || from < 0 || from >= received) continue;  // out of range only after a recorded timeout
    copy_segment<VEC>(recv, from * d.row_vecs + seg * kSegVecs, recv, row * d.row_vecs + seg * kSegVecs,
                      d.row_vecs - seg * kSegVecs, w.lane);
  }
}

// Elements of a vector times s, in float32, rounded to T (the reference's astype(f32) * s, astype(T)).
template <typename T, int VEC>
__device__ __forceinline__ vec_t<VEC> scaled(const vec_t<VEC>& v, float s) {
  using Lanes = lanes<T, VEC>;
  float f[Lanes::kCount];
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < Lanes::kCount; ++i) f[i] = to_float(e[i]) * s;
  return Lanes::pack(f);
}

// Dispatch with a known layout, optionally scaled per assignment (see moe_dispatch.cuh).
template <typename T, int VEC, bool SCALED>
__global__ void __launch_bounds__(kMoeThreads)
    moe_send_kernel(Group g, MoeDims d, const char* x, const int32_t* send_row, const float* scale,
                    const int32_t* received, char* recv) {
  OpProtocol op(g);
  void* const local[1] = {recv};
  op.publish(local, 1);
  pgl<char> bufs[1];
  if (op.acquire(local, bufs)) {
    const Warps w;
    const int64_t n = d.tokens * d.top_k, segs = segments(d), items = n * segs;
    for (int64_t it = w.warp; it < items; it += w.nwarps) {
      const int64_t a = it / segs, seg = it % segs;
      const int32_t to = send_row[a];
      if (to < 0) continue;
      const int64_t src = (a / d.top_k) * d.row_vecs + seg * kSegVecs;
      const int64_t dst = (to % d.recv_rows) * d.row_vecs + seg * kSegVecs;
      const int64_t left = d.row_vecs - seg * kSegVecs;
      char* out = bufs[0][int(to / d.recv_rows)];
      if constexpr (SCALED) {
        const float s = scale[a];
        vec_t<VEC> v[kMoeUnroll];
#pragma unroll
        for (int u = 0; u < kMoeUnroll; ++u) {
          const int64_t i = u * 32 + w.lane;
          if (i < left) v[u] = load_vec<VEC>(x, src + i);
        }
#pragma unroll
        for (int u = 0; u < kMoeUnroll; ++u) {
          const int64_t i = u * 32 + w.lane;
          if (i < left) store_vec<VEC>(out, dst + i, scaled<T, VEC>(v[u], s));
        }
      } else {
        copy_segment<VEC>(x, src, out, dst, left, w.lane);
      }
    }
    const int64_t got = *received;
    if (d.zero_tail) zero_rows<VEC>(recv, got < d.recv_rows ? got : d.recv_rows, d.recv_rows, d.row_vecs);
  }
  op.finish();
}

// Combine (see moe_dispatch.cuh). Reduce: warp item = (token, row segment); the K rows are pulled in
// choice order, the next choice's loads in flight while the current one is added.
template <typename T, int VEC, bool GATHER>
__global__ void __launch_bounds__(kMoeThreads)
    moe_combine_kernel(Group g, MoeDims d, const char* y, const int32_t* send_row, const float* weights, char* out) {
  OpProtocol op(g);
  void* const local[1] = {const_cast<char*>(y)};
  op.publish(local, 1);
  pgl<char> bufs[1];
  if (op.acquire(local, bufs)) {
    using Lanes = lanes<T, VEC>;
    const Warps w;
    const int64_t segs = segments(d);
    const int K = d.top_k;
    const int64_t items = (GATHER ? d.tokens * K : d.tokens) * segs;
    for (int64_t it = w.warp; it < items; it += w.nwarps) {
      const int64_t row = it / segs, seg = it % segs;  // output row: assignment (gather) or token
      const int64_t left = d.row_vecs - seg * kSegVecs;
      const int64_t dst = row * d.row_vecs + seg * kSegVecs;
      if constexpr (GATHER) {
        const int32_t from = send_row[row];
        if (from >= 0) {
          copy_segment<VEC>(bufs[0][int(from / d.recv_rows)], (from % d.recv_rows) * d.row_vecs + seg * kSegVecs, out,
                            dst, left, w.lane);
        } else {
          vec_t<VEC> z;
          memset(&z, 0, sizeof(z));
#pragma unroll
          for (int u = 0; u < kMoeUnroll; ++u)
            if (u * 32 + w.lane < left) store_vec<VEC>(out, dst + u * 32 + w.lane, z);
        }
      } else {
        float acc[kMoeUnroll][Lanes::kCount] = {};
        vec_t<VEC> cur[kMoeUnroll], next[kMoeUnroll];  // named buffers: a runtime index would spill them
        const auto fetch = [&](int k, vec_t<VEC>(&into)[kMoeUnroll]) {
          const int32_t from = send_row[row * K + k];
          if (from < 0) return;
          const char* src = bufs[0][int(from / d.recv_rows)];
          const int64_t at = (from % d.recv_rows) * d.row_vecs + seg * kSegVecs;
#pragma unroll
          for (int u = 0; u < kMoeUnroll; ++u)
            if (u * 32 + w.lane < left) into[u] = load_vec<VEC>(src, at + u * 32 + w.lane);
        };
        fetch(0, cur);
        for (int k = 0; k < K; ++k) {
          if (k + 1 < K) fetch(k + 1, next);
          if (send_row[row * K + k] >= 0) {  // a dropped choice adds zero
            const float s = weights[row * K + k];
#pragma unroll
            for (int u = 0; u < kMoeUnroll; ++u) {
              if (u * 32 + w.lane >= left) continue;
              const T* e = reinterpret_cast<const T*>(&cur[u]);
#pragma unroll
              for (int i = 0; i < Lanes::kCount; ++i) acc[u][i] += s * to_float(e[i]);
            }
          }
#pragma unroll
          for (int u = 0; u < kMoeUnroll; ++u) cur[u] = next[u];
        }
#pragma unroll
        for (int u = 0; u < kMoeUnroll; ++u)
          if (u * 32 + w.lane < left) store_vec<VEC>(out, dst + u * 32 + w.lane, Lanes::pack(acc[u]));
      }
    }
  }
  op.finish();
}

template <int VEC>
const void* dispatch_kernel_for(bool dedup) {
  return dedup ? reinterpret_cast<const void*>(&moe_dispatch_kernel<VEC, true>)
               : reinterpret_cast<const void*>(&moe_dispatch_kernel<VEC, false>);
}

const void* dispatch_kernel(int vec_bytes, bool dedup) {
  switch (vec_bytes) {
    case 16: return dispatch_kernel_for<16>(dedup);
    case 4: return dispatch_kernel_for<4>(dedup);
    case 2: return dispatch_kernel_for<2>(dedup);
  }
  return nullptr;
}

const void* fill_kernel(int vec_bytes) {
  switch (vec_bytes) {
    case 16: return reinterpret_cast<const void*>(&moe_fill_kernel<16>);
    case 4: return reinterpret_cast<const void*>(&moe_fill_kernel<4>);
    case 2: return reinterpret_cast<const void*>(&moe_fill_kernel<2>);
  }
  return nullptr;
}

// Typed kernels: vectors of 16 bytes, or of one element (rows whose bytes are not a multiple of 16).
template <typename T, int VEC, bool FLAG>
const void* send_ptr() {
  return reinterpret_cast<const void*>(&moe_send_kernel<T, VEC, FLAG>);
}
template <typename T, int VEC, bool FLAG>
const void* combine_ptr() {
  return reinterpret_cast<const void*>(&moe_combine_kernel<T, VEC, FLAG>);
}

template <typename T>
const void* typed_kernel(bool combine, int vec_bytes, bool flag) {
  constexpr int kOne = int(sizeof(T));
  if (vec_bytes == 16) {
    if (combine) return flag ? combine_ptr<T, 16, true>() : combine_ptr<T, 16, false>();
    return flag ? send_ptr<T, 16, true>() : send_ptr<T, 16, false>();
  }
  if (vec_bytes == kOne) {
    if (combine) return flag ? combine_ptr<T, kOne, true>() : combine_ptr<T, kOne, false>();
    return flag ? send_ptr<T, kOne, true>() : send_ptr<T, kOne, false>();
  }
  return nullptr;
}

const void* typed_kernel(DType dtype, bool combine, int vec_bytes, bool flag) {
  switch (dtype) {
    case DType::kF32: return typed_kernel<float>(combine, vec_bytes, flag);
    case DType::kBF16: return typed_kernel<__nv_bfloat16>(combine, vec_bytes, flag);
    case DType::kF16: return typed_kernel<__half>(combine, vec_bytes, flag);
  }
  return nullptr;
}

bool dims_ok(const MoeDims& d, int vec_bytes) {
  return d.tokens >= 0 && d.top_k >= 1 && d.recv_rows >= 1 && d.row_vecs >= 1 && vec_bytes > 0 &&
         d.recv_rows * kMaxGroup < (int64_t(1) << 31);  // send_row holds dest * R + row in int32
}

int64_t warp_items(int64_t rows, const MoeDims& d) { return moe_warp_items(rows, d.row_vecs); }

}  // namespace

cudaError_t launch_moe_dispatch(const Group& g, const MoeDims& d, int vec_bytes, bool dedup, const void* x,
                                const int32_t* key, const int32_t* pos, void* recv, int32_t* src_of,
                                int32_t* recv_counts, int32_t* send_row, const LaunchLimits& lim,
                                cudaStream_t stream) {
  const void* k = dispatch_kernel(vec_bytes, dedup);
  const void* fill = fill_kernel(vec_bytes);
  if (!k || !fill || !dims_ok(d, vec_bytes) || d.experts < g.size || d.experts > kMoeMaxExperts ||
      d.experts % g.size != 0)
    return cudaErrorInvalidValue;
  // Enough CTAs for the rows and for zeroing the whole buffer when little arrives.
  const int64_t items = warp_items(d.tokens * d.top_k, d);
  const int64_t zero = (d.recv_rows * d.row_vecs + 31) / 32;
  const int grid = resident_grid(k, items > zero ? items : zero, kMoeThreads, lim);
  MoeDims dims = d;
  const char* xs = static_cast<const char*>(x);
  char* out = static_cast<char*>(recv);
  void* args[] = {const_cast<Group*>(&g), &dims, &xs, &key, &pos, &out, &src_of, &recv_counts, &send_row};
  cudaError_t e = cudaLaunchKernel(k, grid, kMoeThreads, args, 0, stream);
  if (e != cudaSuccess || !dedup) return e;
  // Stream order: the fill starts after every CTA of the dispatch returned, i.e. after its last CTA saw
  // every peer's done (all rows and src_of entries here).
  int counts = g.size * (d.experts / g.size);
  const int32_t* rc = recv_counts;
  const int32_t* so = src_of;
  void* fill_args[] = {&dims, &counts, &rc, &so, &out};
  const int fill_grid = resident_grid(fill, warp_items(d.recv_rows, d), kMoeThreads, lim);
  return cudaLaunchKernel(fill, fill_grid, kMoeThreads, fill_args, 0, stream);
}

cudaError_t launch_moe_send(const Group& g, const MoeDims& d, int vec_bytes, DType dtype, bool scaled, const void* x,
                            const int32_t* send_row, const float* scale, const int32_t* received, void* recv,
                            const LaunchLimits& lim, cudaStream_t stream) {
  const void* k = typed_kernel(dtype, false, vec_bytes, scaled);
  if (!k || !dims_ok(d, vec_bytes)) return cudaErrorInvalidValue;
  const int64_t items = warp_items(d.tokens * d.top_k, d);
  const int64_t zero = (d.recv_rows * d.row_vecs + 31) / 32;
  const int grid = resident_grid(k, items > zero ? items : zero, kMoeThreads, lim);
  MoeDims dims = d;
  const char* xs = static_cast<const char*>(x);
  char* out = static_cast<char*>(recv);
  void* args[] = {const_cast<Group*>(&g), &dims, &xs, &send_row, &scale, &received, &out};
  return cudaLaunchKernel(k, grid, kMoeThreads, args, 0, stream);
}

cudaError_t launch_moe_combine(const Group& g, const MoeDims& d, int vec_bytes, DType dtype, bool gather, const void* y,
                               const int32_t* send_row, const float* weights, void* out, const LaunchLimits& lim,
                               cudaStream_t stream) {
  const void* k = typed_kernel(dtype, true, vec_bytes, gather);
  if (!k || !dims_ok(d, vec_bytes)) return cudaErrorInvalidValue;
  const int grid = resident_grid(k, warp_items(gather ? d.tokens * d.top_k : d.tokens, d), kMoeThreads, lim);
  MoeDims dims = d;
  const char* ys = static_cast<const char*>(y);
  char* o = static_cast<char*>(out);
  void* args[] = {const_cast<Group*>(&g), &dims, &ys, &send_row, &weights, &o};
  return cudaLaunchKernel(k, grid, kMoeThreads, args, 0, stream);
}

std::vector<const void*> moe_kernels() {
  std::vector<const void*> out;
  for (int v : {16, 4, 2})
    for (const void* k : {dispatch_kernel(v, true), dispatch_kernel(v, false), fill_kernel(v)}) out.push_back(k);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const int one = t == DType::kF32 ? 4 : 2;
    for (int v : {16, one})
      for (bool combine : {false, true})
        for (bool flag : {false, true}) out.push_back(typed_kernel(t, combine, v, flag));
  }
  for (const void* k : moe_partial_kernels()) out.push_back(k);
  return out;
}

}  // namespace pk
