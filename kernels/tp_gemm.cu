// Instantiations of the fused tensor-parallel GEMMs and their launch.
#include "tp_gemm.cuh"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "gemm.cuh"
#include "tp_gemm_kernel.cuh"

namespace pk::tp {
namespace {

template <int TILE>
constexpr int kBN = gemm::kTileShapes[TILE].cols;
template <int TILE>
constexpr int kStages = TILE == gemm::k128x256 ? 3 : 6;

template <typename T, int TILE, Kind KIND>
using ExtFor = std::conditional_t<
    KIND == kAllGatherMatmul, AllGatherMatmul,
    std::conditional_t<KIND == kAllGatherMatmulIntraSM, AllGatherMatmulIntraSM,
                       std::conditional_t<is_store_add(KIND), MatmulStoreAdd<is_all_reduce(KIND), T>,
                                          MatmulReduce<is_all_reduce(KIND), T>>>>;
// Store-add slots are padded rows (64 x (BN + 8) per consumer, plus the pusher's 8 KB ring) and the AG
// pushers keep a 16 KB ring: with either, 128x128 fits 5 stages, not 6.
template <int TILE, Kind KIND>
constexpr int kStagesFor = is_intra_sm(KIND) && TILE == gemm::k128x128 ? 5 : kStages<TILE>;
// W_NK: w stored (n, k), read in place as wᵀ (gemm::Kernel's B_NK).
template <typename T, int TILE, Kind KIND, bool W_NK = false>
using KernelFor = gemm::Kernel<T, T, 2, kBN<TILE>, kStagesFor<TILE, KIND>, ExtFor<T, TILE, KIND>, false, W_NK>;


template <typename T, int TILE, Kind KIND, bool W_NK>
void run(const Problem& p, cudaStream_t stream) {
  using K = KernelFor<T, TILE, KIND, W_NK>;
  static_assert(lcsc::smem_bytes<K>() <= 227 * 1024, "shared memory");
  const int G = p.group.size;
  Globals g{};
  const bool ag = is_all_gather(KIND);
  const int rows_a = ag ? G * p.m : p.m;  // rows of the GEMM's A and C
  g.a = make_tensor_map_2d(ag ? p.aux : p.x, p.type, rows_a, p.k, p.k, K::BM, K::kBoxCols);
  g.a_own = make_tensor_map_2d(p.x, p.type, p.m, p.k, p.k, K::BM, K::kBoxCols);
  g.b = W_NK ? make_tensor_map_2d(p.w, p.type, p.n, p.k, p.k, K::BN, K::kBoxCols)
             : make_tensor_map_2d(p.w, p.type, p.k, p.n, p.n, K::BK, K::kBoxCols);
  if constexpr (is_store_add(KIND)) {  // no partial product: C is never stored through the map (kept valid)
    g.c = make_tensor_map_2d(p.out, p.type, KIND == kMatmulAllReduceAdd ? p.m : p.m / G, p.n, p.n, 64,
                             K::kOutBoxCols);
  } else {
    g.c = make_tensor_map_2d(ag ? p.out : p.aux, p.type, rows_a, p.n, p.n, 64, K::kOutBoxCols);
  }
  g.m = rows_a, g.n = p.n, g.k = p.k;
  g.group = p.group;
  g.rows_per_rank = ag ? p.m : p.m / G;
  g.per_rank.tiles_m = g.rows_per_rank / K::BM;
  g.per_rank.tiles_n = (p.n + K::BN - 1) / K::BN;
  g.num_comm_sms = is_intra_sm(KIND) ? 0 : p.num_comm_sms;
  const int compute = p.num_sms - g.num_comm_sms;
  g.per_rank.group_m = TileGrid::balanced_group_m(compute, K::BM, K::BN, g.per_rank.tiles_m);
  g.grid = TileGrid{g.per_rank.tiles_m * G, g.per_rank.tiles_n, 1};  // only its count is used
  g.bm = K::BM, g.bn = K::BN;
  g.x = static_cast<const char*>(p.x);
  g.aux = static_cast<char*>(p.aux);
  g.out = static_cast<char*>(p.out);
  g.elem_bytes = elem_bytes(p.type);
  g.relay = KIND == kMatmulAllReduceAdd && all_reduce_relays(G);
  // Every CTA must be resident at once (they wait on each other): one per SM.
  const int tasks = g.grid.count();
  const int workers = std::min(compute, tasks);
  const cudaError_t e = lcsc::launch<K>(g, workers, stream);
  if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax fused GEMM launch: ") + cudaGetErrorString(e));
}

template <typename T, Kind KIND, bool W_NK>
void dispatch_tile(const Problem& p, int tile, cudaStream_t stream) {
  if (tile == gemm::k128x256) run<T, gemm::k128x256, KIND, W_NK>(p, stream);
  else run<T, gemm::k128x128, KIND, W_NK>(p, stream);
}

template <typename T, Kind KIND>
void dispatch_layout(const Problem& p, int tile, cudaStream_t stream) {
  if (p.transpose_w) dispatch_tile<T, KIND, true>(p, tile, stream);
  else dispatch_tile<T, KIND, false>(p, tile, stream);
}

template <typename T>
void dispatch(const Problem& p, int tile, cudaStream_t stream) {
  switch (p.kind) {
    case kAllGatherMatmul: return dispatch_layout<T, kAllGatherMatmul>(p, tile, stream);
    case kMatmulReduceScatter: return dispatch_layout<T, kMatmulReduceScatter>(p, tile, stream);
    case kMatmulAllReduce: return dispatch_layout<T, kMatmulAllReduce>(p, tile, stream);
    case kMatmulReduceScatterAdd: return dispatch_layout<T, kMatmulReduceScatterAdd>(p, tile, stream);
    case kMatmulAllReduceAdd: return dispatch_layout<T, kMatmulAllReduceAdd>(p, tile, stream);
    case kAllGatherMatmulIntraSM: return dispatch_layout<T, kAllGatherMatmulIntraSM>(p, tile, stream);
  }
  throw std::invalid_argument("pk_jax fused GEMM: unknown op");
}

template <typename T, Kind KIND>
cudaError_t configure_kind() {
  cudaError_t e = lcsc::configure<KernelFor<T, gemm::k128x256, KIND, false>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelFor<T, gemm::k128x128, KIND, false>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelFor<T, gemm::k128x256, KIND, true>>();
  return e == cudaSuccess ? lcsc::configure<KernelFor<T, gemm::k128x128, KIND, true>>() : e;
}

template <typename T>
cudaError_t configure_type() {
  cudaError_t e = configure_kind<T, kAllGatherMatmul>();
  if (e == cudaSuccess) e = configure_kind<T, kMatmulReduceScatter>();
  if (e == cudaSuccess) e = configure_kind<T, kMatmulAllReduce>();
  if (e == cudaSuccess) e = configure_kind<T, kMatmulReduceScatterAdd>();
  if (e == cudaSuccess) e = configure_kind<T, kMatmulAllReduceAdd>();
  return e == cudaSuccess ? configure_kind<T, kAllGatherMatmulIntraSM>() : e;
}

}  // namespace

bool all_reduce_relays(int group_size) {
  const char* forced = std::getenv("PK_JAX_AR_RELAY");  // read at each launch: a test sets it for its programs
  return group_size > 2 || (forced != nullptr && forced[0] == '1');
}

const char* unsupported(Kind kind, int group_size, int m, int n, int k, int tile) {
  if (group_size < 2 || group_size > kMaxGroup) return "group size must be 2..8";
  if (m <= 0 || n <= 0 || k <= 0) return "empty matrices";
  if (k % 8 || n % 8) return "k and n must be multiples of 8";
  const int bm = gemm::kTileShapes[tile].rows, bn = gemm::kTileShapes[tile].cols;
  const int rows = is_all_gather(kind) ? m : m / group_size;
  if (kind < kAllGatherMatmul || kind > kAllGatherMatmulIntraSM) return "unknown op";
  if (!is_all_gather(kind) && m % group_size) return "m must be divisible by the group size";
  if (rows % bm) return "the rows per member must be a multiple of 128";
  if (int64_t(rows / bm) * ((n + bn - 1) / bn) > kMaxItems) return "too many tiles per member";
  if (kind == kAllGatherMatmulIntraSM && rows / bm > kMaxChunks) return "too many row chunks per member";
  // Store-add counts its output's row blocks like the AG chunks (MatmulStoreAdd::counts_used): AR's m / bm
  // zeroed blocks and, relayed, the rows / bm blocks added per member after them.
  if (is_store_add(kind) && (kind == kMatmulAllReduceAdd ? m + rows : rows) / bm > kMaxChunks) return "too many output row blocks";
  return "";
}

int launch(const Problem& p, cudaStream_t stream) {
  if (p.type == ElemType::kF32) throw std::invalid_argument("pk_jax fused GEMM: bfloat16 or float16 inputs");
  int tile = p.tile;
  if (tile != gemm::k128x256 && tile != gemm::k128x128) {  // the 128x256 tile unless it leaves SMs idle
    const int rows = is_all_gather(p.kind) ? p.m * p.group.size : p.m;
    const gemm::TileShape big_tile = gemm::kTileShapes[gemm::k128x256];
    const double big = double(rows / big_tile.rows) * ((p.n + big_tile.cols - 1) / big_tile.cols);
    tile = big >= 2.0 * (p.num_sms - p.num_comm_sms) ? gemm::k128x256 : gemm::k128x128;
  }
  const std::string why = unsupported(p.kind, p.group.size, p.m, p.n, p.k, tile);
  if (!why.empty()) throw std::invalid_argument("pk_jax fused GEMM: " + why);
  if (!is_intra_sm(p.kind) && (p.num_comm_sms < 1 || p.num_comm_sms >= p.num_sms))
    throw std::invalid_argument("pk_jax fused GEMM: num_comm_sms must be in 1.." + std::to_string(p.num_sms - 1));
  if (p.type == ElemType::kBF16) dispatch<__nv_bfloat16>(p, tile, stream);
  else dispatch<__half>(p, tile, stream);
  return tile;
}

cudaError_t configure() {
  cudaError_t e = configure_type<__nv_bfloat16>();
  return e == cudaSuccess ? configure_type<__half>() : e;
}

}  // namespace pk::tp
