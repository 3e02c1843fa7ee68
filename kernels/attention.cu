// Instantiations of the attention forward kernel: bf16 / f16 x head_dim 64 / 128 x in turn / pipelined.
#include "attention.cuh"

#include <mutex>

#include "pk/device_setup.h"
#include <stdexcept>
#include <string>

#include "attention_kernel.cuh"
#include "attention_shape.cuh"

namespace pk::attention {
namespace {

constexpr size_t kSmemLimit = 227 * 1024;  // per-block dynamic shared memory on sm_90

// As many K/V stages as fit beside Q and the output slots (at most 4; 2 at head_dim 128, as FA3).
template <int D>
constexpr int stages_for() {
  constexpr size_t stage = size_t(2) * 128 * D * 2;          // K and V tiles of 128 keys
  constexpr size_t fixed = size_t(128) * D * 2 * 2 + 4096;  // Q tile, two output slots, barriers, alignment
  constexpr size_t n = (kSmemLimit - fixed) / stage;
  return n > 4 ? 4 : int(n);
}

template <typename T, int D, bool PIPELINED>
using KernelOf = Kernel<T, D, stages_for<D>(), NoRing, PIPELINED>;

template <typename T, int D, bool PIPELINED>
void run(const Problem& p, int compute_sms, cudaStream_t stream) {
  using K = KernelOf<T, D, PIPELINED>;
  static_assert(lcsc::smem_bytes<K>() <= kSmemLimit, "shared memory");
  static_assert(K::STAGES >= 2, "at least two K/V stages");
  Globals g{};
  g.q = make_tensor_map_bthd(p.q, p.type, p.batch, p.tq, p.heads, D, K::BM);
  g.k = make_tensor_map_bthd(p.k, p.type, p.batch, p.tk, p.kv_heads, D, K::BKV);
  g.v = make_tensor_map_bthd(p.v, p.type, p.batch, p.tk, p.kv_heads, D, K::BKV);
  g.o = make_tensor_map_bthd(p.o, p.type, p.batch, p.tq, p.heads, D, 64);
  g.lse = p.lse;
  g.offsets = p.offsets;
  g.batch = p.batch, g.tq = p.tq, g.tk = p.tk, g.heads = p.heads, g.kv_heads = p.kv_heads;
  g.scale = p.scale;
  g.scale_log2 = p.scale * 1.4426950408889634f;
  g.causal = p.causal ? 1 : 0;
  g.num_comm_sms = 0;
  const cudaError_t e = lcsc::launch<K>(g, compute_sms, stream);
  if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax attention launch: ") + cudaGetErrorString(e));
}

template <typename T, int D>
cudaError_t configure_dim() {
  const cudaError_t e = lcsc::configure<KernelOf<T, D, false>>();
  return e == cudaSuccess ? lcsc::configure<KernelOf<T, D, true>>() : e;
}

template <typename T>
cudaError_t configure_type() {
  const cudaError_t e = configure_dim<T, 64>();
  return e == cudaSuccess ? configure_dim<T, 128>() : e;
}

template <typename T, int D>
void run_variant(const Problem& p, int compute_sms, cudaStream_t stream) {
  if (p.pipelined) run<T, D, true>(p, compute_sms, stream);
  else run<T, D, false>(p, compute_sms, stream);
}

}  // namespace

cudaError_t configure() {
  const cudaError_t e = configure_type<__nv_bfloat16>();
  return e == cudaSuccess ? configure_type<__half>() : e;
}

cudaError_t configure_once(int ordinal) { return setup_status<configure>(ordinal); }

int num_sms(int ordinal) { return setup_sms<configure>(ordinal); }

void launch(const Problem& p, int compute_sms, cudaStream_t stream) {
  attention_shape::check("pk_jax attention", p.type, p.batch, p.tq, p.tk, p.heads, p.kv_heads, p.head_dim, p.scale);
  if (p.offsets == nullptr) throw std::invalid_argument("pk_jax attention: offsets buffer missing");
  attention_shape::dispatch(p.type, p.head_dim, [&](auto t, auto d) {
    run_variant<decltype(t), decltype(d)::value>(p, compute_sms, stream);
  });
}

}  // namespace pk::attention
