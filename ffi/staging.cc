#include "staging.h"

#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace pk {
namespace {

std::atomic<uint64_t> staged{0};

bool inside(const LocalDevice& d, uintptr_t p, size_t bytes) {
  for (const auto& r : d.regions)
    if (p >= r.begin && p + bytes <= r.end) return true;
  return false;
}

}  // namespace

uint64_t staged_buffers() { return staged.load(std::memory_order_relaxed); }

BufferStaging::BufferStaging(const LocalDevice& device, cudaStream_t stream, StagingWindow window)
    : d_(device), stream_(stream) {
  const size_t side = d_.staging_bytes / 4 / 256 * 256;
  begin_ = window == StagingWindow::kSide ? d_.staging_bytes - side : 0;
  end_ = window == StagingWindow::kSide ? d_.staging_bytes : d_.staging_bytes - side;
  used_ = begin_;
}

void* BufferStaging::reachable(void* p, size_t bytes, bool copy_in, bool copy_out) {
  if (!Runtime::get().multiprocess() || bytes == 0 || inside(d_, reinterpret_cast<uintptr_t>(p), bytes)) return p;
  const size_t at = (used_ + 255) / 256 * 256;
  if (at + bytes > end_)
    throw std::runtime_error("pk_jax: a buffer of " + std::to_string(bytes) +
                             " bytes lies outside the GPU memory the other processes mapped at pk_jax.initialize() "
                             "and the staging heap's window for this stream (" + std::to_string((end_ - begin_) >> 20) +
                             " MiB: " + (begin_ ? "the top quarter, for the ring shift" : "three quarters") + " of " +
                             std::to_string(d_.staging_bytes >> 20) +
                             " MiB) is too small for this call: raise PK_JAX_STAGING_MB (every buffer peers touch "
                             "in one op must fit; pk_jax.initialize() said why XLA's memory is not shared)");
  char* s = d_.staging + at;
  used_ = at + bytes;
  if (staged.fetch_add(1, std::memory_order_relaxed) == 0)
    std::fprintf(stderr, "pk_jax: a buffer outside the memory shared at start-up goes through the staging heap "
                         "(one copy each way); see pk_jax.runtime.stats()\n");
  if (copy_in) {
    const cudaError_t e = cudaMemcpyAsync(s, p, bytes, cudaMemcpyDeviceToDevice, stream_);
    if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax staging copy: ") + cudaGetErrorString(e));
  }
  if (copy_out) outs_.push_back({p, s, bytes});
  return s;
}

cudaError_t BufferStaging::copy_back() {
  for (const auto& o : outs_)
    if (cudaError_t e = cudaMemcpyAsync(o.dst, o.src, o.bytes, cudaMemcpyDeviceToDevice, stream_); e != cudaSuccess)
      return e;
  return cudaSuccess;
}

}  // namespace pk
