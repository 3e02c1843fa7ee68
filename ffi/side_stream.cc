#include "side_stream.h"

#include <map>
#include <memory>
#include <stdexcept>
#include <string>

namespace pk {
namespace {

std::mutex table_mutex;

std::map<int, std::unique_ptr<SideStream>>& table() {
  static auto* t = new std::map<int, std::unique_ptr<SideStream>>();  // never destroyed: handlers may run at exit
  return *t;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax side stream: ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

SideStream& side_stream(int ordinal) {
  std::lock_guard<std::mutex> lock(table_mutex);
  auto& slot = table()[ordinal];
  if (slot) return *slot;
  int prev = 0;
  check(cudaGetDevice(&prev), "cudaGetDevice");
  check(cudaSetDevice(ordinal), "cudaSetDevice");
  auto s = std::make_unique<SideStream>();
  int least = 0, greatest = 0;
  cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&s->stream, cudaStreamNonBlocking, greatest);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s->main_ready, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s->side_done, cudaEventDisableTiming);
  cudaSetDevice(prev);
  check(e, "creating the stream and its events");
  slot = std::move(s);
  return *slot;
}

SideStream* existing_side_stream(int ordinal) {
  std::lock_guard<std::mutex> lock(table_mutex);
  const auto it = table().find(ordinal);
  return it == table().end() ? nullptr : it->second.get();
}

}  // namespace pk
