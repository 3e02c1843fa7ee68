// Self-test of the TMA tile primitives against peer memory: GPU `me` loads a peer buffer into
// shared memory (load_async), stores it to another peer buffer (store_async), and adds a local
// buffer into a third peer buffer (store_add_async). Run by tests/gpu through the extension.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pk/tma.cuh"
#include "tma_selftest.cuh"

namespace pk {
namespace {

constexpr uint32_t kChunk = 16384;  // bytes per CTA

__global__ void tma_roundtrip_kernel(const char* peer_src, char* peer_dst, __nv_bfloat16* peer_acc,
                                     const __nv_bfloat16* local_add) {
  extern __shared__ __align__(128) char tile[];
  __shared__ uint64_t bar;
  if (threadIdx.x != 0) return;
  const size_t off = size_t(blockIdx.x) * kChunk;
  tma::mbar_init(&bar, 1);
  tma::fence_barrier_init();
  tma::mbar_expect_tx(&bar, kChunk);
  tma::load_async(tile, peer_src + off, kChunk, &bar);  // peer HBM -> smem
  tma::mbar_wait(&bar, 0);
  tma::store_async(peer_dst + off, tile, kChunk);  // smem -> peer HBM
  tma::commit_group();
  tma::wait_group_read<0>();  // smem may be overwritten once the store has read it
  tma::mbar_expect_tx(&bar, kChunk);
  tma::load_async(tile, reinterpret_cast<const char*>(local_add) + off, kChunk, &bar);
  tma::mbar_wait(&bar, 1);
  tma::store_add_async(peer_acc + off / sizeof(__nv_bfloat16), reinterpret_cast<const __nv_bfloat16*>(tile), kChunk);
  tma::commit_group();
  tma::wait_group<0>();
}

#define PK_TRY(call)                                                      \
  do {                                                                    \
    cudaError_t e_ = (call);                                              \
    if (e_ != cudaSuccess) return std::string(#call ": ") + cudaGetErrorString(e_); \
  } while (0)

}  // namespace

std::string tma_peer_selftest(int me, int peer, size_t chunks) {
  const size_t bytes = chunks * kChunk, n = bytes / sizeof(__nv_bfloat16);
  std::vector<uint16_t> src(n), add(n), acc(n);
  for (size_t i = 0; i < n; ++i) {
    src[i] = uint16_t(i * 2654435761u >> 7);
    add[i] = 0x3f80 + uint16_t((i % 7) << 7);  // bf16 1, 2, 4, ... 64: small integers, exact sums
    acc[i] = 0x3f80;                             // bf16 1.0
  }
  char *p_src, *p_dst, *p_acc, *l_add;
  PK_TRY(cudaSetDevice(peer));
  PK_TRY(cudaMalloc(&p_src, bytes));
  PK_TRY(cudaMalloc(&p_dst, bytes));
  PK_TRY(cudaMalloc(&p_acc, bytes));
  PK_TRY(cudaMemcpy(p_src, src.data(), bytes, cudaMemcpyHostToDevice));
  PK_TRY(cudaMemset(p_dst, 0xff, bytes));  // poison (NaN pattern)
  PK_TRY(cudaMemcpy(p_acc, acc.data(), bytes, cudaMemcpyHostToDevice));
  PK_TRY(cudaSetDevice(me));
  PK_TRY(cudaMalloc(&l_add, bytes));
  PK_TRY(cudaMemcpy(l_add, add.data(), bytes, cudaMemcpyHostToDevice));
  PK_TRY(cudaFuncSetAttribute(tma_roundtrip_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kChunk));
  tma_roundtrip_kernel<<<unsigned(chunks), 32, kChunk>>>(p_src, p_dst, reinterpret_cast<__nv_bfloat16*>(p_acc),
                                                         reinterpret_cast<const __nv_bfloat16*>(l_add));
  PK_TRY(cudaGetLastError());
  PK_TRY(cudaDeviceSynchronize());
  std::vector<uint16_t> got_dst(n), got_acc(n);
  PK_TRY(cudaMemcpy(got_dst.data(), p_dst, bytes, cudaMemcpyDeviceToHost));
  PK_TRY(cudaMemcpy(got_acc.data(), p_acc, bytes, cudaMemcpyDeviceToHost));
  std::string err;
  for (size_t i = 0; i < n && err.empty(); ++i) {
    if (got_dst[i] != src[i]) err = "store_async/load_async mismatch at element " + std::to_string(i);
    float a, b;
    const uint32_t ab = uint32_t(add[i]) << 16, gb = uint32_t(got_acc[i]) << 16;
    std::memcpy(&a, &ab, 4);
    std::memcpy(&b, &gb, 4);
    if (err.empty() && b != a + 1.0f) err = "store_add_async mismatch at element " + std::to_string(i);
  }
  cudaFree(l_add);
  PK_TRY(cudaSetDevice(peer));
  cudaFree(p_src);
  cudaFree(p_dst);
  cudaFree(p_acc);
  return err;
}

}  // namespace pk
