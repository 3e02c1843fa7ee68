// Instantiations of the GEMM kernel and the host-side choice of tile.
#include "gemm.cuh"

#include <cmath>
#include <mutex>
#include <stdexcept>

#include "gemm_kernel.cuh"

namespace pk::gemm {
namespace {

constexpr size_t kSmemLimit = 227 * 1024;  // per-block dynamic shared memory on sm_90
constexpr int kMaxDevices = 64;

struct TileShape {
  int wgs, bn;
  double efficiency;  // relative tensor-core efficiency of the tile (bigger tiles reuse more)
};
constexpr TileShape kShapes[kNumTiles] = {{2, 256, 1.0}, {2, 128, 0.87}, {1, 128, 0.62}};

// As many pipeline stages as fit next to the output slots (at most 8).
template <typename T, typename OutT, int WGS, int BN>
constexpr int stages_for() {
  constexpr size_t stage = size_t(64 * WGS * 64 + 64 * BN) * sizeof(T);
  constexpr size_t fixed = size_t(WGS) * 64 * BN * sizeof(OutT) + 2048;  // output slots, barriers, alignment
  constexpr size_t n = (kSmemLimit - fixed) / stage;
  return n > 8 ? 8 : int(n);
}

template <typename T, typename OutT, int WGS, int BN>
using KernelFor = Kernel<T, OutT, WGS, BN, stages_for<T, OutT, WGS, BN>()>;

template <typename T, typename OutT, int TILE>
using KernelOf = KernelFor<T, OutT, kShapes[TILE].wgs, kShapes[TILE].bn>;

template <typename T, typename OutT, int TILE>
constexpr bool built() {
  return stages_for<T, OutT, kShapes[TILE].wgs, kShapes[TILE].bn>() >= 3;
}

template <typename T, typename OutT, int TILE>
void run(const Problem& p, int compute_sms, cudaStream_t stream) {
  using K = KernelOf<T, OutT, TILE>;
  static_assert(lcsc::smem_bytes<K>() <= kSmemLimit, "shared memory");
  Globals g{};
  g.a = make_tensor_map_2d(p.a, p.in, p.m, p.k, p.k, K::BM, K::kBoxCols);
  g.b = make_tensor_map_2d(p.b, p.in, p.k, p.n, p.n, K::BK, K::kBoxCols);
  g.c = make_tensor_map_2d(p.c, p.out, p.m, p.n, p.n, 64, K::kOutBoxCols);
  g.m = p.m, g.n = p.n, g.k = p.k;
  g.grid.tiles_m = (p.m + K::BM - 1) / K::BM;
  g.grid.tiles_n = (p.n + K::BN - 1) / K::BN;
  // Square-ish L2 footprint of the CTAs in flight: group_m tile-rows by workers/group_m tile-columns.
  const double balance = std::sqrt(double(compute_sms) * K::BN / K::BM);
  g.grid.group_m = std::max(1, std::min(g.grid.tiles_m, int(std::lround(balance))));
  g.num_comm_sms = 0;
  const cudaError_t e = lcsc::launch<K>(g, compute_sms, stream);
  if (e != cudaSuccess) throw std::runtime_error(std::string("pk_jax matmul launch: ") + cudaGetErrorString(e));
}

template <typename T, typename OutT>
void dispatch(const Problem& p, int tile, int compute_sms, cudaStream_t stream) {
  switch (tile) {
    case k128x256:
      if constexpr (built<T, OutT, k128x256>()) return run<T, OutT, k128x256>(p, compute_sms, stream);
      break;
    case k128x128:
      return run<T, OutT, k128x128>(p, compute_sms, stream);
    case k64x128:
      return run<T, OutT, k64x128>(p, compute_sms, stream);
  }
  throw std::invalid_argument(std::string("pk_jax matmul: tile ") + tile_name(tile) +
                              " is not built for these dtypes");
}

template <typename T, typename OutT>
cudaError_t configure_types() {
  cudaError_t e = cudaSuccess;
  if constexpr (built<T, OutT, k128x256>()) e = lcsc::configure<KernelOf<T, OutT, k128x256>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, OutT, k128x128>>();
  if (e == cudaSuccess) e = lcsc::configure<KernelOf<T, OutT, k64x128>>();
  return e;
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
    const int bm = 64 * kShapes[t].wgs, bn = kShapes[t].bn;
    const double tiles = double((p.m + bm - 1) / bm) * double((p.n + bn - 1) / bn);
    const double waves = std::ceil(tiles / num_sms);
    const double cost = waves * bm * bn / kShapes[t].efficiency;
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

cudaError_t configure_once(int ordinal) {
  static std::mutex mu;
  static bool done[kMaxDevices] = {};
  if (ordinal < 0 || ordinal >= kMaxDevices) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(mu);
  if (done[ordinal]) return cudaSuccess;
  int prev = 0;
  cudaError_t e = cudaGetDevice(&prev);
  if (e == cudaSuccess) e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) e = configure();
  cudaSetDevice(prev);
  done[ordinal] = e == cudaSuccess;
  return e;
}

int num_sms(int ordinal) {
  static std::mutex mu;
  static int cached[kMaxDevices] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (ordinal < 0 || ordinal >= kMaxDevices) return 0;
  if (!cached[ordinal] && cudaDeviceGetAttribute(&cached[ordinal], cudaDevAttrMultiProcessorCount, ordinal) != cudaSuccess)
    cached[ordinal] = 0;
  return cached[ordinal];
}

int launch(const Problem& p, int tile, int compute_sms, cudaStream_t stream) {
  if (p.in == ElemType::kF32) throw std::invalid_argument("pk_jax matmul: a and b must be bfloat16 or float16");
  if (p.out != p.in && p.out != ElemType::kF32)
    throw std::invalid_argument("pk_jax matmul: out_dtype must be the input dtype or float32");
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) throw std::invalid_argument("pk_jax matmul: empty matrices");
  if (p.k % 8 || p.n % 8) throw std::invalid_argument("pk_jax matmul: k and n must be multiples of 8 (TMA rows)");
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
