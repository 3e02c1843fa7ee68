// Symmetric memory: one equally sized region per device, each mapped so that every device of the
// set can load, store and atomically update it over NVLink (cuMem VMM with access granted to all).
// In one process the mapping address is the same on every device; a multi-process runtime maps the
// peers' exported handles instead and hands kernels the same kind of pointer table.
#pragma once
#include <cstddef>
#include <vector>

namespace pk {

class SymmetricRegion {
 public:
  // Allocates `bytes` (rounded up to the VMM granularity) on each device in `ordinals`.
  // Throws std::runtime_error saying how much was asked for and how to make room.
  SymmetricRegion(const std::vector<int>& ordinals, size_t bytes);
  ~SymmetricRegion();
  SymmetricRegion(const SymmetricRegion&) = delete;
  SymmetricRegion& operator=(const SymmetricRegion&) = delete;

  // Address of device i's region (i indexes `ordinals`), valid on every device of the set.
  void* at(size_t i) const { return ptrs_[i]; }
  size_t bytes() const { return bytes_; }

 private:
  std::vector<int> ordinals_;
  std::vector<void*> ptrs_;
  std::vector<unsigned long long> handles_;
  size_t bytes_ = 0;
};

}  // namespace pk
