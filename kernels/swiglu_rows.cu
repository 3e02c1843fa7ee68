// SwiGLU forward and backward over the rows in use (swiglu_rows.cuh): 16-byte vectors, a grid-stride loop
// bounded by the row count each block reads from group_sizes itself (no host step, command-buffer safe).
#include "swiglu_rows.cuh"

#include "pk/vec.cuh"

namespace pk::swiglu {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = 1024;  // grid-stride: enough to fill the GPU, few enough to read group_sizes cheaply
constexpr int kVec = 8;        // 16-bit elements per 16-byte vector

// Elements in use: min(sum(group_sizes), rows) * cols, summed by the block's first warp.
__device__ int64_t elements_in_use(const int32_t* group_sizes, int groups, int64_t rows, int64_t cols) {
  __shared__ int64_t total;
  if (threadIdx.x < 32) {
    int64_t s = 0;
    for (int e = threadIdx.x; e < groups; e += 32) s += group_sizes[e];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x == 0) total = (s < rows ? s : rows) * cols;
  }
  __syncthreads();
  return total;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

template <typename T>
union Pack {
  uint4 v;
  T e[kVec];
};

template <typename T>
__global__ void __launch_bounds__(kThreads) forward_kernel(const uint4* gate, const uint4* up, uint4* hidden,
                                                           const int32_t* group_sizes, int groups, int64_t rows,
                                                           int64_t cols) {
  const int64_t vecs = elements_in_use(group_sizes, groups, rows, cols) / kVec;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * kThreads) {
    Pack<T> g, u, h;
    g.v = __ldcs(gate + i), u.v = __ldcs(up + i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = to_float(g.e[j]);
      h.e[j] = from_float<T>(x * sigmoid(x) * to_float(u.e[j]));
    }
    hidden[i] = h.v;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) backward_kernel(const uint4* gate, const uint4* up, const uint4* d_hidden,
                                                            uint4* d_gate, uint4* d_up, const int32_t* group_sizes,
                                                            int groups, int64_t rows, int64_t cols) {
  const int64_t vecs = elements_in_use(group_sizes, groups, rows, cols) / kVec;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * kThreads) {
    Pack<T> g, u, dh, dg, du;
    g.v = __ldcs(gate + i), u.v = __ldcs(up + i), dh.v = __ldcs(d_hidden + i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float x = to_float(g.e[j]), s = sigmoid(x), d = to_float(dh.e[j]);
      dg.e[j] = from_float<T>(d * to_float(u.e[j]) * s * (1.f + x * (1.f - s)));  // silu'(x) = s (1 + x (1 - s))
      du.e[j] = from_float<T>(d * x * s);
    }
    d_gate[i] = dg.v, d_up[i] = du.v;
  }
}

unsigned grid_for(const Rows& r) {
  const int64_t vecs = r.rows * r.cols / kVec, need = (vecs + kThreads - 1) / kThreads;
  return unsigned(need < kBlocks ? (need > 0 ? need : 1) : kBlocks);
}

template <typename T>
cudaError_t forward_typed(const Rows& r, cudaStream_t stream) {
  forward_kernel<T><<<grid_for(r), kThreads, 0, stream>>>(
      static_cast<const uint4*>(r.gate), static_cast<const uint4*>(r.up), static_cast<uint4*>(r.hidden),
      r.group_sizes, r.groups, r.rows, r.cols);
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const Rows& r, cudaStream_t stream) {
  backward_kernel<T><<<grid_for(r), kThreads, 0, stream>>>(
      static_cast<const uint4*>(r.gate), static_cast<const uint4*>(r.up), static_cast<const uint4*>(r.d_hidden),
      static_cast<uint4*>(r.d_gate), static_cast<uint4*>(r.d_up), r.group_sizes, r.groups, r.rows, r.cols);
  return cudaGetLastError();
}

template <typename T>
cudaError_t load_typed() {
  cudaFuncAttributes a;
  const cudaError_t e = cudaFuncGetAttributes(&a, forward_kernel<T>);
  return e == cudaSuccess ? cudaFuncGetAttributes(&a, backward_kernel<T>) : e;
}

bool aligned(const void* p) { return p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

const char* unsupported(const Rows& r, bool backward) {
  if (r.type != ElemType::kBF16 && r.type != ElemType::kF16) return "operands must be bfloat16 or float16";
  if (r.cols % kVec) return "the row length must be a multiple of 8 (16-byte vectors)";
  if (r.rows < 0 || r.cols < 0 || r.groups < 1) return "negative sizes or no groups";
  if (!aligned(r.gate) || !aligned(r.up) || !r.group_sizes) return "missing or unaligned operands";
  if (backward ? !aligned(r.d_hidden) || !aligned(r.d_gate) || !aligned(r.d_up) : !aligned(r.hidden))
    return "missing or unaligned operands";
  return "";
}

cudaError_t launch_forward(const Rows& r, cudaStream_t stream) {
  if (*unsupported(r, false)) return cudaErrorInvalidValue;
  if (r.rows * r.cols == 0) return cudaSuccess;
  return r.type == ElemType::kBF16 ? forward_typed<__nv_bfloat16>(r, stream) : forward_typed<__half>(r, stream);
}

cudaError_t launch_backward(const Rows& r, cudaStream_t stream) {
  if (*unsupported(r, true)) return cudaErrorInvalidValue;
  if (r.rows * r.cols == 0) return cudaSuccess;
  return r.type == ElemType::kBF16 ? backward_typed<__nv_bfloat16>(r, stream) : backward_typed<__half>(r, stream);
}

cudaError_t configure() {
  const cudaError_t e = load_typed<__nv_bfloat16>();
  return e == cudaSuccess ? load_typed<__half>() : e;
}

}  // namespace pk::swiglu
