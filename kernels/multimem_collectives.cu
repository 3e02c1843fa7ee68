// Multimem all-reduce and barrier kernels (see multimem_collectives.cuh). Compile-checked only.
#include "multimem_collectives.cuh"

#include <atomic>

#include "../ffi/multicast_policy.h"
#include "pk/multimem.cuh"

namespace pk::multimem {
namespace {

enum Kind : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ void record_timeout(const MulticastPgl& p) {
  if (p.err != nullptr && atomicCAS(&p.err->code, 0, int32_t(kTimeoutDone)) == 0) {
    p.err->op = p.op;
    p.err->device_slot = p.rank;
    p.err->peer_slot = -1;  // the counter sums every member's arrival: the missing one is not known
    __threadfence_system();
  }
}

// Barrier of CTA blockIdx.x with the same CTA of every member. The CTA's earlier writes (multimem.st
// included) are released with the arrive; later accesses see every member's. False after a timeout.
__device__ bool block_barrier(const MulticastPgl& p) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    const int b = blockIdx.x;
    const uint32_t s = ++p.pad_uc->seq[b];
    const uint32_t want = s * uint32_t(p.size);
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    red_add_release_sys(&p.pad_mc->arrive[b], 1u);
    ok = 1;
    const uint64_t start = now_ns();
    for (uint32_t spins = 0; int32_t(ld_acquire_sys_u32(&p.pad_uc->arrive[b]) - want) < 0; ++spins) {
      if ((spins & 63u) == 63u && now_ns() - start > p.timeout_ns) {
        record_timeout(p);
        ok = 0;
        break;
      }
    }
    fence_alias();
  }
  __syncthreads();
  return ok != 0;
}

template <int KIND>
__device__ __forceinline__ Vec16 ld_reduce(const Vec16* mc) {
  if constexpr (KIND == kBF16) return ld_reduce_bf16x8(mc);
  else if constexpr (KIND == kF16) return ld_reduce_f16x8(mc);
  else return ld_reduce_f32x4(mc);
}

template <int KIND>
__global__ void __launch_bounds__(kThreads) all_reduce_kernel(MulticastPgl p, size_t vecs) {
  if (!block_barrier(p)) return;  // every member's input is in place
  const size_t per = (vecs + p.size - 1) / p.size;
  const size_t begin = per * size_t(p.rank) < vecs ? per * size_t(p.rank) : vecs;
  const size_t end = begin + per < vecs ? begin + per : vecs;
  Vec16* mc = static_cast<Vec16*>(p.data_mc);
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = begin + size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += stride)
    st_16(mc + i, ld_reduce<KIND>(mc + i));
  block_barrier(p);  // every member's slice has landed in every copy
}

__global__ void __launch_bounds__(32) barrier_kernel(MulticastPgl p) { block_barrier(p); }

std::atomic<bool>& allowed() {
  static std::atomic<bool> a{false};
  return a;
}

}  // namespace

std::vector<const void*> kernels() {
  return {reinterpret_cast<const void*>(&all_reduce_kernel<kBF16>),
          reinterpret_cast<const void*>(&all_reduce_kernel<kF16>),
          reinterpret_cast<const void*>(&all_reduce_kernel<kF32>), reinterpret_cast<const void*>(&barrier_kernel)};
}

cudaError_t configure() {
  if (!multicast_policy().allowed) return cudaSuccess;  // load nothing; launches stay refused
  for (const void* k : kernels()) {
    cudaFuncAttributes attr;
    if (const cudaError_t e = cudaFuncGetAttributes(&attr, k); e != cudaSuccess) return e;
  }
  allowed().store(true);
  return cudaSuccess;
}

cudaError_t launch_all_reduce(const MulticastPgl& p, DType dtype, size_t nbytes, int max_blocks, cudaStream_t stream) {
  if (!allowed().load()) return cudaErrorNotPermitted;
  if (nbytes % sizeof(Vec16) != 0 || p.size < 2 || p.size > kMaxGroup || p.rank < 0 || p.rank >= p.size)
    return cudaErrorInvalidValue;
  const size_t vecs = nbytes / sizeof(Vec16);
  const size_t slice = (vecs + p.size - 1) / p.size;
  const int cap = max_blocks < kMaxBarrierBlocks ? (max_blocks < 1 ? 1 : max_blocks) : kMaxBarrierBlocks;
  const size_t want = (slice + kThreads - 1) / kThreads;
  const int grid = want < 1 ? 1 : (want < size_t(cap) ? int(want) : cap);
  switch (dtype) {
    case DType::kBF16: all_reduce_kernel<kBF16><<<grid, kThreads, 0, stream>>>(p, vecs); break;
    case DType::kF16: all_reduce_kernel<kF16><<<grid, kThreads, 0, stream>>>(p, vecs); break;
    case DType::kF32: all_reduce_kernel<kF32><<<grid, kThreads, 0, stream>>>(p, vecs); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_barrier(const MulticastPgl& p, cudaStream_t stream) {
  if (!allowed().load()) return cudaErrorNotPermitted;
  barrier_kernel<<<1, 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace pk::multimem
