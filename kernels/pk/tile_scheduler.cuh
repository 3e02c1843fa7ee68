// Which output tile a persistent worker computes next. Tiles are visited in groups of `group_m`
// tile-rows, column by column inside a group, so the CTAs running at once share A rows and B columns
// in L2 instead of streaming the whole of B for every tile-row.
#pragma once
#include <algorithm>
#include <cmath>

namespace pk {

struct TileGrid {
  int tiles_m, tiles_n, group_m;

  // group_m for `workers` CTAs of bm x bn tiles: a square-ish L2 footprint of the tiles in flight
  // (group_m tile-rows by workers / group_m tile-columns).
  __host__ static int balanced_group_m(int workers, int bm, int bn, int tiles_m) {
    const int g = int(std::lround(std::sqrt(double(workers) * bn / bm)));
    return std::max(1, std::min(tiles_m, g));
  }

  __host__ __device__ int count() const { return tiles_m * tiles_n; }

  __device__ __forceinline__ int2 tile(int t) const {
    const int per_group = group_m * tiles_n;
    const int first = (t / per_group) * group_m;
    const int rows = min(tiles_m - first, group_m);
    const int r = t % per_group;
    return make_int2(first + r % rows, r / rows);
  }
};

// `count` tasks of kind B spread evenly through `total` positions (the rest kind A, in order): position t is
// B task number floor(t * count / total) when that count steps up at t + 1, else A task number t minus the Bs
// before it. A bijection onto (A 0 .. total - count - 1) and (B 0 .. count - 1). The grouped GEMM spreads its
// zero-fill tiles through its compute tiles this way so the stores overlap the MMAs.
struct SpreadOrder {
  int total, count;
  // -> (is_b ? 1 : 0, the task's index within its kind).
  __host__ __device__ int2 at(int t) const {
    const int b_before = int((long long)t * count / total);
    const bool is_b = int((long long)(t + 1) * count / total) > b_before;
    return make_int2(is_b ? 1 : 0, is_b ? b_before : t - b_before);
  }
};

// The tasks of one worker: worker, worker + workers, ... below total.
struct TaskRange {
  int first, stride, total;
  struct It {
    int t, stride;
    __device__ int operator*() const { return t; }
    __device__ It& operator++() {
      t += stride;
      return *this;
    }
    __device__ bool operator!=(const It& o) const { return t < o.t; }
  };
  __device__ It begin() const { return {first, stride}; }
  __device__ It end() const { return {total, stride}; }
};

}  // namespace pk
