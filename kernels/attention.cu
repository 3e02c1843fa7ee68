// Instantiations of the attention forward kernel: bf16 / f16 x head_dim 64 / 128 x in turn / pipelined, and
// the forward variants l2order / pingpong / fa3 / fa3n160 / fa3n176 / fa3w3 (attention_kernel.cuh), with bf16 DEBUG
// builds of the five that change the barrier protocol.
#include "attention.cuh"

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "pk/device_setup.h"
#include <stdexcept>
#include <string>
#include <type_traits>

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

// The wide-key variants: fa3n160 (160-key blocks) at D = 128 holds two stages only with the exact reserve
// (Q 32 KiB + 2 x 80 KiB + two O slots 32 KiB = 224 KiB, barriers and the 1 KiB alignment slack beside;
// lcsc::smem_bytes, asserted in run()), where the 4 KiB reserve of stages_for would leave one; fa3n176
// (176-key blocks, no O slots, a 1 KiB stub): Q 32 KiB + 2 x 88 KiB = 208 KiB.
template <int D, int BKV, bool O_SLOTS>
constexpr int stages_wide() {
  constexpr size_t stage = size_t(2) * BKV * D * 2;
  constexpr size_t fixed = size_t(128) * D * 2 + (O_SLOTS ? size_t(128) * D * 2 : 1024) + 2048;
  constexpr size_t n = (kSmemLimit - fixed) / stage;
  return n > 4 ? 4 : int(n);
}

// fa3w3 at D = 64: a 192-row Q tile and three output slots.
template <int D>
constexpr int stages_w3() {
  constexpr size_t stage = size_t(2) * 128 * D * 2;
  constexpr size_t fixed = size_t(192) * D * 2 * 2 + 4096;
  constexpr size_t n = (kSmemLimit - fixed) / stage;
  return n > 4 ? 4 : int(n);
}

template <int D, int VARIANT>
constexpr int stages_of() {
  if constexpr (VARIANT == kFwdFa3W3 && D == 64) return stages_w3<D>();
  else if constexpr (VARIANT == kFwdFa3N160) return stages_wide<D, 160, true>();
  else if constexpr (VARIANT == kFwdFa3N176) return stages_wide<D, 176, false>();
  else return stages_for<D>();
}

template <typename T, int D, bool PIPELINED, int VARIANT = kFwdDefault, bool DEBUG = false, int TAIL = 0>
using KernelOf = Kernel<T, D, stages_of<D, VARIANT>(), NoRing, PIPELINED, VARIANT, DEBUG, TAIL>;

// The short last key block fa3n160 takes at head_dim 128 (Kernel's TAIL): the keys of Tk's last 160-key block rounded
// up to 32 (32 / 64 / 96 / 128; 0: a full block, no short build), without a causal mask (every task then visits the
// same blocks) and where a task has >= 2 blocks. $PK_JAX_ATTENTION_FWD_TAIL=0 turns it off (read at every launch,
// for A/B runs); so does the DEBUG build (it has no short builds). block_keys: the kernel's BKV.
int short_tail_keys(const Problem& p, int block_keys) {
  if (p.causal) return 0;
  if (const char* v = std::getenv("PK_JAX_ATTENTION_FWD_TAIL"); v != nullptr && std::strcmp(v, "0") == 0) return 0;
  const int blocks = (p.tk + block_keys - 1) / block_keys;
  if (blocks < 2) return 0;
  const int rest = p.tk - (blocks - 1) * block_keys, keys = (rest + 31) / 32 * 32;
  return keys < block_keys ? keys : 0;
}

