// Sharing virtual-memory (cuMemCreate) allocations between the processes of one host by POSIX fd: what
// pk_jax does with XLA's allocator region when legacy CUDA IPC refuses it (XLA's VMM allocator creates its
// memory with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR and it is not legacy-IPC capable).
//
// Export: the region is the run of contiguous VMM mappings ("chunks") around the probe pointer. On a
// VMM address cuMemGetAddressRange gives the bounds of the one mapping that holds it, so the region is
// found by walking from mapping to mapping (forward, then backward) while the next one is contiguous,
// fd-shareable memory of our device, within `max_bytes` and kMaxChunks; every chunk is then exported
// (cuMemRetainAllocationHandle + cuMemExportToShareableHandle, the retained handle released at once).
// The peers get a text descriptor through the key-value store and the fds over the job's Unix
// sockets (fd_passing.h).
//
// Import: cuMemImportFromShareableHandle per fd, one VA reservation of the whole region, each chunk
// mapped at its offset, read/write access for every GPU of the importing process. The mapped base then
// goes through the same region machinery (set_region_delta) as a legacy-IPC region.
//
// The walk and the descriptor are pure host logic (unit-tested on CPU through a fake MappingQuery).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pk::vmm {

constexpr size_t kMaxChunks = 64;  // fds sent per region and peer; XLA's preallocated region is one chunk

struct Chunk {
  uint64_t offset = 0, size = 0;  // within the region
};

// A region as exported: [begin, begin + size) of the owner's address space, made of `chunks` (contiguous,
// from offset 0, sizes summing to `size`), each a multiple of `alignment` (the allocation granularity).
struct RegionLayout {
  uint64_t begin = 0, size = 0, alignment = 0;
  std::vector<Chunk> chunks;
};

// What the walk needs from the driver (a fake in tests).
class MappingQuery {
 public:
  virtual ~MappingQuery() = default;
  // The VMM mapping holding `addr`: false when none does (unmapped, or not device memory).
  virtual bool mapping(uint64_t addr, uint64_t& base, uint64_t& size) = 0;
  // "" when the mapping at `base` is fd-exportable VMM memory of our device; else why not.
  virtual std::string shareable(uint64_t base) = 0;
};

// The run of chunks around `ptr` (see the file comment). `max_bytes` caps the region (0: the probe's own
// chunk only). On failure returns false with `why_not` set.
bool walk_chunks(MappingQuery& q, uint64_t ptr, uint64_t max_bytes, uint64_t alignment, RegionLayout& out,
                 std::string& why_not);

// The descriptor peers receive ("pk_jax-vmm/1 size=<n> align=<n> chunks=<off>+<size>,..."): text, so a
// malformed one fails with a readable message. decode throws std::runtime_error naming the defect.
std::string encode_descriptor(const RegionLayout& r);
RegionLayout decode_descriptor(const std::string& text);
// Whether `handle` (a region handle of the key-value exchange) is such a descriptor.
bool is_descriptor(const std::string& handle);

// The CUDA driver side.
struct Exported {
  RegionLayout layout;
  std::vector<int> fds;  // one per chunk, owned by the caller (send them, then close them)
};
// Exports the region around `ptr` on the current device; false and `why_not` when it cannot.
bool export_region(const void* ptr, uint64_t max_bytes, Exported& out, std::string& why_not);

// A peer's region mapped here: unmapped, released and its VA range freed on destruction.
class ImportedRegion {
 public:
  // Imports `fds` (one per chunk of `descriptor`; not closed here) and maps them for `ordinals` (every GPU
  // of this process, the current one first). Throws std::runtime_error naming the failed driver call;
  // a failure undoes the steps taken.
  ImportedRegion(const std::string& descriptor, const std::vector<int>& fds, const std::vector<int>& ordinals);
  ~ImportedRegion();
  ImportedRegion(const ImportedRegion&) = delete;
  ImportedRegion& operator=(const ImportedRegion&) = delete;
  uint64_t address() const { return va_; }
  uint64_t size() const { return layout_.size; }

 private:
  void release() noexcept;
  RegionLayout layout_;
  uint64_t va_ = 0;
  std::vector<uint64_t> handles_;  // imported, one per chunk
  size_t mapped_ = 0;              // chunks mapped so far
};

}  // namespace pk::vmm
