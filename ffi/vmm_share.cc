#include "vmm_share.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "driver_api.h"

namespace pk::vmm {
namespace {

constexpr const char* kPrefix = "pk_jax-vmm/1 ";

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%" PRIx64, v);
  return buf;
}

std::string driver_error(CUresult r) {
  const char* msg = nullptr;
  if (driver::api().get_error_string(r, &msg) != CUDA_SUCCESS || msg == nullptr)
    return "CUresult " + std::to_string(int(r));
  return msg;
}

[[noreturn]] void bad(const std::string& what) {
  throw std::runtime_error("pk_jax: malformed virtual-memory region descriptor: " + what);
}

// Parses the unsigned decimal at s[pos..]; advances pos past it.
uint64_t parse_number(const std::string& s, size_t& pos, const char* what) {
  const size_t start = pos;
  uint64_t v = 0;
  while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9') {
    const uint64_t d = uint64_t(s[pos] - '0');
    if (v > (UINT64_MAX - d) / 10) bad(std::string(what) + " overflows");
    v = v * 10 + d;
    ++pos;
  }
  if (pos == start) bad(std::string("expected a number for ") + what + " at byte " + std::to_string(start));
  return v;
}

void expect(const std::string& s, size_t& pos, const char* token) {
  const size_t n = std::strlen(token);
  if (s.compare(pos, n, token) != 0) bad(std::string("expected '") + token + "' at byte " + std::to_string(pos));
  pos += n;
}

// The driver side of the walk, on the current device.
class DriverQuery final : public MappingQuery {
 public:
  explicit DriverQuery(CUdevice device) : device_(device) {}
  bool mapping(uint64_t addr, uint64_t& base, uint64_t& size) override {
    CUdeviceptr b = 0;
    size_t s = 0;
    if (driver::api().mem_get_address_range(&b, &s, CUdeviceptr(addr)) != CUDA_SUCCESS) return false;
    base = b;
    size = s;
    return true;
  }
  std::string shareable(uint64_t base) override {
    CUmemAllocationProp prop = {};
    const std::string why = properties(base, prop);
    if (!why.empty()) return why;
    if (prop.type != CU_MEM_ALLOCATION_TYPE_PINNED || prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
      return "the allocation at " + hex(base) + " is not pinned device memory";
    if (prop.location.id != int(device_))
      return "the allocation at " + hex(base) + " lives on device " + std::to_string(prop.location.id) +
             ", not ours (" + std::to_string(int(device_)) + ")";
    if (!(unsigned(prop.requestedHandleTypes) & unsigned(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)))
      return "the allocation at " + hex(base) + " was not created with POSIX-fd handles (handle types " +
             hex(unsigned(prop.requestedHandleTypes)) + ")";
    return "";
  }
  // The allocation properties of the mapping at `addr` ("" on success, else why not).
  static std::string properties(uint64_t addr, CUmemAllocationProp& prop) {
    const auto& s = driver::share_api();
    CUmemGenericAllocationHandle h = 0;
    const CUresult r = s.mem_retain_allocation_handle(&h, reinterpret_cast<void*>(addr));
    if (r != CUDA_SUCCESS)
      return "cuMemRetainAllocationHandle(" + hex(addr) + "): " + driver_error(r) + " (not virtual-memory memory?)";
    const CUresult p = s.mem_get_allocation_properties_from_handle(&prop, h);
    driver::api().mem_release(h);  // the retain's reference
    if (p != CUDA_SUCCESS) return "cuMemGetAllocationPropertiesFromHandle: " + driver_error(p);
    return "";
  }

 private:
  CUdevice device_;
};

void close_all(std::vector<int>& fds) {
  for (int fd : fds)
    if (fd >= 0) ::close(fd);
  fds.clear();
}

}  // namespace