// The DEBUG builds' wait limit in ns when $PK_JAX_ATTENTION_FWD_DEBUG is set to anything but "" or "0"
// ($PK_JAX_ATTENTION_FWD_TIMEOUT_MS, default 2000), else 0 (the normal build). Read at every launch; only
// variants pingpong, fa3, fa3n160 and fa3n176 with bf16 have DEBUG builds.
unsigned long long debug_timeout_ns() {
  const char* on = std::getenv("PK_JAX_ATTENTION_FWD_DEBUG");
  if (on == nullptr || on[0] == '\0' || std::strcmp(on, "0") == 0) return 0;
  unsigned long long ms = 2000;
  if (const char* t = std::getenv("PK_JAX_ATTENTION_FWD_TIMEOUT_MS")) {
    const unsigned long long v = std::strtoull(t, nullptr, 10);
    if (v > 0) ms = v;
  }
  return ms * 1000000ull;
}

// Variants >= 1: (batch, head) pairs per task section, so that a section's K and V (bytes of its distinct
// kv heads) stay within kL2Budget of the 50 MB L2 while its query tiles are worked on (query heads that
// share a kv head count once: sections hold whole GQA groups).
constexpr long long kL2Budget = 16ll << 20;
int heads_per_section(const Problem& p, int d) {
  const long long kv_bytes = 2ll * p.tk * d * 2;  // K and V of one (batch, kv head), 16-bit
  long long kv = kL2Budget / (kv_bytes > 0 ? kv_bytes : 1);
  if (kv < 1) kv = 1;
  const long long pairs = (long long)p.batch * p.heads;
  long long h = kv * (p.heads / p.kv_heads);
  return int(h < pairs ? h : pairs);
}

template <typename T, int D, bool PIPELINED, int VARIANT = kFwdDefault, bool DEBUG = false, int TAIL = 0>
void run(const Problem& p, int compute_sms, cudaStream_t stream, unsigned long long timeout_ns = 0) {
  using K = KernelOf<T, D, PIPELINED, VARIANT, DEBUG, TAIL>;
  static_assert(lcsc::smem_bytes<K>() <= kSmemLimit, "shared memory");
  static_assert(K::STAGES >= 2, "at least two K/V stages");
  Globals g{};
  g.q = make_tensor_map_bthd(p.q, p.type, p.batch, p.tq, p.heads, D, K::BM);
  g.k = make_tensor_map_bthd(p.k, p.type, p.batch, p.tk, p.kv_heads, D, K::BKV);
  g.v = make_tensor_map_bthd(p.v, p.type, p.batch, p.tk, p.kv_heads, D, K::BKV);
  g.o = make_tensor_map_bthd(p.o, p.type, p.batch, p.tq, p.heads, D, 64);
  g.o_ptr = p.o;
  g.lse = p.lse;
  g.acc = p.acc;
  g.acc_mode = p.acc_mode;
  g.lse_seq = p.lse_seq > 0 ? p.lse_seq : p.tq;
  g.offsets = p.offsets;
  g.batch = p.batch, g.tq = p.tq, g.tk = p.tk, g.heads = p.heads, g.kv_heads = p.kv_heads;
  g.scale = p.scale;
  g.scale_log2 = p.scale * 1.4426950408889634f;
  g.causal = p.causal ? 1 : 0;
  g.num_comm_sms = 0;
  g.heads_per_section = heads_per_section(p, D);
  g.debug_timeout_ns = timeout_ns;
  const cudaError_t e = lcsc::launch<K>(g, compute_sms, stream);
  if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax attention launch: ") + cudaGetErrorString(e));
}

template <typename T, int D>
cudaError_t configure_dim() {
  cudaError_t e = lcsc::configure<KernelOf<T, D, false>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, true>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdL2Order>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdPingpong>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3N160>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3N176>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3W3>>();
  if constexpr (D == 128) {
    if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3N160, false, 32>>();
    if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3N160, false, 64>>();
    if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3N160, false, 96>>();
    if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3N160, false, 128>>();
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdPingpong, true>>();
    if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3, true>>();
    if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3N160, true>>();
    if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3N176, true>>();
    if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, D, false, kFwdFa3W3, true>>();
  }
  return e;
}

