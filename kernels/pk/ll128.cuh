// LL128 lines for the small all_reduce "small_ll128" (after NCCL's LL128 protocol): a 128-byte line is
// 8 lanes' 16-byte parts, stored by one warp instruction; the last 8 bytes of part 7 hold the flag
// (the op's ll_flag and its complement), the other 120 bytes payload. It relies on NVLink delivering a
// warp's aligned 128-byte store to a line as one write and a warp's 128-byte load of a line as one read
// (what NCCL's LL128 relies on, enabled on NVLink only), so that a reader whose flag lane sees the flag
// has the whole line: 120 / 128 of the wire carries data (LL lines: 4 / 8) and no fence is needed. PTX
// promises single-copy atomicity only up to 8 bytes: this is a hardware property, documented in
// docs/design-small-collectives.md beside its stress test.
#pragma once
#include <cstdint>
#include "sync.cuh"

namespace pk {

constexpr int kLL128LineBytes = 128;
constexpr int kLL128PartBytes = 16;    // one lane's part of a line
constexpr int kLL128FlagPart = 7;      // its high 8 bytes hold the flag word
constexpr int kLL128PayloadBytes = 120;
constexpr int kLL128LinesPerWarp = 32 * kLL128PartBytes / kLL128LineBytes;  // 4 lines per warp instruction

// Lines that carry n payload bytes.
__host__ __device__ constexpr int64_t ll128_lines(int64_t n) { return (n + kLL128PayloadBytes - 1) / kLL128PayloadBytes; }

// Two-shot: member o owns lines [ll128_chunk_begin(o), ll128_chunk_begin(o + 1)) of `lines` over g members (every
// chunk non-empty when lines >= g), and line l belongs to ll128_owner(l).
__host__ __device__ constexpr int64_t ll128_chunk_begin(int o, int64_t lines, int g) { return o * lines / g; }
__host__ __device__ constexpr int ll128_owner(int64_t line, int64_t lines, int g) {
  return int(((line + 1) * g + lines - 1) / lines - 1);
}

// Where a lane's part of line `line` sits: in the payload (x, y) and in a receive area. Part 7 carries
// 8 payload bytes, parts 0-6 carry 16.
struct LL128Part {
  int64_t line;
  int part;
  __device__ int64_t payload_offset() const { return line * kLL128PayloadBytes + part * kLL128PartBytes; }
  __device__ int64_t area_offset() const { return line * kLL128LineBytes + part * kLL128PartBytes; }
  __device__ bool flag_lane() const { return part == kLL128FlagPart; }
};

// Lane `lane` of a warp working on lines [first + 4 q, first + 4 q + 4): line first + 4 q + lane / 8, part lane % 8.
__device__ __forceinline__ LL128Part ll128_part(int64_t q, int lane, int64_t first = 0) {
  return {first + q * kLL128LinesPerWarp + lane / 8, lane % 8};
}

// The flag word: the 32-bit ll_flag and its complement, so that stale plain bytes of the chunk-flag all_reduces,
// which share this area, pass for a flag only if they hold that exact 64-bit pattern (while the pair's epoch is below
// 2^19 the complement's high bits are all ones, a NaN in every dtype; later epochs rely on the exact match). Only LL128
// writes flag words here, so a member that ran another small op at this epoch is not recognised (no kOpMismatch:
// the wait times out, kTimeoutSmall, naming the op and the peer).
// The two-shot's words flip bit 0 of the complement (kLL128TwoShotMark), so that members which picked different
// kernels for one op (knobs differing between processes) fail with kOpMismatch instead of mixing lines. The mark is a
// mantissa bit: the argument above holds for both kernels' words.
constexpr uint32_t kLL128TwoShotMark = 1;
// The peer_op of that kOpMismatch report: the kernel the peer ran (collectives.cuh's OpCode names them).
constexpr int32_t kLL128PeerOneShot = 16, kLL128PeerTwoShot = 17;
__device__ __forceinline__ uint64_t ll128_flag_word(uint32_t flag, int shots = 1) {
  return (uint64_t(flag) << 32) | (uint32_t(~flag) ^ (shots == 2 ? kLL128TwoShotMark : 0u));
}

__device__ __forceinline__ void ll128_store(char* p, uint64_t a, uint64_t b) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

__device__ __forceinline__ void ll128_load(const char* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// Whether this lane's line carries `want` (the flag lane's verdict, shared with the line's 8 lanes).
// Every lane of the warp calls it; lanes without a line (`valid` false) count as ready.
__device__ __forceinline__ bool ll128_line_ready(bool valid, const LL128Part& at, uint64_t b, uint64_t want) {
  const int lane = threadIdx.x & 31;
  return __shfl_sync(0xffffffffu, !valid || !at.flag_lane() || b == want, lane | 7);
}

// The 16 bytes a lane holds of a line, and whether the warp's wait for its line succeeded.
struct LL128Got {
  uint64_t a, b;
  bool ok;
};

// ll128_settle's spin: the path taken when a line had not landed at the first load.
__device__ __forceinline__ LL128Got ll128_spin(const char* p, bool valid, LL128Part at, uint64_t want, uint64_t a,
                                           uint64_t b, const Group& g, int peer_rank) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const uint64_t start = global_timer_ns();
  const volatile uint32_t* aborted = &g.self()->aborted;
  bool ready = ll128_line_ready(valid, at, b, want);
  for (uint32_t spins = 0;; ++spins) {
    if (!ready) ll128_load(p, a, b);
    ready = ll128_line_ready(valid, at, b, want);
    if (__all_sync(kAll, ready)) return {a, b, true};
    // Another op at this epoch: same epoch bits, another code, and a well-formed flag word (either kernel's). Only
    // LL128 writes flag words today (all with code 15), so this fires only once another op shares them. Or the other
    // LL128 kernel's word for this very op: the peer picked the other kernel.
    const uint32_t got = uint32_t(b >> 32), wanted = uint32_t(want >> 32);
    const bool formed = ((uint32_t(b) ^ ~got) & ~kLL128TwoShotMark) == 0;
    const bool other_op = valid && at.flag_lane() && formed && got != wanted && (got >> 4) == (wanted >> 4);
    const bool other_kernel =
        valid && at.flag_lane() && got == wanted && uint32_t(b) == (uint32_t(want) ^ kLL128TwoShotMark);
    const unsigned mismatch = __ballot_sync(kAll, other_op || other_kernel);
    if (mismatch) {
      const int first = __ffs(mismatch) - 1;
      const uint32_t code = __shfl_sync(kAll, got, first);
      const bool kernel = __shfl_sync(kAll, other_kernel, first);
      // The peer's kernel is the one whose word this is not: a two-shot word arrived where a one-shot was wanted.
      const int32_t theirs = !kernel ? int32_t(code & 0xFu)
                             : (uint32_t(want) ^ uint32_t(~wanted)) ? kLL128PeerOneShot : kLL128PeerTwoShot;
      if (lane == 0) record_error(g, kOpMismatch, peer_rank, theirs);
      return {a, b, false};
    }
    if ((spins & 63u) == 63u) {
      int stop = 0;  // lane 0 decides, so every lane leaves in the same iteration
      if (lane == 0) stop = *aborted ? 1 : (global_timer_ns() - start > g.timeout_ns ? 2 : 0);
      stop = __shfl_sync(kAll, stop, 0);
      if (stop) {
        if (stop == 2 && lane == 0) record_error(g, kTimeoutSmall, peer_rank);
        return {a, b, false};
      }
    }
  }
}

// Waits (the whole warp) until every valid lane's line carries `want`, reloading only the lines that do
// not; (a, b) are the lane's first load of the line. False after the bounded wait gave up (kTimeoutSmall
// against `peer_rank`) or when a line carries this epoch with another op's code (kOpMismatch): the same
// on every lane.
__device__ __forceinline__ bool ll128_settle(const char* p, bool valid, const LL128Part& at, uint64_t want, uint64_t& a,
                                             uint64_t& b, const Group& g, int peer_rank) {
  if (__all_sync(0xffffffffu, ll128_line_ready(valid, at, b, want))) return true;
  const LL128Got got = ll128_spin(p, valid, at, want, a, b, g, peer_rank);
  a = got.a;
  b = got.b;
  return got.ok;
}

}  // namespace pk
