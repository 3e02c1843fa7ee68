// all_reduce "small_ll128": the LL all_reduce with 128-byte lines (pk/ll128.cuh), one-shot or (from G = 3 and
// kLL128TwoShotMinBytes) two-shot. One-shot: every member stores all of x, as lines of 120 payload bytes + a flag
// word, into every peer's area (chunk_data of the receiver's control block, sender's slot, the op's parity), then
// sums the G members in rank order in float32 from x and its own area, each line waited for by its flag. One one-way
// trip, no fence, no per-call handshake, 128 / 120 of the payload on the wire (the 8-byte LL lines send 2x). Epochs,
// parity and the last-CTA epoch advance are the LL path's (pk/small_epochs.cuh): every pair exchanges lines in every
// op, so the parity argument of small_collectives.cu holds unchanged.
#include "small_ll128.cuh"

#include <cstring>

#include "pk/env.h"
#include "pk/ll128.cuh"
#include "pk/small_epochs.cuh"
#include "pk/vec.cuh"

namespace pk {
namespace {

static_assert(kOpAllReduceLL128 <= 0xF, "ll_flag keeps 4 bits of the op code");
static_assert(kLL128PeerOneShot == kOpAllReduceLL128OneShot && kLL128PeerTwoShot == kOpAllReduceLL128TwoShot,
              "pk/ll128.cuh's mismatch reports use the OpCode names");

constexpr int kLL128Threads = 256;
// Lines per CTA (a multiple of the 32 lines one pass of 8 warps covers); CTAs up to what fits at once
// (ll128_ctas_per_sm), so all are resident and no receiver waits on a sender that cannot start.
// PK_JAX_SMALL_LL128_LINES_PER_CTA overrides it for sweeps (read once per process).
constexpr int64_t kLL128LinesPerCta = 32;
// Two-shot from this size at G >= 3 (ll128_shots; PK_JAX_AR_LL128_TWO_SHOT_MIN_BYTES, PK_JAX_AR_LL128_SHOTS=1|2
// forces either): the one-shot sends (G-1) n, the two-shot 2 (G-1)/G n over a second trip. Measured on 4x H200
// (session 32, latency_floor slopes, us per op, one-shot / two-shot): 64 KiB 5.27 / 6.66, 128 KiB 6.47 / 6.99,
// 256 KiB 8.55 / 7.30, 512 KiB 8.52 / 8.21, 1 MiB 10.70 / 10.76, 2 MiB 18.34 / 17.91.
constexpr int64_t kLL128TwoShotMinBytes = 256 << 10;
// One quad (4 lines) per warp at a time. Four in flight when sending and two when receiving (session 31, 2x H200)
// made every size slower: 5.6-6.7 us from 4 KiB to 512 KiB against 3.7-4.9, and 8 MiB 50.7 against 47.2-47.7 us.

// The one-shot's sums trail its sends by this many of a warp's quads (PK_JAX_SMALL_LL128_LAG, read once per process;
// a lag of at least a warp's share sends everything first, session 31's kernel). A warp has 17 quads at 8 MiB on
// 132 SMs, where the sums used to follow ~24 us of sends. Measured on 2 of 4x H200 (session 32, us per op, 2 / 4 / 8 /
// session 31's): 1 MiB 7.87 / 7.79 / 8.30 / 8.37, 4 MiB 20.29 / 21.96 / 24.46 / -, 8 MiB 34.14 / 36.58 / 40.58 / 46.45;
// with x loaded a quad ahead (lag 1 / 2 / 3): 8 MiB 33.70 / 34.89 / 35.38, 4 MiB 19.62 / 20.43 / 21.17 (noise-level).
// At 3 CTAs per SM (2x H200, session 34, lag 1 / 3 / 2 twice): 8 MiB 30.65 / 33.26 / 31.98-32.06, 4 MiB 17.44 / 18.57 /
// 18.43-18.84, 2 MiB 11.14 / 12.60 / 11.74-11.85; 1 MiB 7.26-7.69 in every row.
constexpr int64_t kLL128Lag = 1;

int64_t ll128_lag() {
  static const int64_t v = env_or("PK_JAX_SMALL_LL128_LAG", kLL128Lag, 0, 1 << 20);
  return v;
}

// CTAs per SM, capped by what fits (configure_kernels; the one-shot's launch bounds keep 3 of the 16-bit kernel and 2
// of the float32 one): a warp's loop is latency-bound (session 32: ~2 us per quad at 8 MiB on 1,056 warps; fewer
// summing warps were proportionally slower), so more warps put more lines in flight. One-shot on 2x H200 (session 33,
// us per op, 1 / 2 / 3 CTAs per SM, two or three runs): 1 MiB 8.35-8.76 / 8.12-8.15 / 7.39-8.04, 2 MiB 12.68-13.55 /
// 11.66-11.68 / 11.38-11.41, 8 MiB 34.27-34.59 / 33.15-33.30 / 31.75-31.96; below ~495 KiB the grid has fewer CTAs than
// SMs either way. The two-shot keeps one (not measured with more). PK_JAX_SMALL_LL128_CTAS_PER_SM sets both (read once
// per process). A pair's kernel summing 2 members (64 registers, 4 CTAs fit) was no faster at 8 MiB (33.6-37.0 us at
// 1-4 CTAs per SM) and is not kept.
constexpr int64_t kLL128OneShotCtasPerSm = 3;

int64_t ll128_ctas_per_sm(int shots) {
  static const int64_t forced = env_or("PK_JAX_SMALL_LL128_CTAS_PER_SM", 0, 0, 8);
  if (forced) return forced;
  return shots == 1 ? kLL128OneShotCtasPerSm : 1;
}

int64_t ll128_lines_per_cta() {
  static const int64_t v = env_or("PK_JAX_SMALL_LL128_LINES_PER_CTA", kLL128LinesPerCta, 32, 1 << 16) / 32 * 32;
  return v;
}

// The 8 payload bytes at offset o (a multiple of 8) of a buffer of n bytes; bytes past n read as zero.
// n is a whole number of 16-bit or 32-bit elements, so the tail goes by 16-bit halves.
__device__ __forceinline__ uint64_t load_u64(const char* base, int64_t o, int64_t n) {
  if (o + 8 <= n) return *reinterpret_cast<const uint64_t*>(base + o);
  uint64_t v = 0;
  for (int k = 0; k < 4 && o + 2 * k < n; ++k)
    v |= uint64_t(*reinterpret_cast<const uint16_t*>(base + o + 2 * k)) << (16 * k);
  return v;
}

__device__ __forceinline__ void store_u64(char* base, int64_t o, int64_t n, uint64_t v) {
  if (o + 8 <= n) {
    *reinterpret_cast<uint64_t*>(base + o) = v;
    return;
  }
  for (int k = 0; k < 4 && o + 2 * k < n; ++k) *reinterpret_cast<uint16_t*>(base + o + 2 * k) = uint16_t(v >> (16 * k));
}

// Float32 sums of one 16-byte part (4 floats or 8 16-bit elements), over vec.cuh's lanes.
template <typename T>
struct PartSum {
  using L = lanes<T, 16>;
  float acc[L::kCount] = {};
  __device__ void add(uint64_t a, uint64_t b) {
    const uint64_t v[2] = {a, b};
    uint4 u;
    memcpy(&u, v, 16);
    L::add(acc, u);
  }
  __device__ void pack(uint64_t& a, uint64_t& b) const {
    const uint4 u = L::pack(acc);
    uint64_t v[2];
    memcpy(v, &u, 16);
    a = v[0];
    b = v[1];
  }
};

// The owner of a chunk's first and last line is the chunk's member (pk/ll128.cuh's two helpers agree).
static_assert(ll128_owner(ll128_chunk_begin(3, 7, 4), 7, 4) == 3 && ll128_owner(ll128_chunk_begin(4, 7, 4) - 1, 7, 4) == 3 &&
                  ll128_owner(ll128_chunk_begin(1, 8739, 3), 8739, 3) == 1 && ll128_owner(8738, 8739, 8) == 7 &&
                  ll128_owner(0, 5, 5) == 0 && ll128_owner(ll128_chunk_begin(2, 10, 3) - 1, 10, 3) == 1,
              "ll128_owner must invert ll128_chunk_begin");

// One launch's view of the lines: this device's flag with each member, x and y, and the per-lane steps both kernels
// take. Warp w of the grid works on quads w, w + warps, ... (4 lines each, lane / 8 the line, lane % 8 the part).
template <typename T>
struct LL128Launch {
  const Group& g;
  const uint32_t* flag;  // shared memory, by rank: this op's ll_flag with that member
  const char* x;
  char* y;
  int64_t n, lines;
  int shots;  // which kernel: its flag words differ (ll128_flag_word)
  int lane;
  int64_t warp0, warps;

