// Instantiations of the GEMM kernel and the host-side choice of tile.
#include "gemm.cuh"

#include <cmath>
#include <mutex>

#include "pk/device_setup.h"
#include <stdexcept>

#include "gemm_kernel.cuh"

namespace pk::gemm {
namespace {

constexpr size_t kSmemLimit = 227 * 1024;  // per-block dynamic shared memory on sm_90


// As many pipeline stages as fit next to the output slots (at most 8).
template <typename T, typename OutT, int WGS, int BN>
constexpr int stages_for() {
  constexpr size_t stage = size_t(64 * WGS * 64 + 64 * BN) * sizeof(T);
  constexpr size_t fixed = size_t(WGS) * 64 * BN * sizeof(OutT) + 2048;  // output slots, barriers, alignment
  constexpr size_t n = (kSmemLimit - fixed) / stage;
  return n > 8 ? 8 : int(n);
}

// LAYOUT: bit 0 = A stored K x M (transpose_a), bit 1 = B stored N x K (transpose_b); see kLayouts.
template <typename T, typename OutT, int WGS, int BN, int LAYOUT>
using KernelFor = Kernel<T, OutT, WGS, BN, stages_for<T, OutT, WGS, BN>(), NoComm, (LAYOUT & 1) != 0, (LAYOUT & 2) != 0>;

template <typename T, typename OutT, int TILE, int LAYOUT = 0>
using KernelOf = KernelFor<T, OutT, kTileShapes[TILE].rows / 64, kTileShapes[TILE].cols, LAYOUT>;
constexpr int kLayouts = 4;

constexpr int layout_of(const Problem& p) { return (p.transpose_a ? 1 : 0) | (p.transpose_b ? 2 : 0); }

template <typename T, typename OutT, int TILE>
constexpr bool built() {
  return stages_for<T, OutT, kTileShapes[TILE].rows / 64, kTileShapes[TILE].cols>() >= 3;
}

template <typename T, typename OutT, int TILE, int LAYOUT>
void run(const Problem& p, int compute_sms, cudaStream_t stream) {
  using K = KernelOf<T, OutT, TILE, LAYOUT>;
  static_assert(lcsc::smem_bytes<K>() <= kSmemLimit, "shared memory");
  Globals g{};
  // Each operand's map is over the matrix as stored; the kernel's boxes read it in place.
  g.a = p.transpose_a ? make_tensor_map_2d(p.a, p.in, p.k, p.m, p.m, K::BK, K::kBoxCols)
                      : make_tensor_map_2d(p.a, p.in, p.m, p.k, p.k, K::BM, K::kBoxCols);
  g.b = p.transpose_b ? make_tensor_map_2d(p.b, p.in, p.n, p.k, p.k, K::BN, K::kBoxCols)
                      : make_tensor_map_2d(p.b, p.in, p.k, p.n, p.n, K::BK, K::kBoxCols);
  g.c = make_tensor_map_2d(p.c, p.out, p.m, p.n, p.n, 64, K::kOutBoxCols);
  g.m = p.m, g.n = p.n, g.k = p.k;
  g.grid.tiles_m = (p.m + K::BM - 1) / K::BM;
  g.grid.tiles_n = (p.n + K::BN - 1) / K::BN;
  g.grid.group_m = TileGrid::balanced_group_m(compute_sms, K::BM, K::BN, g.grid.tiles_m);
  g.num_comm_sms = 0;
  const cudaError_t e = lcsc::launch<K>(g, compute_sms, stream);
  if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax matmul launch: ") + cudaGetErrorString(e));
}

template <typename T, typename OutT, int LAYOUT>
void dispatch_tile(const Problem& p, int tile, int compute_sms, cudaStream_t stream) {
  switch (tile) {
    case k128x256:
      if constexpr (built<T, OutT, k128x256>()) return run<T, OutT, k128x256, LAYOUT>(p, compute_sms, stream);
      break;
    case k128x128:
      return run<T, OutT, k128x128, LAYOUT>(p, compute_sms, stream);
    case k64x128:
      return run<T, OutT, k64x128, LAYOUT>(p, compute_sms, stream);
  }
  throw std::invalid_argument(std::string("pk_jax matmul: tile ") + tile_name(tile) +
                              " is not built for these dtypes");
}

template <typename T, typename OutT>
void dispatch(const Problem& p, int tile, int compute_sms, cudaStream_t stream) {
  switch (layout_of(p)) {
    case 0: return dispatch_tile<T, OutT, 0>(p, tile, compute_sms, stream);
    case 1: return dispatch_tile<T, OutT, 1>(p, tile, compute_sms, stream);
    case 2: return dispatch_tile<T, OutT, 2>(p, tile, compute_sms, stream);
    default: return dispatch_tile<T, OutT, 3>(p, tile, compute_sms, stream);
  }
}

template <typename T, typename OutT, int LAYOUT>
cudaError_t configure_layout() {
  cudaError_t e = cudaSuccess;
  if constexpr (built<T, OutT, k128x256>()) e = lcsc::configure<KernelOf<T, OutT, k128x256, LAYOUT>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, OutT, k128x128, LAYOUT>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, OutT, k64x128, LAYOUT>>();
  return e;
}

template <typename T, typename OutT>
cudaError_t configure_types() {
  static_assert(kLayouts == 4, "configure every layout");
  cudaError_t e = configure_layout<T, OutT, 0>();
  if (e == cudaSuccess) e = configure_layout<T, OutT, 1>();
  if (e == cudaSuccess) e = configure_layout<T, OutT, 2>();
  return e == cudaSuccess ? configure_layout<T, OutT, 3>() : e;
}

}  // namespace

const char* tile_name(int tile) {
  static const char* names[kNumTiles] = {"128x256", "128x128", "64x128"};
  return tile >= 0 && tile < kNumTiles ? names[tile] : "auto";
}

bool tile_available(int tile, ElemType in, ElemType out) {
  if (tile < 0 || tile >= kNumTiles || in == ElemType::kF32) return false;
  return !(tile == k128x256 && out == ElemType::kF32);
}

int choose_tile(const Problem& p, int num_sms) {
  int best = k64x128;
  double best_cost = 0;
  for (int t = 0; t < kNumTiles; ++t) {
    if (!tile_available(t, p.in, p.out)) continue;
    const int bm = kTileShapes[t].rows, bn = kTileShapes[t].cols;
    const double tiles = double((p.m + bm - 1) / bm) * double((p.n + bn - 1) / bn);
    const double waves = std::ceil(tiles / num_sms);
    const double cost = waves * bm * bn / kTileShapes[t].efficiency;
    if (t == 0 || best_cost == 0 || cost < best_cost) best = t, best_cost = cost;
  }
  return best;
}

cudaError_t configure() {
  cudaError_t e = configure_types<__nv_bfloat16, __nv_bfloat16>();
  if (e == cudaSuccess) e = configure_types<__nv_bfloat16, float>();
  if (e == cudaSuccess) e = configure_types<__half, __half>();
  if (e == cudaSuccess) e = configure_types<__half, float>();
  return e;
}

cudaError_t configure_once(int ordinal) { return setup_status<configure>(ordinal); }

int num_sms(int ordinal) { return setup_sms<configure>(ordinal); }

int launch(const Problem& p, int tile, int compute_sms, cudaStream_t stream) {
  if (p.in == ElemType::kF32) throw std::invalid_argument("pk_jax matmul: a and b must be bfloat16 or float16");
  if (p.out != p.in && p.out != ElemType::kF32)
    throw std::invalid_argument("pk_jax matmul: out_dtype must be the input dtype or float32");
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) throw std::invalid_argument("pk_jax matmul: empty matrices");
  // TMA rows are multiples of 16 bytes: the stored row length of each operand and of C.
  if (p.transpose_a ? p.m % 8 : p.k % 8)
    throw std::invalid_argument(std::string("pk_jax matmul: a is stored (") + (p.transpose_a ? "k, m" : "m, k") +
                                "); its rows (" + (p.transpose_a ? "m" : "k") + ") must be a multiple of 8 (TMA rows)");
  if (p.transpose_b ? p.k % 8 : p.n % 8)
    throw std::invalid_argument(std::string("pk_jax matmul: b is stored (") + (p.transpose_b ? "n, k" : "k, n") +
                                "); its rows (" + (p.transpose_b ? "k" : "n") + ") must be a multiple of 8 (TMA rows)");
  if (p.n % 8) throw std::invalid_argument("pk_jax matmul: n must be a multiple of 8 (TMA rows of c)");
  if (tile == kAuto) tile = choose_tile(p, compute_sms);
  if (!tile_available(tile, p.in, p.out))
    throw std::invalid_argument(std::string("pk_jax matmul: tile ") + tile_name(tile) + " is not built for these dtypes");
  if (p.in == ElemType::kBF16) {
    if (p.out == ElemType::kF32) dispatch<__nv_bfloat16, float>(p, tile, compute_sms, stream);
    else dispatch<__nv_bfloat16, __nv_bfloat16>(p, tile, compute_sms, stream);
  } else {
    if (p.out == ElemType::kF32) dispatch<__half, float>(p, tile, compute_sms, stream);
    else dispatch<__half, __half>(p, tile, compute_sms, stream);
  }
  return tile;
}

}  // namespace pk::gemm
