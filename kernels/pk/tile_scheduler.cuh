// Which output tile a persistent worker computes next. Tiles are visited in groups of `group_m`
// tile-rows, column by column inside a group, so the CTAs running at once share A rows and B columns
// in L2 instead of streaming the whole of B for every tile-row.
#pragma once

namespace pk {

struct TileGrid {
  int tiles_m, tiles_n, group_m;

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