  __device__ LL128Launch(const Group& g_, const uint32_t* flag_, const char* x_, char* y_, int64_t n_, int shots_)
      : g(g_), flag(flag_), x(x_), y(y_), n(n_), lines(ll128_lines(n_)), shots(shots_), lane(int(threadIdx.x & 31)),
        warp0((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32), warps(int64_t(gridDim.x) * blockDim.x / 32) {}

  // The flag word of this op's lines with member r.
  __device__ uint64_t word(int r) const { return ll128_flag_word(flag[r], shots); }

  // Quads (4 lines) covering `count` lines.
  __device__ static int64_t quads(int64_t count) { return (count + kLL128LinesPerWarp - 1) / kLL128LinesPerWarp; }
  // This lane's part in member r's area (this device's slot), and in its own area (r's slot).
  __device__ char* out_at(int r, const LL128Part& at) const {
    return g.ctrl[r]->chunk_data[ll_parity(flag[r])][g.my_slot()] + at.area_offset();
  }
  __device__ const char* in_at(int r, const LL128Part& at) const {
    return g.self()->chunk_data[ll_parity(flag[r])][g.slot[r]] + at.area_offset();
  }
  // x's part of this lane's line: (a, b); part 7's b is 0 (its place carries the flag word).
  __device__ void own(const LL128Part& at, uint64_t& a, uint64_t& b) const {
    const int64_t o = at.payload_offset();
    a = load_u64(x, o, n);
    b = at.flag_lane() ? 0 : load_u64(x, o + 8, n);
  }
  // (a, b) as this lane's part of its line in member r's area, part 7 with the flag word.
  __device__ void send(int r, const LL128Part& at, uint64_t a, uint64_t b) const {
    ll128_store(out_at(r, at), a, at.flag_lane() ? word(r) : b);
  }
  __device__ void store_y(const LL128Part& at, uint64_t a, uint64_t b) const {
    const int64_t o = at.payload_offset();
    store_u64(y, o, n, a);
    if (!at.flag_lane()) store_u64(y, o + 8, n, b);
  }
  // The rank-order float32 sum of this lane's part over the members (own from x, the others from their lines in
  // this device's area: every load first, then each waits for its flag), packed into (a, b). Every lane of the warp
  // calls it; false when a wait failed.
  __device__ bool sum(const LL128Part& at, bool valid, uint64_t& a, uint64_t& b) const {
    uint64_t va[kMaxGroup], vb[kMaxGroup];
#pragma unroll
    for (int r = 0; r < kMaxGroup; ++r) {
      va[r] = vb[r] = 0;
      if (r >= g.size || !valid) continue;  // continue, not break: a break left va / vb in local memory
      if (r == g.rank) {
        own(at, va[r], vb[r]);
      } else {
        ll128_load(in_at(r, at), va[r], vb[r]);
      }
    }
    PartSum<T> acc;
    bool ok = true;
#pragma unroll
    for (int r = 0; r < kMaxGroup; ++r) {
      if (r >= g.size) continue;
      if (r != g.rank) {
        ok = ll128_settle(in_at(r, at), valid, at, word(r), va[r], vb[r], g, r) && ok;
        if (at.flag_lane()) vb[r] = 0;  // the flag word is not payload
      }
      acc.add(va[r], vb[r]);
    }
    acc.pack(a, b);
    return ok;
  }
};

template <typename T>
__global__ void __launch_bounds__(kLL128Threads, sizeof(T) == 2 ? 3 : 2)  // kLL128OneShotCtasPerSm of 16-bit data fit
    small_all_reduce_ll128(Group g, const char* x, char* y, int64_t n, int64_t lag) {
  __shared__ uint32_t flag[kMaxGroup];
  load_small_flags(g, flag, kOpAllReduceLL128);
  __syncthreads();
  const LL128Launch<T> L(g, flag, x, y, n, 1);
  const int64_t quads = L.quads(L.lines);
  const int64_t mine = quads > L.warp0 ? (quads - L.warp0 + L.warps - 1) / L.warps : 0;  // this warp's quads
  lag = lag < mine ? lag : mine;
  const auto part = [&](int64_t i) { return ll128_part(L.warp0 + i * L.warps, L.lane); };
  // Iteration i sends this warp's quad i to every peer and sums its quad i - lag, whose lines the peers sent about
  // lag iterations ago: the sums run under the sends. No cycle of waits: a warp's sends never wait on its sums of
  // later quads, and every CTA is resident. x's part of quad i + 1 is loaded during iteration i.
  uint64_t next_a = 0, next_b = 0;
  if (mine > 0 && part(0).line < L.lines) L.own(part(0), next_a, next_b);
  bool ok = true;
  for (int64_t i = 0; i < mine + lag; ++i) {
    if (i < mine) {
      const LL128Part at = part(i);
      const uint64_t a = next_a, b = next_b;
      if (i + 1 < mine && part(i + 1).line < L.lines) L.own(part(i + 1), next_a, next_b);
      if (at.line < L.lines) {  // whole lines drop out together: the stores stay 128-byte writes
        for (int p = 1; p < g.size; ++p) L.send((g.rank + p) % g.size, at, a, b);
      }
    }
    if (i >= lag) {  // the rank-order float32 sum
      const LL128Part at = part(i - lag);
      const bool valid = at.line < L.lines;
      uint64_t a, b;
      ok = L.sum(at, valid, a, b) && ok;
      if (valid && ok) L.store_y(at, a, b);
    }
  }
  finish_small_op(g);
}

// Two-shot (reduce-scatter + all-gather of lines, launch_ll128 picks it: ll128_shots): member o owns the lines
// [ll128_chunk_begin(o), ll128_chunk_begin(o + 1)), all non-empty (lines >= G). (A) each line of another owner goes
// to that owner; (B) each member sums its own chunk over the members, keeps it and sends it to every peer (into the
// lines of its chunk in their areas: disjoint from the lines (A) fills, which lie in the receiver's own chunk);
// (C) the other chunks arrive from their owners. Two one-way trips; each GPU sends 2 (G-1)/G of the lines.
template <typename T>
__global__ void __launch_bounds__(kLL128Threads, 1)
    small_all_reduce_ll128_two_shot(Group g, const char* x, char* y, int64_t n) {
  __shared__ uint32_t flag[kMaxGroup];
  load_small_flags(g, flag, kOpAllReduceLL128);
  __syncthreads();
  const LL128Launch<T> L(g, flag, x, y, n, 2);
  const int64_t quads = L.quads(L.lines);
  const int64_t mine = ll128_chunk_begin(g.rank, L.lines, g.size), mine_end = ll128_chunk_begin(g.rank + 1, L.lines, g.size);
  // (A)
  for (int64_t q = L.warp0; q < quads; q += L.warps) {
    const LL128Part at = ll128_part(q, L.lane);
    if (at.line >= L.lines) continue;
    const int owner = ll128_owner(at.line, L.lines, g.size);
    if (owner == g.rank) continue;  // the line's 8 lanes share its owner: stores stay whole lines
    uint64_t a, b;
    L.own(at, a, b);
    L.send(owner, at, a, b);
  }
  // (B)
  bool ok = true;
  for (int64_t q = L.warp0; q < L.quads(mine_end - mine); q += L.warps) {
    const LL128Part at = ll128_part(q, L.lane, mine);
    const bool valid = at.line < mine_end;
    uint64_t a, b;
    ok = L.sum(at, valid, a, b) && ok;
    if (valid && ok) {
      L.store_y(at, a, b);
      for (int p = 1; p < g.size; ++p) L.send((g.rank + p) % g.size, at, a, b);
    }
  }
  // (C)
  for (int64_t q = L.warp0; q < quads; q += L.warps) {
    const LL128Part at = ll128_part(q, L.lane);
    const int owner = at.line < L.lines ? ll128_owner(at.line, L.lines, g.size) : g.rank;
    const bool valid = owner != g.rank;
    uint64_t a = 0, b = 0;
    if (valid) ll128_load(L.in_at(owner, at), a, b);
    // A peer this warp waits on, named in a timeout or mismatch report (lane 0's line may be this rank's own).
    const unsigned waits = __ballot_sync(0xffffffffu, valid);
    const int named = __shfl_sync(0xffffffffu, owner, waits ? __ffs(waits) - 1 : 0);
    ok = ll128_settle(L.in_at(owner, at), valid, at, L.word(owner), a, b, g, named) && ok;
    if (valid && ok) L.store_y(at, a, b);
  }
  finish_small_op(g);
}

template <typename T>
const void* ll128_kernel_for(int shots) {
  return shots == 2 ? reinterpret_cast<const void*>(&small_all_reduce_ll128_two_shot<T>)
                    : reinterpret_cast<const void*>(&small_all_reduce_ll128<T>);
}

const void* ll128_kernel(DType dtype, int shots) {
  switch (dtype) {
    case DType::kF32: return ll128_kernel_for<float>(shots);
    case DType::kBF16: return ll128_kernel_for<__nv_bfloat16>(shots);
    case DType::kF16: return ll128_kernel_for<__half>(shots);
  }
  return nullptr;
}

}  // namespace

cudaError_t launch_ll128(const Group& g, DType dtype, const void* x, void* y, int64_t bytes, const LaunchLimits& lim,
                         cudaStream_t stream) {
  if (bytes <= 0 || bytes > kChunkedBytes || g.size < 2) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y)) & 7) return cudaErrorMisalignedAddress;
  const int shots = ll128_shots(bytes, g.size);
  const void* k = ll128_kernel(dtype, shots);
  if (!k) return cudaErrorInvalidValue;
  const int64_t lines_per_warp = ll128_lines_per_cta() / (kLL128Threads / 32);  // a warp-sized item of the grid
  const int grid = resident_grid(k, (ll128_lines(bytes) + lines_per_warp - 1) / lines_per_warp, kLL128Threads, lim,
                                 int(ll128_ctas_per_sm(shots)));
  const char* s = static_cast<const char*>(x);
  char* d = static_cast<char*>(y);
  int64_t lag = ll128_lag();
  void* one_shot[] = {const_cast<Group*>(&g), &s, &d, &bytes, &lag};
  void* two_shot[] = {const_cast<Group*>(&g), &s, &d, &bytes};
  return cudaLaunchKernel(k, dim3(unsigned(grid)), dim3(kLL128Threads), shots == 2 ? two_shot : one_shot, 0, stream);
}

int ll128_shots(int64_t bytes, int group) {
  static const int64_t forced = env_or("PK_JAX_AR_LL128_SHOTS", 0, 0, 2);
  static const int64_t two_shot_min = env_or("PK_JAX_AR_LL128_TWO_SHOT_MIN_BYTES", kLL128TwoShotMinBytes, 1, kChunkedBytes);
  if (ll128_lines(bytes) < group) return 1;  // two-shot needs a line for every owner
  if (forced) return int(forced);
  return group >= 3 && bytes >= two_shot_min ? 2 : 1;
}

std::vector<const void*> ll128_kernels() {
  std::vector<const void*> out;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (int shots : {1, 2}) out.push_back(ll128_kernel(dt, shots));
  return out;
}

}  // namespace pk