bool walk_chunks(MappingQuery& q, uint64_t ptr, uint64_t max_bytes, uint64_t alignment, RegionLayout& out,
                 std::string& why_not) {
  uint64_t base = 0, size = 0;
  if (!q.mapping(ptr, base, size) || size == 0 || ptr < base || ptr - base >= size) {
    why_not = "no virtual-memory mapping holds " + hex(ptr);
    return false;
  }
  auto misaligned = [&](uint64_t b, uint64_t s) {
    return alignment != 0 && (b % alignment != 0 || s % alignment != 0);
  };
  const std::string why = q.shareable(base);
  if (!why.empty()) {
    why_not = why;
    return false;
  }
  if (misaligned(base, size)) {
    why_not = "the mapping at " + hex(base) + " (" + std::to_string(size) +
              " bytes) is not aligned to the granularity " + std::to_string(alignment);
    return false;
  }
  std::vector<std::pair<uint64_t, uint64_t>> runs{{base, size}};  // address order
  uint64_t lo = base, hi = base + size;
  // A neighbour joins when it is contiguous, within the cap and shareable memory of our device.
  auto joins = [&](uint64_t b, uint64_t s, uint64_t new_lo, uint64_t new_hi) {
    return max_bytes != 0 && new_hi - new_lo <= max_bytes && runs.size() < kMaxChunks && !misaligned(b, s) &&
           q.shareable(b).empty();
  };
  for (;;) {  // forward: XLA maps a grown region after its first chunk
    uint64_t b = 0, s = 0;
    if (!q.mapping(hi, b, s) || b != hi || s == 0 || hi + s < hi || !joins(b, s, lo, hi + s)) break;
    runs.emplace_back(b, s);
    hi += s;
  }
  while (lo > 0) {  // backward
    uint64_t b = 0, s = 0;
    if (!q.mapping(lo - 1, b, s) || s == 0 || b + s != lo || !joins(b, s, b, hi)) break;
    runs.insert(runs.begin(), {b, s});
    lo = b;
  }
  out = RegionLayout{};
  out.begin = lo;
  out.size = hi - lo;
  out.alignment = alignment;
  for (const auto& [b, s] : runs) out.chunks.push_back({b - lo, s});
  return true;
}

std::string encode_descriptor(const RegionLayout& r) {
  std::string s = std::string(kPrefix) + "size=" + std::to_string(r.size) + " align=" + std::to_string(r.alignment) +
                  " chunks=";
  for (size_t i = 0; i < r.chunks.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(r.chunks[i].offset) + "+" + std::to_string(r.chunks[i].size);
  }
  return s;
}

bool is_descriptor(const std::string& handle) { return handle.compare(0, std::strlen(kPrefix), kPrefix) == 0; }

RegionLayout decode_descriptor(const std::string& s) {
  if (!is_descriptor(s)) bad("it does not start with '" + std::string(kPrefix) + "'");
  RegionLayout r;
  size_t pos = std::strlen(kPrefix);
  expect(s, pos, "size=");
  r.size = parse_number(s, pos, "size");
  expect(s, pos, " align=");
  r.alignment = parse_number(s, pos, "align");
  expect(s, pos, " chunks=");
  uint64_t next = 0;
  for (;;) {
    Chunk c;
    c.offset = parse_number(s, pos, "chunk offset");
    expect(s, pos, "+");
    c.size = parse_number(s, pos, "chunk size");
    if (c.offset != next) bad("chunk " + std::to_string(r.chunks.size()) + " is not contiguous with the one before");
    if (c.size == 0) bad("chunk " + std::to_string(r.chunks.size()) + " is empty");
    if (r.alignment == 0 || c.offset % r.alignment != 0 || c.size % r.alignment != 0)
      bad("chunk " + std::to_string(r.chunks.size()) + " is not a multiple of the alignment");
    if (c.offset + c.size < c.offset) bad("chunk sizes overflow");
    next = c.offset + c.size;
    r.chunks.push_back(c);
    if (r.chunks.size() > kMaxChunks) bad("more than " + std::to_string(kMaxChunks) + " chunks");
    if (pos == s.size()) break;
    expect(s, pos, ",");
  }
  if (next != r.size)
    bad("the chunks cover " + std::to_string(next) + " bytes, not the region's " + std::to_string(r.size));
  return r;
}

