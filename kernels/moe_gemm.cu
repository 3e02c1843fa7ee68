// Instantiations of DispatchMatmul (kernels/moe_gemm_kernel.cuh) and its host launch.
#include "moe_gemm.cuh"

#include <climits>
#include <stdexcept>
#include <string>

#include "moe_gemm_kernel.cuh"

namespace pk::moe {
namespace {

constexpr size_t kSmemLimit = 227 * 1024;  // per-block dynamic shared memory on sm_90
constexpr int kBN = 256;                   // 128x256 tiles (F = 2048: 8 per half); F not a multiple is clipped

// As many stages as fit beside the output slots and the group table (as grouped_gemm.cu's stages_for).
template <typename T>
constexpr int stages() {
  constexpr size_t stage = size_t(64 * 2 * 64 + 64 * kBN) * sizeof(T);
  constexpr size_t fixed = size_t(2) * 64 * kBN * sizeof(T) + grouped::kSharedExtBytes + 2048 + 1024;
  constexpr size_t n = (kSmemLimit - fixed) / stage;
  return n > 8 ? 8 : int(n);
}

template <typename T>
using KernelOf = Kernel<T, kBN, stages<T>()>;

template <typename T>
void run(const Problem& p, cudaStream_t stream) {
  using K = KernelOf<T>;
  static_assert(K::STAGES >= 3, "pipeline depth");
  static_assert(lcsc::smem_bytes<K>() <= kSmemLimit, "shared memory");
  static_assert(sizeof(CommShared) <= sizeof(typename K::Shared), "comm CTAs reuse the compute CTAs' memory");
  const int G = p.group.size, L = p.dims.experts / G;
  const int64_t R = p.dims.recv_rows;
  Globals g{};
  const void* w[2] = {p.w_gate, p.w_up};
  void* out[2] = {p.gate, p.up};
  const int tiles_m = int((R + K::BM - 1) / K::BM);
  for (int h = 0; h < 2; ++h) {
    grouped::Globals& gh = g.half[h];
    gh.a = make_tensor_map_2d(p.recv, p.type, R, p.hidden, p.hidden, K::BM, K::kBoxCols);
    gh.b = make_tensor_map_3d(w[h], p.type, L, p.hidden, p.ffn, K::BK, K::kBoxCols);  // (k, n) boxes 64 x 64
    gh.c = make_tensor_map_2d(out[h], p.type, R, p.ffn, p.ffn, 64, K::kOutBoxCols);
    gh.group_sizes = p.totals;
    gh.out = out[h];
    gh.tokens = int(R), gh.m = 0, gh.n = p.ffn, gh.k = p.hidden;
    gh.num_groups = L;
    gh.tiles_m = tiles_m;
    gh.tiles_n = (p.ffn + K::BN - 1) / K::BN;
  }
  g.group = p.group;
  g.d = p.dims;
  g.x = static_cast<const char*>(p.x);
  g.key = p.key, g.pos = p.pos, g.order = p.order;
  g.recv = static_cast<char*>(p.recv);
  g.recv_counts = p.recv_counts, g.totals = p.totals, g.send_row = p.send_row;
  g.tiles_n = 2 * g.half[0].tiles_n;
  g.group_m = TileGrid::balanced_group_m(p.num_sms, K::BM, K::BN, tiles_m);
  // Each expert adds at most one partial row tile to ceil(R / BM), plus the tail.
  const long long tasks = ((long long)tiles_m + L + 1) * g.tiles_n;
  if (tasks > INT_MAX) throw std::invalid_argument("pk_jax moe dispatch_matmul: too many tiles for one launch");
  g.max_tasks = int(tasks);
  g.num_comm_sms = p.num_comm_sms;
  const cudaError_t err = lcsc::launch<K>(g, p.num_sms - p.num_comm_sms, stream);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("pk_jax moe dispatch_matmul launch: ") + cudaGetErrorString(err));
}

}  // namespace

const char* unsupported(const Problem& p) {
  const MoeDims& d = p.dims;
  const int G = p.group.size;
  if (p.type == ElemType::kF32) return "x and the expert weights must be bfloat16 or float16";
  if (G < 2 || d.experts < G || d.experts % G != 0 || d.experts > kMoeMaxExperts)
    return "num_experts must be a multiple of the group size (2..8 members), at most 1024";
  if (d.experts / G > kMaxGroups) return "at most 256 local experts per member (the GEMM's group table)";
  if (p.hidden <= 0 || p.hidden % 8 || p.ffn <= 0 || p.ffn % 8)
    return "hidden and ffn must be positive multiples of 8 (16-byte rows for the pushes and TMA)";
  if (d.tokens <= 0 || d.top_k < 1 || d.recv_rows < 1 || d.recv_rows > INT_MAX / kMaxGroup)
    return "tokens, top_k and recv_rows must be positive (recv_rows * 8 must fit int32)";
  if (p.num_comm_sms < 1 || p.num_comm_sms >= p.num_sms)
    return "num_comm_sms must be at least 1 and leave an SM for the GEMM (PK_JAX_MOE_OVERLAP_SMS)";
  return "";
}

cudaError_t configure() {
  const cudaError_t e = lcsc::configure<KernelOf<__nv_bfloat16>>();
  return e == cudaSuccess ? lcsc::configure<KernelOf<__half>>() : e;
}

void launch(const Problem& p, cudaStream_t stream) {
  if (const char* why = unsupported(p); *why)
    throw std::invalid_argument(std::string("pk_jax moe dispatch_matmul: ") + why);
  if (p.type == ElemType::kBF16) run<__nv_bfloat16>(p, stream);
  else run<__half>(p, stream);
}

}  // namespace pk::moe
