// A ring of shared-memory stages between a producer and its consumers, guarded by mbarriers:
// `full[s]` completes when stage s holds data (TMA bytes or producer arrivals), `empty[s]` when every
// consumer is done with it. Each role walks the ring with its own RingPos.
#pragma once
#include <cstdint>

#include "tma.cuh"

namespace pk {

template <int S>
struct Ring {
  uint64_t full[S];
  uint64_t empty[S];

  // One thread, before any use: `fills` arrivals complete a full phase, `drains` an empty phase.
  __device__ void init(uint32_t fills, uint32_t drains) {
    for (int s = 0; s < S; ++s) {
      tma::mbar_init(&full[s], fills);
      tma::mbar_init(&empty[s], drains);
    }
  }
};

template <int S>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == S) {
      stage = 0;
      phase ^= 1;
    }
  }
  // The producer waits for the previous round's release; in the first round that wait is a no-op
  // (a fresh mbarrier reports the phase before it as complete).
  __device__ __forceinline__ void wait_empty(Ring<S>& r) const { tma::mbar_wait(&r.empty[stage], phase ^ 1); }
  __device__ __forceinline__ void wait_full(Ring<S>& r) const { tma::mbar_wait(&r.full[stage], phase); }
};

// A single-slot handoff (e.g. an output tile in shared memory): the same protocol with one stage.
struct Handoff {
  uint64_t full;
  uint64_t empty;
  __device__ void init(uint32_t fills, uint32_t drains) {
    tma::mbar_init(&full, fills);
    tma::mbar_init(&empty, drains);
  }
};

}  // namespace pk
