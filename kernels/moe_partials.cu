// Combine by pushed partials (docs/design-moe.md, "Combine by partials"): each expert-side member sums, per
// (home member, token) with kept choices here, w * y over those choices in choice order (float32) and pushes
// the partial into the home's float32 scratch (slot moe_partial_slot(me, home)); after finish the home adds,
// in rank order, the peers' partials and its own (computed locally from its y) and rounds once.
// Deterministic: fixed orders, one rounding. NVLink carries one float32 row per (home, token, member)
// instead of one row per remote choice: fewer bytes when 2 * G * P(a token has a choice on a member) < K
// (fused.py picks it; G = 2, K = 8: half the bytes).
#include "moe_dispatch.cuh"
#include "moe_layout.cuh"
#include "moe_rows.cuh"
#include "pk/op_protocol.cuh"
#include "pk/vec.cuh"

namespace pk {
namespace {

template <int N>
__device__ __forceinline__ void store_floats(float* dst, const float (&a)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) *reinterpret_cast<float4*>(dst + i) = make_float4(a[i], a[i + 1], a[i + 2], a[i + 3]);
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 2) *reinterpret_cast<float2*>(dst + i) = make_float2(a[i], a[i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = a[i];
  }
}

template <int N>
__device__ __forceinline__ void add_floats(float (&acc)[N], const float* src) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 v = __ldcs(reinterpret_cast<const float4*>(src + i));
      acc[i] += v.x, acc[i + 1] += v.y, acc[i + 2] += v.z, acc[i + 3] += v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] += src[i];
  }
}

// Returns whether t has a kept choice on `on`; acc += sum over token t's kept choices on member `on`, in choice order, of w * y[row] (segment seg of the
// row; send_row / weights of t's home, maybe remote). A warp; every lane reads one choice's entries.
template <typename T, int VEC>
__device__ __forceinline__ bool choices_here(const MoeDims& d, const char* y, const int32_t* send_row,
                                             const float* weights, int64_t t, int on, int64_t seg, int lane,
                                             float (&acc)[kMoeUnroll][lanes<T, VEC>::kCount]) {
  const int64_t left = d.row_vecs - seg * kSegVecs;
  bool any = false;
  for (int k0 = 0; k0 < d.top_k; k0 += 32) {
    const int k = k0 + lane;
    const int32_t to = k < d.top_k ? send_row[t * d.top_k + k] : -1;
    const float w = k < d.top_k ? weights[t * d.top_k + k] : 0.f;
    uint32_t mine = __ballot_sync(0xffffffffu, to >= 0 && to / d.recv_rows == on);
    any |= mine != 0;
    while (mine) {
      const int src = __ffs(mine) - 1;
      mine &= mine - 1;
      const int64_t row = __shfl_sync(0xffffffffu, to, src) % d.recv_rows;
      const float s = __shfl_sync(0xffffffffu, w, src);
      vec_t<VEC> v[kMoeUnroll];
      load_segment<VEC>(y, row * d.row_vecs + seg * kSegVecs, left, lane, v);
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        if (u * 32 + lane >= left) continue;
        const T* e = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
        for (int i = 0; i < lanes<T, VEC>::kCount; ++i) acc[u][i] += s * to_float(e[i]);
      }
    }
  }
  return any;
}

// Whether token t has a kept choice on member `on` (a warp-uniform answer).
__device__ __forceinline__ bool has_choice(const MoeDims& d, const int32_t* send_row, int64_t t, int on, int lane) {
  bool any = false;
  for (int k0 = 0; k0 < d.top_k; k0 += 32) {
    const int k = k0 + lane;
    const int32_t to = k < d.top_k ? send_row[t * d.top_k + k] : -1;
    any |= __any_sync(0xffffffffu, to >= 0 && to / d.recv_rows == on);
  }
  return any;
}

// Expert side: item (peer home h, token t, segment); the partial of t's choices here into h's scratch.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMoeThreads)
    moe_push_partials_kernel(Group g, MoeDims d, const char* y, const int32_t* send_row, const float* weights,
                             float* partial) {
  using Lanes = lanes<T, VEC>;
  OpProtocol op(g);
  void* const local[3] = {const_cast<int32_t*>(send_row), const_cast<float*>(weights), partial};
  op.publish(local, 3);
  pgl<char> bufs[3];
  if (op.acquire(local, bufs)) {
    const Warps w;
    const int64_t segs = moe_segments(d.row_vecs), per_home = d.tokens * segs;
    const int64_t items = (g.size - 1) * per_home, width = d.row_vecs * Lanes::kCount;  // floats per row
    for (int64_t it = w.warp; it < items; it += w.nwarps) {
      const int peer = int(it / per_home);
      const int home = peer < g.rank ? peer : peer + 1;  // the peers in rank order, skipping this member
      const int64_t t = (it % per_home) / segs, seg = it % segs;
      float acc[kMoeUnroll][Lanes::kCount] = {};
      if (!choices_here<T, VEC>(d, y, reinterpret_cast<const int32_t*>(bufs[0][home]),
                                reinterpret_cast<const float*>(bufs[1][home]), t, g.rank, seg, w.lane, acc))
        continue;  // no choice of t here: its home reads nothing from this slot
      float* out = reinterpret_cast<float*>(bufs[2][home]) +
                   (int64_t(moe_partial_slot(g.rank, home)) * d.tokens + t) * width;
#pragma unroll
      for (int u = 0; u < kMoeUnroll; ++u) {
        const int64_t v = seg * kSegVecs + u * 32 + w.lane;
        if (v < d.row_vecs) store_floats(out + v * Lanes::kCount, acc[u]);
      }
    }
  }
  op.finish();
}

