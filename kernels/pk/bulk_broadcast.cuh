// One thread copies a contiguous byte range from local memory to up to kMaxGroup destinations
// (local or peer) with TMA bulk copies through a ring of shared-memory stages: each piece is loaded
// once and stored to every destination, loads running STAGES-1 pieces ahead. Returns once every
// write has completed, so the caller may signal the receivers right after.
#pragma once
#include <cstdint>

#include "control_block.h"
#include "tma.cuh"

namespace pk {

template <int STAGES, uint32_t PIECE>
struct BulkRing {
  alignas(128) unsigned char stage[STAGES][PIECE];
  uint64_t bar[STAGES];
  uint32_t loads;  // pieces loaded so far: the ring's position persists across calls

  __device__ void init() {
    for (int s = 0; s < STAGES; ++s) tma::mbar_init(&bar[s], 1);
    loads = 0;
    tma::fence_barrier_init();
  }
  // After the last broadcast (which waited for every copy): the stages' memory may be reused.
  __device__ void inval() {
    for (int s = 0; s < STAGES; ++s) tma::mbar_inval(&bar[s]);
  }

  // bytes: a multiple of 16; src and every dst 16-byte aligned.
  __device__ void broadcast(const char* src, char* const* dst, int ndst, uint64_t bytes) {
    const uint64_t pieces = (bytes + PIECE - 1) / PIECE;
    const uint32_t base = loads;
    auto piece_bytes = [&](uint64_t p) { return uint32_t(p + 1 < pieces ? PIECE : bytes - p * PIECE); };
    auto load = [&](uint64_t p) {
      const uint32_t n = base + uint32_t(p), s = n % STAGES;
      tma::mbar_expect_tx(&bar[s], piece_bytes(p));
      tma::load_async(stage[s], src + p * PIECE, piece_bytes(p), &bar[s]);
    };
    for (uint64_t p = 0; p < pieces && p < STAGES - 1; ++p) load(p);
    for (uint64_t p = 0; p < pieces; ++p) {
      const uint32_t n = base + uint32_t(p), s = n % STAGES;
      tma::mbar_wait(&bar[s], (n / STAGES) & 1);
      for (int d = 0; d < ndst; ++d) tma::store_async(dst[d] + p * PIECE, stage[s], piece_bytes(p));
      tma::commit_group();
      if (p + STAGES - 1 < pieces) {
        tma::wait_group_read<1>();  // the stage refilled next was read by piece p - 1's stores
        load(p + STAGES - 1);
      }
    }
    tma::wait_group<0>();
    loads = base + uint32_t(pieces);
  }
};

}  // namespace pk
