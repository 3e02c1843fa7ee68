// The dQ layout conversion after the attention backward kernel (attention_bwd_dq.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention_bwd_dq.cuh"
#include "pk/acc_store.cuh"

namespace pk::attention_bwd {
namespace {

constexpr int kRows = 64;     // the backward kernel's query block (pk_jax/attention.py DQ_ROWS)
constexpr int kBox = 64 * 64; // floats per 64 x 64 chunk
constexpr int kThreads = 256;

// Offset inside a 64-row block of the float pair at (row, col), col even: chunk col / 64 holds float
// ((c * 128 + t) * 4 + j) = accumulator register 4c + j of consumer thread t = 32 wp + 4 lq + lr, i.e.
// row 16 wp + 8 (j / 2) + lq, column 8 c + 2 lr + j % 2 (the layout pk_jax/attention.py dq_from_chunks reads).
__device__ __forceinline__ int chunk_offset(int row, int col) {
  const int box = col >> 6, cb = col & 63;
  const int c = cb >> 3, lr = (cb & 7) >> 1;
  const int wp = row >> 4, jh = (row >> 3) & 1, lq = row & 7;
  return box * kBox + ((c * 128 + 32 * wp + 4 * lq + lr) * 4 + jh * 2);
}

template <typename Out>
__device__ __forceinline__ void store_pair(Out* p, float a, float b) {
  if constexpr (std::is_same_v<Out, float>) *reinterpret_cast<float2*>(p) = make_float2(a, b);
  else *reinterpret_cast<uint32_t*>(p) = pack2<Out>(a, b);
}

template <typename Out, int D>
__global__ void __launch_bounds__(kThreads) dq_convert_kernel(const float* __restrict__ acc, Out* __restrict__ dq,
                                                              int heads, int tq, int tq_pad, int dq_seq, float scale,
                                                              bool add) {
  __shared__ float4 block[kRows * D / 4];
  const int blocks = tq_pad / kRows;
  const int blk = blockIdx.x % blocks, bn = blockIdx.x / blocks;
  const int n = bn % heads, b = bn / heads;
  const float4* src = reinterpret_cast<const float4*>(acc + size_t(blockIdx.x) * kRows * D);
  for (int i = threadIdx.x; i < kRows * D / 4; i += kThreads) block[i] = src[i];
  __syncthreads();
  const float* s = reinterpret_cast<const float*>(block);
  constexpr int kPairs = D / 2;
  for (int i = threadIdx.x; i < kRows * kPairs; i += kThreads) {
    const int r = i / kPairs, col = 2 * (i % kPairs);
    const int row = blk * kRows + r;
    if (row >= tq) break;  // rows only grow with i
    const float2 v = *reinterpret_cast<const float2*>(s + chunk_offset(r, col));
    Out* at = dq + ((size_t(b) * dq_seq + row) * heads + n) * D + col;
    if constexpr (std::is_same_v<Out, float>) {
      if (add) {
        const float2 old = *reinterpret_cast<const float2*>(at);
        store_pair(at, old.x + v.x * scale, old.y + v.y * scale);
        continue;
      }
    }
    store_pair(at, v.x * scale, v.y * scale);
  }
}

template <typename Out, int D>
cudaError_t launch_typed(const DqConvert& c, cudaStream_t stream) {
  const unsigned grid = unsigned(size_t(c.batch) * c.heads * (c.tq_pad / kRows));
  dq_convert_kernel<Out, D><<<grid, kThreads, 0, stream>>>(c.acc, static_cast<Out*>(c.dq), c.heads, c.tq, c.tq_pad,
                                                           c.dq_seq > 0 ? c.dq_seq : c.tq, c.scale, c.add);
  return cudaGetLastError();
}

template <typename Out>
cudaError_t launch_out(const DqConvert& c, cudaStream_t stream) {
  return c.head_dim == 64 ? launch_typed<Out, 64>(c, stream) : launch_typed<Out, 128>(c, stream);
}

// dk, dv = dkv_acc's two halves cast to Out, four elements per thread and step (count is a multiple of 64: D | it).
template <typename Out>
__global__ void __launch_bounds__(kThreads) dkv_convert_kernel(const float4* __restrict__ acc, Out* __restrict__ dk,
                                                               Out* __restrict__ dv, size_t quads) {
  for (size_t i = blockIdx.x * size_t(kThreads) + threadIdx.x; i < 2 * quads; i += size_t(gridDim.x) * kThreads) {
    const float4 v = acc[i];
    Out* out = i < quads ? dk + 4 * i : dv + 4 * (i - quads);
    *reinterpret_cast<uint2*>(out) = make_uint2(pack2<Out>(v.x, v.y), pack2<Out>(v.z, v.w));
  }
}

template <typename Out>
cudaError_t load_out() {
  cudaFuncAttributes a;
  cudaError_t e = cudaFuncGetAttributes(&a, dq_convert_kernel<Out, 64>);
  if (e == cudaSuccess && !std::is_same_v<Out, float>) e = cudaFuncGetAttributes(&a, dkv_convert_kernel<Out>);
  return e == cudaSuccess ? cudaFuncGetAttributes(&a, dq_convert_kernel<Out, 128>) : e;
}

}  // namespace

cudaError_t launch_dq_convert(const DqConvert& c, cudaStream_t stream) {
  if (c.acc == nullptr || c.dq == nullptr || (c.head_dim != 64 && c.head_dim != 128) || c.tq_pad % kRows ||
      c.tq > c.tq_pad || c.batch <= 0 || c.heads <= 0 || c.tq <= 0)
    return cudaErrorInvalidValue;
  if (size_t(c.batch) * c.heads * (c.tq_pad / kRows) >= (1ull << 31)) return cudaErrorInvalidConfiguration;
  if ((c.add && c.out_type != ElemType::kF32) || (c.dq_seq != 0 && c.dq_seq < c.tq)) return cudaErrorInvalidValue;
  switch (c.out_type) {
    case ElemType::kBF16: return launch_out<__nv_bfloat16>(c, stream);
    case ElemType::kF16: return launch_out<__half>(c, stream);
    default: return launch_out<float>(c, stream);
  }
}

cudaError_t launch_dkv_convert(const float* dkv_acc, void* dk, void* dv, size_t count, ElemType type,
                               cudaStream_t stream) {
  if (dkv_acc == nullptr || dk == nullptr || dv == nullptr || count % 4 || type == ElemType::kF32)
    return cudaErrorInvalidValue;
  const size_t quads = count / 4;
  const unsigned grid = unsigned(std::min<size_t>((2 * quads + kThreads - 1) / kThreads, 132 * 16));
  const float4* acc = reinterpret_cast<const float4*>(dkv_acc);
  if (type == ElemType::kBF16)
    dkv_convert_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(acc, static_cast<__nv_bfloat16*>(dk),
                                                                     static_cast<__nv_bfloat16*>(dv), quads);
  else
    dkv_convert_kernel<__half><<<grid, kThreads, 0, stream>>>(acc, static_cast<__half*>(dk), static_cast<__half*>(dv), quads);
  return cudaGetLastError();
}

cudaError_t configure_dq_convert() {
  cudaError_t e = load_out<__nv_bfloat16>();
  if (e == cudaSuccess) e = load_out<__half>();
  return e == cudaSuccess ? load_out<float>() : e;
}

}  // namespace pk::attention_bwd
