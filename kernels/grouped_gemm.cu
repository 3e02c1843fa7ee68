// Instantiations of the grouped GEMM kernel (forward, input grad, weight grad) and its host launch.
#include "grouped_gemm.cuh"

#include <climits>
#include <stdexcept>
#include <string>

#include "grouped_gemm_kernel.cuh"
#include "pk/device_setup.h"

namespace pk::grouped {
namespace {

constexpr size_t kSmemLimit = 227 * 1024;  // per-block dynamic shared memory on sm_90
constexpr int kBn[kNumTiles] = {256, 128};
constexpr double kEfficiency[kNumTiles] = {1.0, 0.87};  // as the GEMM's tiles (gemm.cuh)

// As many pipeline stages as fit beside the output slots and the group table (at most 8).
template <typename T, int WGS, int BN>
constexpr int stages_for() {
  constexpr size_t stage = size_t(64 * WGS * 64 + 64 * BN) * sizeof(T);
  constexpr size_t fixed = size_t(WGS) * 64 * BN * sizeof(T) + kSharedExtBytes + 2048 + 1024;
  constexpr size_t n = (kSmemLimit - fixed) / stage;
  return n > 8 ? 8 : int(n);
}

template <typename T, int TILE, int MODE, bool DYN = false, bool PIPE = false, bool PAIR = false>
using KernelOf = Kernel<T, 2, kBn[TILE], stages_for<T, 2, kBn[TILE]>(), MODE, DYN, PIPE, PAIR>;

template <typename T, int TILE, int MODE, bool DYN, bool PIPE = false, bool PAIR = false>
void run(const Problem& p, int sms, cudaStream_t stream) {
  using K = KernelOf<T, TILE, MODE, DYN, PIPE, PAIR>;
  static_assert(K::STAGES >= 3, "pipeline depth");
  static_assert(lcsc::smem_bytes<K>() <= kSmemLimit, "shared memory");
  Globals g{};
  const int e = p.num_groups;
  if constexpr (MODE == kWeightGrad) {
    g.a = make_tensor_map_2d(p.a, p.type, p.tokens, p.m, p.m, K::BK, K::kBoxCols);  // x: 64 token rows x 64 m
    g.b = make_tensor_map_2d(p.b, p.type, p.tokens, p.n, p.n, K::BK, K::kBoxCols);  // y: 64 token rows x 64 n
    g.c = make_tensor_map_3d(p.out, p.type, e, p.m, p.n, 64, K::kOutBoxCols);
    g.tiles_m = (p.m + K::BM - 1) / K::BM;
  } else {
    g.a = make_tensor_map_2d(p.a, p.type, p.tokens, p.k, p.k, K::BM, K::kBoxCols);
    g.b = MODE == kInputGrad ? make_tensor_map_3d(p.b, p.type, e, p.n, p.k, K::BN, K::kBoxCols)   // (n, k) boxes BN x 64
                             : make_tensor_map_3d(p.b, p.type, e, p.k, p.n, K::BK, K::kBoxCols);  // (k, n) boxes 64 x 64
    g.c = make_tensor_map_2d(p.out, p.type, p.tokens, p.n, p.n, 64, K::kOutBoxCols);
    g.tiles_m = (p.tokens + K::BM - 1) / K::BM;
    if (p.k2 > 0) {
      g.a2 = make_tensor_map_2d(p.a2, p.type, p.tokens, p.k2, p.k2, K::BM, K::kBoxCols);
      g.b2 = MODE == kInputGrad ? make_tensor_map_3d(p.b2, p.type, e, p.n, p.k2, K::BN, K::kBoxCols)
                                : make_tensor_map_3d(p.b2, p.type, e, p.k2, p.n, K::BK, K::kBoxCols);
      g.k2 = p.k2;
    }
  }
  g.group_sizes = p.group_sizes;
  g.out = p.out;
  g.tokens = p.tokens, g.m = p.m, g.n = p.n, g.k = p.k;
  g.num_groups = e;
  g.tiles_n = (p.n + K::BN - 1) / K::BN;
  // Forward / input grad: each group adds at most one partial row tile to ceil(tokens / BM), plus the tail;
  // pair: tasks are pairs of a group's row tiles (an odd count rounds up: at most one more per group), the
  // raster over clusters of two CTAs.
  g.group_m = PAIR ? TileGrid::balanced_group_m(sms / 2, 2 * K::BM, K::BN, (g.tiles_m + 1) / 2)
                   : TileGrid::balanced_group_m(sms, K::BM, K::BN, g.tiles_m);
  const long long tasks = MODE == kWeightGrad ? (long long)e * g.tiles_m * g.tiles_n
                          : PAIR              ? ((long long)g.tiles_m + 2 * e) / 2 * g.tiles_n
                                              : ((long long)g.tiles_m + e + 1) * g.tiles_n;
  if (tasks > INT_MAX) throw std::invalid_argument("pk_jax grouped_matmul: too many tiles for one launch");
  g.max_tasks = int(tasks);
  g.num_comm_sms = 0;
  g.narrow_tail = (p.variant & kVariantNarrow) ? 1 : 0;
  g.store_tail = (p.variant & kVariantNoTail) ? 0 : 1;
  g.split_short = (p.variant & kVariantSplit) ? 1 : 0;
  g.k_slices = (p.variant & kVariantKSlice) ? 1 : 0;
  const cudaError_t err = lcsc::launch<K>(g, sms, stream);
  if (err != cudaSuccess) throw std::runtime_error(std::string("pk_jax grouped_matmul launch: ") + cudaGetErrorString(err));
}

template <typename T, int MODE, bool DYN>
void dispatch_tile(const Problem& p, int tile, int sms, cudaStream_t stream) {
  if constexpr (MODE == kWeightGrad) {  // variant pipe: 128x128 tiles (launch() picks the tile)
    if (p.variant & kVariantPipe) return run<T, k128x128, MODE, DYN, true>(p, sms, stream);
  }
  if constexpr (MODE == kForward) {  // variant pair (static schedule, so dyn is dropped)
    if ((p.variant & kVariantPair) && sms >= 2) {
      if (tile == k128x256) return run<T, k128x256, MODE, false, false, true>(p, sms, stream);
      return run<T, k128x128, MODE, false, false, true>(p, sms, stream);
    }
  }
  if (tile == k128x256) run<T, k128x256, MODE, DYN>(p, sms, stream);
  else run<T, k128x128, MODE, DYN>(p, sms, stream);
}

template <typename T, int MODE>
void dispatch_schedule(const Problem& p, int tile, int sms, cudaStream_t stream) {
  if (p.variant & kVariantDynamic) dispatch_tile<T, MODE, true>(p, tile, sms, stream);
  else dispatch_tile<T, MODE, false>(p, tile, sms, stream);
}

template <typename T>
void dispatch(const Problem& p, int tile, int sms, cudaStream_t stream) {
  switch (p.mode) {
    case kForward: return dispatch_schedule<T, kForward>(p, tile, sms, stream);
    case kInputGrad: return dispatch_schedule<T, kInputGrad>(p, tile, sms, stream);
    default: return dispatch_schedule<T, kWeightGrad>(p, tile, sms, stream);
  }
}

template <typename T, int TILE, bool DYN>
cudaError_t configure_tile() {
  cudaError_t e = lcsc::configure<KernelOf<T, TILE, kForward, DYN>>();
  if (e == cudaSuccess && !DYN) e = lcsc::configure<KernelOf<T, TILE, kForward, false, false, true>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, TILE, kInputGrad, DYN>>();
  if (e == cudaSuccess && TILE == k128x128) e = lcsc::configure<KernelOf<T, k128x128, kWeightGrad, DYN, true>>();
  return e == cudaSuccess ? lcsc::configure<KernelOf<T, TILE, kWeightGrad, DYN>>() : e;
}

template <typename T>
cudaError_t configure_type() {
  cudaError_t e = configure_tile<T, k128x256, false>();
  if (e == cudaSuccess) e = configure_tile<T, k128x128, false>();
  if (e == cudaSuccess) e = configure_tile<T, k128x256, true>();
  return e == cudaSuccess ? configure_tile<T, k128x128, true>() : e;
}

}  // namespace

const char* unsupported(const Problem& p) {
  if (p.mode < kForward || p.mode > kWeightGrad) return "mode must be 0 (forward), 1 (input grad) or 2 (weight grad)";
  if (p.type == ElemType::kF32) return "operands must be bfloat16 or float16";
  if (p.num_groups < 1 || p.num_groups > kMaxGroups) return "the number of groups must be 1..256";
  if (p.n % 8) return "n must be a multiple of 8 (TMA rows of 16 bytes)";
  if (p.mode == kWeightGrad ? p.m % 8 : p.k % 8) return "k must be a multiple of 8 (TMA rows of 16 bytes)";
  if (p.tokens < 0 || p.m < 0 || p.n < 0 || p.k < 0) return "negative sizes";
  if (p.variant & ~kVariantMask) return "unknown variant bits (1: dyn, 2: narrow, 4: n128, 8: pipe, 16: notail, 32: pair, 64: w128, 128: split, 256: kslice)";
  if (p.k2 < 0 || (p.k2 > 0 && (p.mode == kWeightGrad || p.k == 0 || p.k2 % 8 || !p.a2 || !p.b2)))
    return "a second product needs the forward or input grad, a first one (k > 0), both operands and k2 % 8 == 0";
  return "";
}

int choose_tile(const Problem& p) {
  // 128-wide tiles where the last 256-wide one would be at most half full (n = 1408: 11 x 128 instead of
  // 5.5 x 256): the forward and input grad always (2x H200, E 64, n 1408: 0.375 / 0.367 ms against 0.396 /
  // 0.398 uniform / skewed, 2026-11-27), the weight grad with variant `n128` (its 128x128 tiles measured
  // 0-3 % slower there).
  const bool n_tail_half = p.n % 256 != 0 && p.n % 256 <= 128;
  if (n_tail_half && (p.mode != kWeightGrad || (p.variant & kVariant128))) return k128x128;
  // The padding of n to whole tiles over each tile's relative efficiency; rows tile alike (128).
  int best = k128x256;
  double best_cost = 0;
  for (int t = 0; t < kNumTiles; ++t) {
    const double cost = double((p.n + kBn[t] - 1) / kBn[t]) * kBn[t] / kEfficiency[t];
    if (t == 0 || cost < best_cost) best = t, best_cost = cost;
  }
  return best;
}

cudaError_t configure() {
  const cudaError_t e = configure_type<__nv_bfloat16>();
  return e == cudaSuccess ? configure_type<__half>() : e;
}

cudaError_t configure_once(int ordinal) { return setup_status<configure>(ordinal); }

int num_sms(int ordinal) { return setup_sms<configure>(ordinal); }

int launch(const Problem& p, int tile, int compute_sms, cudaStream_t stream) {
  if (const char* why = unsupported(p); *why) throw std::invalid_argument(std::string("pk_jax grouped_matmul: ") + why);
  if (tile == kAuto) tile = choose_tile(p);
  if (p.mode == kWeightGrad && (p.variant & kVariantPipe)) tile = k128x128;  // the pipelined weight grad's tile
  if (p.variant & kVariantTile128) tile = k128x128;
  if (tile < 0 || tile >= kNumTiles) throw std::invalid_argument("pk_jax grouped_matmul: unknown tile");
  const size_t out_elems = p.mode == kWeightGrad ? size_t(p.num_groups) * p.m * p.n : size_t(p.tokens) * p.n;
  if (out_elems == 0) return tile;
  const bool no_contraction = p.mode == kWeightGrad ? p.tokens == 0 : p.k == 0 && p.k2 == 0;
  if (no_contraction) {  // every output element is an empty sum
    const cudaError_t e = cudaMemsetAsync(p.out, 0, out_elems * elem_bytes(p.type), stream);
    if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax grouped_matmul: cudaMemsetAsync: ") + cudaGetErrorString(e));
    return tile;
  }
  if (p.type == ElemType::kBF16) dispatch<__nv_bfloat16>(p, tile, compute_sms, stream);
  else dispatch<__half>(p, tile, compute_sms, stream);
  return tile;
}

}  // namespace pk::grouped
