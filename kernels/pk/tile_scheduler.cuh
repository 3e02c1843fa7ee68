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
