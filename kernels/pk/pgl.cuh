// Parallel Global Layout: the same logical tensor on every member of a group. `ptr[r]` is the
// address of member r's copy in this device's address space (peer-mapped), so a kernel indexes a
// PGL by (device, element offset) and the layout helpers (box.cuh) turn tile/row coordinates into
// element offsets.
#pragma once
#include "control_block.h"

namespace pk {

template <typename T>
struct pgl {
  T* ptr[kMaxGroup];
  int size;
  __device__ T* operator[](int r) const { return ptr[r]; }
  template <typename U>
  __device__ pgl<U> as() const {
    pgl<U> out;
#pragma unroll
    for (int i = 0; i < kMaxGroup; ++i) out.ptr[i] = reinterpret_cast<U*>(ptr[i]);
    out.size = size;
    return out;
  }
};

}  // namespace pk
