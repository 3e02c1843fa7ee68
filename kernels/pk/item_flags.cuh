// Per-item signals between the members of a fused op: "item i (a GEMM tile, a row chunk) is ready
// for you". item_ready[src][i] in the receiver's control block holds the low 32 bits of the op's
// epoch for the (src, receiver) pair, so no reset is needed between ops (epochs only grow).
#pragma once
#include <cstdint>

#include "op_protocol.cuh"
#include "sync.cuh"

namespace pk {

// Release: everything this thread wrote (or observed) before is visible to whoever sees the flag.
// Writes made by TMA (async proxy) must be complete (cp.async.bulk.wait_group 0) before the call.
__device__ __forceinline__ void signal_item(const Group& g, int dst_rank, int item, uint64_t epoch) {
  asm volatile("fence.proxy.async.global;" ::: "memory");
  uint32_t* f = &g.ctrl[dst_rank]->item_ready[g.my_slot()][item];
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(f), "r"(uint32_t(epoch)) : "memory");
}

// Acquire; afterwards the item's data may also be read by TMA (the proxy fence orders it).
__device__ __forceinline__ bool wait_item(const Group& g, int src_rank, int item, uint64_t epoch) {
  return wait_word(&g.self()->item_ready[g.slot[src_rank]][item],
                   [&](uint32_t v) { return int32_t(v - uint32_t(epoch)) >= 0; }, g, src_rank, kTimeoutItem);
}

}  // namespace pk
