// The fused MoE layout's index math, in one place (docs/design-moe.md, "Layout" and "Deduplicated
// dispatch"): where assignment a = t * K + k of this member lands, which of a token's assignments to one
// member is its primary (the one whose row carries the data over NVLink), and the home-side slot of a
// peer's combine partials.
#pragma once
#include <cstdint>

namespace pk {

struct MoeRoute {
  const int32_t* key;   // global expert of each assignment (anything outside [0, E): dropped by capacity)
  const int32_t* pos;   // rank among this member's kept rows of the expert
  const int32_t* base;  // base[e]: row in e's member of this member's first row of e (shared memory)
  int experts, local, top_k, rank;
  int64_t recv_rows;

  __device__ int dest(int64_t a) const { return key[a] / local; }
  // Row of a in its destination's recv, or -1 when it drops (capacity, or past the R bound).
  __device__ int64_t row(int64_t a) const {
    const int32_t e = key[a];
    if (e < 0 || e >= experts) return -1;
    const int64_t r = int64_t(base[e]) + pos[a];
    return r < recv_rows ? r : -1;
  }
  // Row of a's primary (a kept assignment): the token's first kept assignment to the same member,
  // k order. Rows for the own member are all written directly (local stores, no NVLink): their own
  // primary. Must agree with the sender's loop in moe_dispatch_kernel (first kept per member).
  __device__ int64_t primary(int64_t a) const {
    const int m = dest(a);
    if (m != rank)
      for (int64_t b = a - a % top_k; b < a; ++b)
        if (const int64_t r = row(b); r >= 0 && dest(b) == m) return r;
    return row(a);
  }
};

// Combine partials: member `home` keeps one float32 (T, H) slot per peer, slot of peer `from`.
__host__ __device__ __forceinline__ int moe_partial_slot(int from, int home) { return from < home ? from : from - 1; }

}  // namespace pk
