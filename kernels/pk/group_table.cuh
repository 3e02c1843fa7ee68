// Contiguous ragged groups of rows (jax.lax.ragged_dot's group_sizes), read from device memory by
// every CTA of a grouped GEMM at its start (no host round trip): each group's first row (prefix sums
// cut at the row count), its row tiles, and the groups ordered by size. Group E is the tail: the
// rows past sum(group_sizes), which a grouped GEMM's output holds as zeros.
#pragma once
#include <cstdint>

namespace pk {

constexpr int kMaxGroups = 256;

struct GroupTable {
  int start[kMaxGroups + 2];       // group e's rows are [start[e], start[e + 1]); e = E: the tail, start[E + 1] = rows
  int tile_start[kMaxGroups + 2];  // first row tile of group e (tiles of `bm` rows from the group's first row);
                                   // tile_start[E + 1] = all row tiles
  int pair_start[kMaxGroups + 1];  // with pairs: first pair of row tiles of group e (tiles 2i and 2i + 1 of a group
                                   // form pair i); pair_start[E] = the groups' pairs (the tail has none)
  int order[kMaxGroups];           // groups 0..E-1 by descending size (ties: lower index first)
  long long scan[kMaxGroups + 2];  // scratch

  // Every thread of the CTA (blockDim.x >= E + 2); ends with __syncthreads. bm = 0: no row tiles;
  // sort: fill `order`; pairs (with bm > 0): fill `pair_start`.
  __device__ void build(const int32_t* sizes, int num_groups, int rows, int bm, bool sort, bool pairs = false) {
    const int t = threadIdx.x, e_count = num_groups;
    if (t < e_count) scan[t] = sizes[t] > 0 ? sizes[t] : 0;  // negative sizes count as empty
    __syncthreads();
    inclusive_scan(e_count);
    if (t <= e_count) {
      const long long before = t == 0 ? 0 : scan[t - 1];  // rows of groups 0..t-1 (t = E: all of them)
      start[t] = int(before < rows ? before : rows);
    }
    if (t == 0) start[e_count + 1] = rows;
    __syncthreads();
    if (bm > 0) {
      if (t <= e_count) scan[t] = (start[t + 1] - start[t] + bm - 1) / bm;
      __syncthreads();
      inclusive_scan(e_count + 1);
      if (t <= e_count) tile_start[t + 1] = int(scan[t]);
      if (t == 0) tile_start[0] = 0;
      if (pairs) {
        __syncthreads();
        if (t < e_count) scan[t] = (tile_start[t + 1] - tile_start[t] + 1) / 2;
        __syncthreads();
        inclusive_scan(e_count);
        if (t < e_count) pair_start[t + 1] = int(scan[t]);
        if (t == 0) pair_start[0] = 0;
      }
    }
    if (sort && t < e_count) {
      const int mine = start[t + 1] - start[t];
      int rank = 0;
      for (int e = 0; e < e_count; ++e) {
        const int other = start[e + 1] - start[e];
        rank += (other > mine || (other == mine && e < t)) ? 1 : 0;
      }
      order[rank] = t;
    }
    __syncthreads();
  }

  // The group whose row tiles hold row tile `tile` (the last e in [0, E] with tile_start[e] <= tile;
  // empty groups own no tile).
  __device__ __forceinline__ int group_of_tile(int tile, int num_groups) const {
    return last_at_most(tile_start, tile, num_groups);
  }
  // The group whose pairs hold pair `pair` (< pair_start[E]).
  __device__ __forceinline__ int group_of_pair(int pair, int num_groups) const {
    return last_at_most(pair_start, pair, num_groups - 1);
  }

 private:
  // The last e in [0, hi] with firsts[e] <= v (firsts non-decreasing, firsts[0] <= v).
  __device__ __forceinline__ static int last_at_most(const int* firsts, int v, int hi) {
    int lo = 0;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (firsts[mid] <= v) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }
  // Hillis-Steele inclusive prefix sum of scan[0, count), count <= blockDim.x; every thread.
  __device__ void inclusive_scan(int count) {
    const int t = threadIdx.x;
    for (int off = 1; off < count; off <<= 1) {
      const long long v = (t < count && t >= off) ? scan[t - off] : 0;
      __syncthreads();
      if (t < count) scan[t] += v;
      __syncthreads();
    }
  }
};

}  // namespace pk
