// Thread-block clusters (sm_90): two CTAs on neighbouring SMs that share operand loads. One TMA load
// multicast to both CTAs' shared memory reads L2 once for both (the grouped GEMM's pair variant: the two row
// tiles of one expert share every B box). Each CTA keeps its own mbarriers; a stage one CTA multicasts into
// may be overwritten only when both CTAs' consumers released it, so consumers arrive on the peer's empty
// barrier as well as their own (mbar_arrive_peer).
#pragma once
#include <cstdint>

#include "tma.cuh"

namespace pk::cluster {

// This CTA's rank inside its cluster.
__device__ __forceinline__ uint32_t rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA in the cluster (aligned: whole warps). Releases this CTA's shared-memory writes
// (barrier inits) to the peers and acquires theirs.
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Arrive on the mbarrier at `bar`'s offset in CTA `cta` of the cluster.
__device__ __forceinline__ void mbar_arrive_peer(uint64_t* bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(tma::smem_addr(bar)), "r"(cta));
  // Default semantics (release at CTA scope), as CUTLASS's ClusterBarrier::arrive: .release.cluster made every
  // arrival a cluster-scope fence and the pair variant ~1.2 us per k-block (2026-11-27, one H200).
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// A 3-D TMA box written to `dst`'s offset in every CTA of `mask`, each one's bytes counted on the mbarrier at
// `bar`'s offset in that CTA.
__device__ __forceinline__ void load_tile_3d_multicast(void* dst, const void* tmap, int c0, int c1, int c2,
                                                       uint64_t* bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(tma::smem_addr(dst)),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(tma::smem_addr(bar)), "h"(mask)
      : "memory");
}

}  // namespace pk::cluster
