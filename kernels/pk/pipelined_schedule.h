// The chunk / round / flag schedule of the pipelined all_reduce ("small_pipelined",
// kernels/small_pipelined.cu): which 16-byte vectors of x each chunk covers, which CTA and round own a
// chunk, which flag announces it. Plain C++ (host and device) so the extension can hand the host side to
// Python: pk_jax/_pipelined_schedule.py mirrors every formula and tests/test_small_pipelined_cpu.py checks
// that the two agree and runs the schedule in tests/small_kernel_emulator.py.
//
// x (n bytes) is V = ceil(n / 16) vectors, the last one partial when n % 16 != 0.
//   one-shot (G = 2 by default): one slice, all of x; every member sums all G contributions.
//   two-shot (G > 2 by default): G slices of S = ceil(V / G) vectors (the last ones shorter or empty);
//     member o owns slice o: it sums it (reduce-scatter) and pushes the sum to every peer (all-gather).
// A slice is cut into C = ctas x rounds chunks of Q vectors (the last ones shorter or empty); chunk k of
// a slice belongs to CTA k % ctas in round k / ctas. Flags: stage 1 (the raw contributions) chunk k at
// index k, stage 2 (an owner's sums, two-shot) at C + k; every flag is written in every op, even for an
// empty chunk, so every pair exchanges in every op (the parity argument of docs/design-small-collectives.md).
#pragma once
#include <cstdint>

#include "control_block.h"

#ifdef __CUDACC__
#define PK_HD __host__ __device__ __forceinline__
#else
#define PK_HD inline
#endif

namespace pk {

constexpr int32_t kPipelinedMaxRounds = 16;
constexpr int32_t kPipelinedMaxLag = 15;
// Release points of one CTA (2 (rounds + lag) in two-shot): one CTA-local mbarrier each.
constexpr int32_t kPipelinedMaxReleasePoints = 2 * (kPipelinedMaxRounds + kPipelinedMaxLag);

// Tuning knobs (env, read once per process: PK_JAX_AR_PIPELINED_ROUNDS / _MIN_CHUNK / _MAX_CTAS / _LAG /
// _SHOTS). Out-of-range values are clamped by pipelined_geometry.
struct PipelinedKnobs {
  // rounds 1 / lag 0: every round costs a system fence per stage (4x H100, 1 MiB: 36.6 us at 4 / 2,
  // 20.6 at 1 / 0; docs/NOTES.md session 20), so more rounds never paid for their overlap.
  int32_t rounds = 1;        // chunks per CTA, pushed one after another
  int64_t min_chunk = 4096;  // bytes: fewer CTAs / rounds rather than smaller chunks
  int32_t max_ctas = 1024;   // besides the SM count and the flag area
  int32_t lag = 0;           // a CTA sums chunk i - lag after pushing chunk i
  int32_t shots = 0;         // 1: one-shot, 2: two-shot, 0: by group size (one-shot at G = 2)
};

struct PipelinedGeometry {
  int64_t vecs;    // V = ceil(n / 16)
  int64_t slice;   // S: V (one-shot) or ceil(V / G) (two-shot)
  int64_t chunk;   // Q: vectors per chunk
  int32_t ctas;
  int32_t rounds;
  int32_t lag;
  int32_t two_shot;

  PK_HD int32_t chunks() const { return ctas * rounds; }  // C, per slice
  PK_HD int32_t stages() const { return two_shot ? 2 : 1; }
  // Iterations of a CTA's data loop. Iteration i: push round i's chunk (i < rounds) and pass release point
  // rp(i, 0); sum round i - lag's chunk (two-shot: and push the sum to the peers) and pass rp(i, 1)
  // (two-shot only); (two-shot) copy round i - 2 lag's chunk of the other slices from their owners.
  PK_HD int32_t iters() const { return rounds + lag * stages(); }
  // Release points: where the data warps arrive and the signal warp then fences and sets flags, in order.
  PK_HD int32_t release_points() const { return two_shot ? 2 * (rounds + lag) : rounds; }
  // The release point of iteration i after its pushes (part 0) or after its sum (part 1, two-shot); -1: none.
  PK_HD int32_t release_point(int32_t i, int32_t part) const {
    if (!two_shot) return part == 0 && i < rounds ? i : -1;
    return i < rounds + lag ? 2 * i + part : -1;
  }
  // What release point rp announces: stage 0 (contributions) or 1 (an owner's sums) of `round`'s chunk;
  // round -1: nothing (the data warps still arrive there).
  PK_HD void released_by(int32_t rp, int32_t& stage, int32_t& round) const {
    stage = two_shot ? rp % 2 : 0;
    round = two_shot ? rp / 2 - stage * lag : rp;
    if (round < 0 || round >= rounds) round = -1;
  }
  PK_HD int32_t chunk_id(int32_t cta, int32_t round) const { return round * ctas + cta; }
  PK_HD int32_t flag_index(int32_t stage, int32_t k) const { return stage * chunks() + k; }
  // [v0, v1) of chunk k of owner o's slice (o = 0 in one-shot); empty (v0 == v1) past the end.
  PK_HD void chunk_range(int32_t owner, int32_t k, int64_t& v0, int64_t& v1) const {
    const int64_t base = two_shot ? int64_t(owner) * slice : 0;
    int64_t end = base + slice;
    end = end < vecs ? end : vecs;
    const int64_t b = base + int64_t(k) * chunk, e = b + chunk;
    v0 = b < end ? b : end;
    v1 = e < end ? e : end;
  }
};

PK_HD int64_t pipelined_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
PK_HD int64_t pipelined_clamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The schedule of an n-byte all_reduce over `group` members on GPUs with `num_sms` SMs: as many CTAs as
// `rounds` rounds of whole min_chunk-byte chunks fill, at most one per SM (every CTA resident: CTAs wait on
// the peers' CTAs) and within the flag area (stages x ctas x rounds <= kChunkedMaxChunks); then as many
// rounds (up to `rounds`) as keep chunks at min_chunk bytes or more. One CTA and one round below min_chunk.
PK_HD PipelinedGeometry pipelined_geometry(int64_t bytes, int32_t group, int32_t num_sms, const PipelinedKnobs& k) {
  PipelinedGeometry geo{};
  geo.vecs = pipelined_ceil_div(bytes, 16);
  geo.two_shot = k.shots == 2 || (k.shots != 1 && group > 2);
  geo.slice = geo.two_shot ? pipelined_ceil_div(geo.vecs, group) : geo.vecs;
  geo.lag = int32_t(pipelined_clamp(k.lag, 0, kPipelinedMaxLag));
  const int64_t rounds = pipelined_clamp(k.rounds, 1, kPipelinedMaxRounds);
  const int64_t min_vecs = pipelined_clamp(k.min_chunk / 16, 1, int64_t(1) << 40);
  int64_t cap = pipelined_clamp(k.max_ctas, 1, kChunkedMaxChunks);
  cap = cap < num_sms ? cap : num_sms;
  const int64_t flag_cap = kChunkedMaxChunks / (geo.stages() * rounds);
  cap = pipelined_clamp(cap < flag_cap ? cap : flag_cap, 1, kChunkedMaxChunks);
  geo.ctas = int32_t(pipelined_clamp(geo.slice / (rounds * min_vecs), 1, cap));
  geo.rounds = int32_t(pipelined_clamp(geo.slice / (geo.ctas * min_vecs), 1, rounds));
  geo.chunk = pipelined_ceil_div(geo.slice, int64_t(geo.ctas) * geo.rounds);
  if (geo.chunk < 1) geo.chunk = 1;
  return geo;
}

}  // namespace pk