// Home side, after the push's finish (every peer's partials landed): out[t] = sum over members m in rank
// order of partial_m[t] (its own computed here from the local y; members without a choice of t add
// nothing), rounded once. Local only.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMoeThreads)
    moe_sum_partials_kernel(MoeDims d, int rank, int members, const char* y, const int32_t* send_row,
                            const float* weights, const float* partial, char* out) {
  using Lanes = lanes<T, VEC>;
  const Warps w;
  const int64_t segs = moe_segments(d.row_vecs), items = d.tokens * segs, width = d.row_vecs * Lanes::kCount;
  for (int64_t it = w.warp; it < items; it += w.nwarps) {
    const int64_t t = it / segs, seg = it % segs;
    float acc[kMoeUnroll][Lanes::kCount] = {};
    for (int m = 0; m < members; ++m) {
      if (m == rank) {
        float own[kMoeUnroll][Lanes::kCount] = {};
        choices_here<T, VEC>(d, y, send_row, weights, t, rank, seg, w.lane, own);
#pragma unroll
        for (int u = 0; u < kMoeUnroll; ++u)
#pragma unroll
          for (int i = 0; i < Lanes::kCount; ++i) acc[u][i] += own[u][i];
      } else if (has_choice(d, send_row, t, m, w.lane)) {
        const float* p = partial + (int64_t(moe_partial_slot(m, rank)) * d.tokens + t) * width;
#pragma unroll
        for (int u = 0; u < kMoeUnroll; ++u) {
          const int64_t v = seg * kSegVecs + u * 32 + w.lane;
          if (v < d.row_vecs) add_floats(acc[u], p + v * Lanes::kCount);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kMoeUnroll; ++u) {
      const int64_t v = seg * kSegVecs + u * 32 + w.lane;
      if (v < d.row_vecs) store_vec<VEC>(out, t * d.row_vecs + v, Lanes::pack(acc[u]));
    }
  }
}

template <typename T, int VEC>
void partial_kernels(const void* (&k)[2]) {
  k[0] = reinterpret_cast<const void*>(&moe_push_partials_kernel<T, VEC>);
  k[1] = reinterpret_cast<const void*>(&moe_sum_partials_kernel<T, VEC>);
}

// {push, sum} for a dtype and vector width: 16 bytes or one element.
bool partial_kernels(DType dtype, int vec_bytes, const void* (&k)[2]) {
  k[0] = k[1] = nullptr;
  switch (dtype) {
    case DType::kF32:
      if (vec_bytes == 16) partial_kernels<float, 16>(k);
      if (vec_bytes == 4) partial_kernels<float, 4>(k);
      break;
    case DType::kBF16:
      if (vec_bytes == 16) partial_kernels<__nv_bfloat16, 16>(k);
      if (vec_bytes == 2) partial_kernels<__nv_bfloat16, 2>(k);
      break;
    case DType::kF16:
      if (vec_bytes == 16) partial_kernels<__half, 16>(k);
      if (vec_bytes == 2) partial_kernels<__half, 2>(k);
      break;
  }
  return k[0] != nullptr;
}

}  // namespace

cudaError_t launch_moe_combine_partials(const Group& g, const MoeDims& d, int vec_bytes, DType dtype, const void* y,
                                        const int32_t* send_row, const float* weights, float* partial, void* out,
                                        const LaunchLimits& lim, cudaStream_t stream) {
  const void* k[2];
  if (!partial_kernels(dtype, vec_bytes, k) || d.tokens < 0 || d.top_k < 1 || d.recv_rows < 1 || d.row_vecs < 1 ||
      g.size < 2)
    return cudaErrorInvalidValue;
  MoeDims dims = d;
  const char* ys = static_cast<const char*>(y);
  void* push_args[] = {const_cast<Group*>(&g), &dims, &ys, &send_row, &weights, &partial};
  const int push_grid = resident_grid(k[0], moe_warp_items((g.size - 1) * d.tokens, d.row_vecs), kMoeThreads, lim);
  cudaError_t e = cudaLaunchKernel(k[0], push_grid, kMoeThreads, push_args, 0, stream);
  if (e != cudaSuccess) return e;
  // Stream order: the sum starts after the push's last CTA saw every peer's done (all partials here).
  int rank = g.rank, members = g.size;
  const float* ps = partial;
  char* o = static_cast<char*>(out);
  void* sum_args[] = {&dims, &rank, &members, &ys, &send_row, &weights, &ps, &o};
  const int sum_grid = resident_grid(k[1], moe_warp_items(d.tokens, d.row_vecs), kMoeThreads, lim);
  return cudaLaunchKernel(k[1], sum_grid, kMoeThreads, sum_args, 0, stream);
}

std::vector<const void*> moe_partial_kernels() {
  std::vector<const void*> out;
  const void* k[2];
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16})
    for (int v : {16, t == DType::kF32 ? 4 : 2})
      if (partial_kernels(t, v, k)) out.insert(out.end(), {k[0], k[1]});
  return out;
}

}  // namespace pk
