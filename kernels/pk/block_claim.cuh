// Output tiles ("blocks") that several members write (store-add reductions), without zeroing the
// output first: the first member to claim a block stores its part, the others wait until that has
// landed and add theirs. One CAS and one flag per block replace a memset of the whole output.
// A member publishes every block it claimed before it waits for any other (no wait cycles).
//
// block_state[i] in the owning member's control block: 0 free, 1 claimed, 2 stored. The owner's last
// CTA resets the states it used to 0 at the end of the op, after every peer reported done (so no
// peer touches them any more, and the next op's writers start only after its new handshake).
// After a timed-out `done` a late peer may still claim a reset state; like the rest of the op
// protocol, the device is then unusable until pk_jax.runtime.reset() (the error is sticky).
#pragma once
#include <cstdint>

#include "sync.cuh"

namespace pk {

enum : uint32_t { kBlockFree = 0, kBlockClaimed = 1, kBlockStored = 2 };

// True: this member is the block's first writer; it must store (not add), then publish_block.
__device__ __forceinline__ bool claim_block(uint32_t* state) {
  uint32_t old;
  asm volatile("atom.relaxed.sys.global.cas.b32 %0, [%1], %2, %3;"
               : "=r"(old)
               : "l"(state), "r"(uint32_t(kBlockFree)), "r"(uint32_t(kBlockClaimed))
               : "memory");
  return old == kBlockFree;
}

// First writer, after its TMA stores to the block completed (cp.async.bulk.wait_group 0).
__device__ __forceinline__ void publish_block(uint32_t* state) {
  asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(state), "r"(uint32_t(kBlockStored)) : "memory");
}

// Other writers: until the first writer's part has landed; afterwards TMA may add to the block.
__device__ __forceinline__ bool wait_block_stored(const Group& g, int owner, const uint32_t* state) {
  return wait_word(state, [](uint32_t v) { return v == kBlockStored; }, g, owner, kTimeoutItem);
}

// The owner's last CTA, at the end of the op: every thread of the CTA resets a share of the states.
__device__ __forceinline__ void reset_blocks(uint32_t* states, int count) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) states[i] = kBlockFree;
}

}  // namespace pk
