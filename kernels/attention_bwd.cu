// Instantiations of the attention backward kernel: bf16 / f16 x head_dim 64 / 128 x variant (base, dqfirst,
// l2order_dqfirst, w3: attention_bwd_kernel.cuh), each with its DEBUG build; l2order_dqfirst and w3 also with the
// GQA head split (SPLIT).
#include "attention_bwd.cuh"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "attention_bwd_dq.cuh"
#include "attention_bwd_kernel.cuh"
#include "attention_shape.cuh"
#include "pk/device_setup.h"

namespace pk::attention_bwd {
namespace {

constexpr size_t kSmemLimit = 227 * 1024;  // per-block dynamic shared memory on sm_90

// As many Q/dO stages as fit beside K, V, the dSᵀ buffers and the dQ slots (at most 4); w3 at D 64: 192 keys and
// three dQ slots.
template <int D, int VARIANT>
constexpr int stages_for() {
  constexpr size_t wgs = VARIANT == 3 && D == 64 ? 3 : 2, keys = 64 * wgs;
  constexpr size_t stage = size_t(2) * 64 * D * 2 + 1024;  // Q and dO tiles, lse2 / delta
  constexpr size_t fixed = 2 * keys * D * 2 + 2 * keys * 64 * 2 + wgs * 64 * 64 * 4 + 2048;  // K, V, dS, dQ
  constexpr size_t n = (kSmemLimit - 1024 - fixed) / stage;
  return n > 4 ? 4 : int(n);
}

// DEBUG: the variant whose mbarrier waits time out, report and trap (attention_bwd_kernel.cuh).
template <typename T, int D, bool DEBUG = false, int VARIANT = 0, bool SPLIT = false>
using KernelOf = Kernel<T, D, stages_for<D, VARIANT>(), DEBUG, VARIANT, SPLIT>;

// The debug variant's wait limit in ns when $PK_JAX_ATTENTION_BWD_DEBUG is set to anything but "" or "0"
// ($PK_JAX_ATTENTION_BWD_TIMEOUT_MS, default 2000), else 0: the default kernel. Read at every launch.
unsigned long long debug_timeout_ns() {
  const char* on = std::getenv("PK_JAX_ATTENTION_BWD_DEBUG");
  if (on == nullptr || on[0] == '\0' || std::strcmp(on, "0") == 0) return 0;
  unsigned long long ms = 2000;
  if (const char* t = std::getenv("PK_JAX_ATTENTION_BWD_TIMEOUT_MS")) {
    const unsigned long long v = std::strtoull(t, nullptr, 10);
    if (v > 0) ms = v;
  }
  return ms * 1000000ull;
}

template <typename T, int D, bool DEBUG, int VARIANT, bool SPLIT>
void run(const Problem& p, int compute_sms, cudaStream_t stream, unsigned long long timeout_ns) {
  using K = KernelOf<T, D, DEBUG, VARIANT, SPLIT>;
  static_assert(lcsc::smem_bytes<K>() <= kSmemLimit, "shared memory");
  static_assert(K::STAGES >= 2, "at least two Q/dO stages");
  Globals g{};
  const int q_rows = p.q_rows > 0 ? p.q_rows : p.tq;
  g.q = make_tensor_map_bthd(p.q, p.type, p.batch, q_rows, p.heads, D, K::BM);
  g.dout = make_tensor_map_bthd(p.dout, p.type, p.batch, q_rows, p.heads, D, K::BM);
  g.q_row0 = p.q_row0;
  g.dq_direct = p.dq_state != nullptr ? 1 : 0;
  if (g.dq_direct) {
    g.dq_state = make_tensor_map_bthd(p.dq_state, ElemType::kF32, p.batch, p.dq_state_rows, p.heads, D, 64);
    g.dq_row0 = p.dq_row0;
  }
  g.k = make_tensor_map_bthd(p.k, p.type, p.batch, p.tk, p.kv_heads, D, K::BN);
  g.v = make_tensor_map_bthd(p.v, p.type, p.batch, p.tk, p.kv_heads, D, K::BN);
  g.lse2 = p.lse2, g.delta = p.delta, g.dq_acc = p.dq_acc, g.dk = p.dk, g.dv = p.dv;
  g.head_split = p.head_split, g.dkv_acc = p.dkv_acc;
  g.offsets = p.offsets;
  g.batch = p.batch, g.tq = p.tq, g.tk = p.tk, g.heads = p.heads, g.kv_heads = p.kv_heads, g.tq_pad = p.tq_pad;
  g.scale = p.scale;
  g.scale_log2 = p.scale * 1.4426950408889634f;
  g.causal = p.causal ? 1 : 0;
  g.num_comm_sms = 0;
  g.debug_timeout_ns = timeout_ns;
  cudaError_t e = cudaSuccess;
  if (!g.dq_direct) {
    const size_t acc_bytes = size_t(p.batch) * p.heads * p.tq_pad * D * sizeof(float);
    e = cudaMemsetAsync(p.dq_acc, 0, acc_bytes, stream);
    if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax attention backward: zeroing dQ: ") + cudaGetErrorString(e));
  }
  const size_t kv_elems = size_t(p.batch) * p.tk * p.kv_heads * D;
  if (p.head_split > 1) {
    e = cudaMemsetAsync(p.dkv_acc, 0, 2 * kv_elems * sizeof(float), stream);
    if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax attention backward: zeroing dK / dV: ") + cudaGetErrorString(e));
  }
  e = lcsc::launch<K>(g, compute_sms, stream);
  if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax attention backward launch: ") + cudaGetErrorString(e));
  if (p.head_split > 1) {
    e = launch_dkv_convert(p.dkv_acc, p.dk, p.dv, kv_elems, p.type, stream);
    if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax attention backward: dK / dV conversion: ") + cudaGetErrorString(e));
  }
}

template <typename T, int D, int VARIANT, bool SPLIT = false>
void run_variant(const Problem& p, int compute_sms, cudaStream_t stream) {
  const unsigned long long timeout_ns = debug_timeout_ns();
  if (timeout_ns) run<T, D, true, VARIANT, SPLIT>(p, compute_sms, stream, timeout_ns);
  else run<T, D, false, VARIANT, SPLIT>(p, compute_sms, stream, 0);
}

template <typename T, int D>
void run(const Problem& p, int compute_sms, cudaStream_t stream) {
  switch (p.variant) {
    case 0: run_variant<T, D, 0>(p, compute_sms, stream); return;
    case 1: run_variant<T, D, 1>(p, compute_sms, stream); return;
    case 2: return p.head_split > 1 ? run_variant<T, D, 2, true>(p, compute_sms, stream)
                                    : run_variant<T, D, 2>(p, compute_sms, stream);
    case 3: return p.head_split > 1 ? run_variant<T, D, 3, true>(p, compute_sms, stream)
                                    : run_variant<T, D, 3>(p, compute_sms, stream);
    default:
      throw std::invalid_argument("pk_jax attention backward: variant " + std::to_string(p.variant) + " is not 0..3");
  }
}

template <typename T, int VARIANT, bool SPLIT = false>
cudaError_t configure_variant() {
  cudaError_t e = lcsc::configure<KernelOf<T, 64, false, VARIANT, SPLIT>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, 128, false, VARIANT, SPLIT>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, 64, true, VARIANT, SPLIT>>();
  return e == cudaSuccess ? lcsc::configure<KernelOf<T, 128, true, VARIANT, SPLIT>>() : e;
}

template <typename T>
cudaError_t configure_type() {
  cudaError_t e = configure_variant<T, 0>();
  if (e == cudaSuccess) e = configure_variant<T, 1>();
  if (e == cudaSuccess) e = configure_variant<T, 2>();
  if (e == cudaSuccess) e = configure_variant<T, 3>();
  if (e == cudaSuccess) e = configure_variant<T, 2, true>();
  return e == cudaSuccess ? configure_variant<T, 3, true>() : e;
}

}  // namespace

cudaError_t configure() {
  cudaError_t e = configure_type<__nv_bfloat16>();
  if (e == cudaSuccess) e = configure_type<__half>();
  return e == cudaSuccess ? configure_dq_convert() : e;
}

cudaError_t configure_once(int ordinal) { return setup_status<configure>(ordinal); }

int num_sms(int ordinal) { return setup_sms<configure>(ordinal); }

void launch(const Problem& p, int compute_sms, cudaStream_t stream) {
  attention_shape::check("pk_jax attention backward", p.type, p.batch, p.tq, p.tk, p.heads, p.kv_heads, p.head_dim,
                         p.scale);
  if (p.tq_pad % 64 || p.tq_pad < p.tq || p.tq_pad - p.tq >= 64)
    throw std::invalid_argument("pk_jax attention backward: tq_pad (" + std::to_string(p.tq_pad) +
                                ") must be tq (" + std::to_string(p.tq) + ") rounded up to a multiple of 64");
  if (p.offsets == nullptr || p.lse2 == nullptr || p.delta == nullptr || (p.dq_acc == nullptr && p.dq_state == nullptr) ||
      p.dk == nullptr || p.dv == nullptr)
    throw std::invalid_argument("pk_jax attention backward: a buffer is missing");
  const int group = p.heads / p.kv_heads;
  if (p.head_split < 1 || group % p.head_split != 0 || (p.head_split > 1 && (p.dkv_acc == nullptr || p.variant < 2)))
    throw std::invalid_argument("pk_jax attention backward: head_split " + std::to_string(p.head_split) +
                                " must divide heads / kv_heads (" + std::to_string(group) +
                                "); above 1 it needs dkv_acc scratch and variant 2 or 3");
  if (p.q_rows < 0 || p.q_row0 < 0 || (p.q_rows > 0 ? p.q_rows : p.tq) < p.q_row0 + p.tq)
    throw std::invalid_argument("pk_jax attention backward: query rows [" + std::to_string(p.q_row0) + ", " +
                                std::to_string(p.q_row0 + p.tq) + ") are not within q's " + std::to_string(p.q_rows));
  if (p.dq_state != nullptr && (p.dq_row0 < 0 || p.dq_state_rows < p.dq_row0 + p.tq))
    throw std::invalid_argument("pk_jax attention backward: dQ rows [" + std::to_string(p.dq_row0) + ", " +
                                std::to_string(p.dq_row0 + p.tq) + ") are not within the state's " +
                                std::to_string(p.dq_state_rows));
  attention_shape::dispatch(p.type, p.head_dim, [&](auto t, auto d) {
    run<decltype(t), decltype(d)::value>(p, compute_sms, stream);
  });
}

}  // namespace pk::attention_bwd