template <typename T>
cudaError_t configure_type() {
  const cudaError_t e = configure_dim<T, 64>();
  return e == cudaSuccess ? configure_dim<T, 128>() : e;
}

// fa3n160 with the short last block its keys call for (short_tail_keys), or none.
template <typename T, int D>
void run_fa3n160(const Problem& p, int compute_sms, cudaStream_t stream) {
  switch (short_tail_keys(p, KernelOf<T, D, false, kFwdFa3N160>::BKV)) {
    case 32: return run<T, D, false, kFwdFa3N160, false, 32>(p, compute_sms, stream);
    case 64: return run<T, D, false, kFwdFa3N160, false, 64>(p, compute_sms, stream);
    case 96: return run<T, D, false, kFwdFa3N160, false, 96>(p, compute_sms, stream);
    case 128: return run<T, D, false, kFwdFa3N160, false, 128>(p, compute_sms, stream);
    default: return run<T, D, false, kFwdFa3N160>(p, compute_sms, stream);
  }
}

template <typename T, int D>
void run_variant(const Problem& p, int compute_sms, cudaStream_t stream) {
  const unsigned long long timeout_ns = p.variant >= kFwdPingpong ? debug_timeout_ns() : 0;
  constexpr bool kHasDebug = std::is_same_v<T, __nv_bfloat16>;
  switch (p.variant) {
    case kFwdDefault:
      if (p.pipelined) run<T, D, true>(p, compute_sms, stream);
      else run<T, D, false>(p, compute_sms, stream);
      return;
    case kFwdL2Order:
      run<T, D, false, kFwdL2Order>(p, compute_sms, stream);
      return;
    case kFwdPingpong:
      if (kHasDebug && timeout_ns) run<T, D, false, kFwdPingpong, kHasDebug>(p, compute_sms, stream, timeout_ns);
      else run<T, D, false, kFwdPingpong>(p, compute_sms, stream);
      return;
    case kFwdFa3:
      if (kHasDebug && timeout_ns) run<T, D, false, kFwdFa3, kHasDebug>(p, compute_sms, stream, timeout_ns);
      else run<T, D, false, kFwdFa3>(p, compute_sms, stream);
      return;
    case kFwdFa3N160:
      if (kHasDebug && timeout_ns) run<T, D, false, kFwdFa3N160, kHasDebug>(p, compute_sms, stream, timeout_ns);
      else if constexpr (D == 128) run_fa3n160<T, D>(p, compute_sms, stream);
      else run<T, D, false, kFwdFa3N160>(p, compute_sms, stream);
      return;
    case kFwdFa3N176:
      if (kHasDebug && timeout_ns) run<T, D, false, kFwdFa3N176, kHasDebug>(p, compute_sms, stream, timeout_ns);
      else run<T, D, false, kFwdFa3N176>(p, compute_sms, stream);
      return;
    case kFwdFa3W3:
      if (kHasDebug && timeout_ns) run<T, D, false, kFwdFa3W3, kHasDebug>(p, compute_sms, stream, timeout_ns);
      else run<T, D, false, kFwdFa3W3>(p, compute_sms, stream);
      return;
    default:
      throw std::invalid_argument("pk_jax attention: forward variant " + std::to_string(p.variant) + " is not 0..6");
  }
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
  if (p.acc_mode < 0 || p.acc_mode > 2) throw std::invalid_argument("pk_jax attention: acc_mode must be 0, 1 or 2");
  if (p.acc_mode != 0 && (p.acc == nullptr || p.lse == nullptr || p.lse_seq < p.tq))
    throw std::invalid_argument("pk_jax attention: an accumulating call needs acc, lse and lse_seq >= tq");
  attention_shape::dispatch(p.type, p.head_dim, [&](auto t, auto d) {
    run_variant<decltype(t), decltype(d)::value>(p, compute_sms, stream);
  });
}

}  // namespace pk::attention