bool export_region(const void* ptr, uint64_t max_bytes, Exported& out, std::string& why_not) {
  out = Exported{};
  try {
    const auto& s = driver::share_api();
    int ordinal = 0;
    if (cudaGetDevice(&ordinal) != cudaSuccess) {
      cudaGetLastError();
      why_not = "no current device";
      return false;
    }
    CUdevice device = 0;
    if (const CUresult r = s.device_get(&device, ordinal); r != CUDA_SUCCESS) {
      why_not = "cuDeviceGet: " + driver_error(r);
      return false;
    }
    // The granularity of the probe's allocation: every chunk and mapping offset is a multiple of it.
    CUmemAllocationProp prop = {};
    const uint64_t addr = reinterpret_cast<uint64_t>(ptr);
    if (std::string why = DriverQuery::properties(addr, prop); !why.empty()) {
      why_not = why;
      return false;
    }
    size_t granularity = 0;
    if (const CUresult r = driver::api().mem_get_allocation_granularity(&granularity, &prop,
                                                                         CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        r != CUDA_SUCCESS || granularity == 0) {
      why_not = "cuMemGetAllocationGranularity: " + (r != CUDA_SUCCESS ? driver_error(r) : std::string("zero"));
      return false;
    }
    DriverQuery q(device);
    if (!walk_chunks(q, addr, max_bytes, granularity, out.layout, why_not)) return false;
    for (const Chunk& c : out.layout.chunks) {
      const uint64_t at = out.layout.begin + c.offset;
      CUmemGenericAllocationHandle h = 0;
      if (const CUresult r = s.mem_retain_allocation_handle(&h, reinterpret_cast<void*>(at)); r != CUDA_SUCCESS) {
        why_not = "cuMemRetainAllocationHandle(" + hex(at) + "): " + driver_error(r);
        close_all(out.fds);
        return false;
      }
      int fd = -1;
      const CUresult r = s.mem_export_to_shareable_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      driver::api().mem_release(h);  // the retain's reference; the fd keeps its own
      if (r != CUDA_SUCCESS || fd < 0) {
        why_not = "cuMemExportToShareableHandle(POSIX_FD) of the chunk at " + hex(at) + ": " +
                  (r != CUDA_SUCCESS ? driver_error(r) : std::string("no fd"));
        close_all(out.fds);
        return false;
      }
      out.fds.push_back(fd);
    }
    return true;
  } catch (const std::exception& e) {  // a missing driver entry point
    close_all(out.fds);
    why_not = e.what();
    return false;
  }
}

ImportedRegion::ImportedRegion(const std::string& descriptor, const std::vector<int>& fds,
                               const std::vector<int>& ordinals)
    : layout_(decode_descriptor(descriptor)) {
  if (fds.size() != layout_.chunks.size())
    throw std::runtime_error("pk_jax: a peer's virtual-memory region has " + std::to_string(layout_.chunks.size()) +
                             " chunks but " + std::to_string(fds.size()) + " fds arrived");
  if (ordinals.empty()) throw std::runtime_error("pk_jax: importing a peer's region needs a local GPU");
  try {
    const auto& s = driver::share_api();
    const auto& d = driver::api();
    for (int fd : fds) {
      CUmemGenericAllocationHandle h = 0;
      driver::check(s.mem_import_from_shareable_handle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                    "cuMemImportFromShareableHandle(POSIX_FD)");
      handles_.push_back(h);
    }
    CUdeviceptr va = 0;
    driver::check(d.mem_address_reserve(&va, layout_.size, layout_.alignment, 0, 0), "cuMemAddressReserve");
    va_ = va;
    for (const Chunk& c : layout_.chunks) {
      driver::check(d.mem_map(CUdeviceptr(va_ + c.offset), c.size, 0, handles_[mapped_], 0), "cuMemMap");
      ++mapped_;
    }
    std::vector<CUmemAccessDesc> access;
    for (int ordinal : ordinals) {
      CUdevice dev = 0;
      driver::check(s.device_get(&dev, ordinal), "cuDeviceGet");
      CUmemAccessDesc a = {};
      a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      a.location.id = int(dev);
      a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      access.push_back(a);
    }
    driver::check(d.mem_set_access(CUdeviceptr(va_), layout_.size, access.data(), access.size()), "cuMemSetAccess");
  } catch (...) {
    release();
    throw;
  }
}

ImportedRegion::~ImportedRegion() { release(); }

void ImportedRegion::release() noexcept {
  try {
    const auto& d = driver::api();
    for (size_t i = mapped_; i-- > 0;) d.mem_unmap(CUdeviceptr(va_ + layout_.chunks[i].offset), layout_.chunks[i].size);
    mapped_ = 0;
    if (va_) d.mem_address_free(CUdeviceptr(va_), layout_.size);
    va_ = 0;
    for (uint64_t h : handles_) d.mem_release(CUmemGenericAllocationHandle(h));
    handles_.clear();
  } catch (...) {
    // Best effort: called from a destructor and from a failed constructor (which rethrows its own error).
  }
}

}  // namespace pk::vmm
