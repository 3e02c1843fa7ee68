// Row chunks delivered in pieces by many senders (AG+GEMM with a pusher on every SM): a sender adds 1
// to the receiver's chunk_count[sender][c] once its piece of chunk c has landed (release); the
// receiver waits until the count reaches the chunk's number of pieces (acquire). Counts, unlike the
// epoch flags of item_flags.cuh, need a reset: the receiver's last CTA clears them at the end of the
// op, after every peer reported done (so no peer adds any more). Store-add RS/AR count the same way
// the zeroed pieces of each output row block (the block's owner signals every member that adds to it),
// and the AR relay the tiles each member added into an owner's row block.
#pragma once
#include <cstdint>

#include "sync.cuh"

namespace pk {

// Writes made by TMA (async proxy) must be complete (cp.async.bulk.wait_group 0) before the call.
__device__ __forceinline__ void signal_piece(const Group& g, int dst_rank, int chunk) {
  asm volatile("fence.proxy.async.global;" ::: "memory");
  uint32_t* count = &g.ctrl[dst_rank]->chunk_count[g.my_slot()][chunk];
  asm volatile("red.release.sys.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
}

// Afterwards the chunk may be read by TMA loads. False after a timeout.
__device__ __forceinline__ bool wait_chunk(const Group& g, int src_rank, int chunk, uint32_t pieces) {
  return wait_word(&g.self()->chunk_count[g.slot[src_rank]][chunk], [&](uint32_t v) { return v >= pieces; }, g,
                   src_rank, kTimeoutItem);
}

// The receiver's last CTA at the end of the op: every thread clears a share of the counts.
__device__ __forceinline__ void reset_chunks(const Group& g, int chunks) {
  for (int i = threadIdx.x; i < g.size * chunks; i += blockDim.x) g.self()->chunk_count[g.slot[i / chunks]][i % chunks] = 0;
}

}  // namespace pk
