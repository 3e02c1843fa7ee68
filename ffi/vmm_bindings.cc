// Python bindings of the host logic of POSIX-fd sharing (ffi/vmm_share.h) that CPU tests exercise: the
// chunk walk over a fake driver given as a list of mappings, and the region descriptor. Nothing here
// calls the CUDA driver.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "vmm_share.h"

namespace nb = nanobind;

namespace {

using Mapping = std::tuple<uint64_t, uint64_t, std::string>;  // base, size, why not shareable ("" if it is)

// The driver as a list of mappings; counts the queries (the walk must stop at the first refusal).
struct FakeQuery final : pk::vmm::MappingQuery {
  const std::vector<Mapping>& maps;
  int queries = 0;
  explicit FakeQuery(const std::vector<Mapping>& m) : maps(m) {}
  bool mapping(uint64_t addr, uint64_t& base, uint64_t& size) override {
    ++queries;
    for (const auto& [b, s, why] : maps)
      if (addr >= b && addr - b < s) {
        base = b;
        size = s;
        return true;
      }
    return false;
  }
  std::string shareable(uint64_t base) override {
    ++queries;
    for (const auto& [b, s, why] : maps)
      if (b == base) return why;
    return "no mapping starts at this base";
  }
};

std::vector<std::pair<uint64_t, uint64_t>> chunk_list(const pk::vmm::RegionLayout& r) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const auto& c : r.chunks) out.emplace_back(c.offset, c.size);
  return out;
}

}  // namespace

void bind_vmm(nb::module_& m) {
  m.attr("vmm_max_chunks") = pk::vmm::kMaxChunks;
  // (begin, size, [(offset, size)], why_not): why_not "" on success.
  m.def("vmm_walk_chunks", [](uint64_t ptr, uint64_t max_bytes, uint64_t alignment, const std::vector<Mapping>& maps) {
    FakeQuery q(maps);
    pk::vmm::RegionLayout r;
    std::string why;
    if (!pk::vmm::walk_chunks(q, ptr, max_bytes, alignment, r, why)) r = pk::vmm::RegionLayout{};
    return std::make_tuple(r.begin, r.size, chunk_list(r), why);
  }, nb::arg("ptr"), nb::arg("max_bytes"), nb::arg("alignment"), nb::arg("mappings"));
  m.def("vmm_encode_descriptor",
        [](uint64_t size, uint64_t alignment, const std::vector<std::pair<uint64_t, uint64_t>>& chunks) {
          pk::vmm::RegionLayout r;
          r.size = size;
          r.alignment = alignment;
          for (const auto& [o, s] : chunks) r.chunks.push_back({o, s});
          return pk::vmm::encode_descriptor(r);
        });
  // (size, alignment, [(offset, size)]); raises RuntimeError naming the defect.
  m.def("vmm_decode_descriptor", [](const std::string& text) {
    const pk::vmm::RegionLayout r = pk::vmm::decode_descriptor(text);
    return std::make_tuple(r.size, r.alignment, chunk_list(r));
  });
  m.def("vmm_is_descriptor",
        [](nb::bytes handle) { return pk::vmm::is_descriptor(std::string(handle.c_str(), handle.size())); });
}
