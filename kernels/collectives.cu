// The four device-initiated collectives on top of the PK primitives: a push copy (all_gather,
// all_to_all) and a pull reduction (reduce_scatter, one- and two-shot all_reduce). Both move data
// directly between the members' XLA buffers; OpProtocol does the handshakes.
#include "collectives.cuh"
#include "small_collectives.cuh"
#include "moe_dispatch.cuh"
#include "ring_shift.cuh"
#include "pk/op_protocol.cuh"
#include "pk/vec.cuh"
#include "pk/warp_work.cuh"

#include <unordered_map>

namespace pk {
namespace {

constexpr int kCopyThreads = 512;
constexpr int kCopyUnroll = 4;
constexpr int kReduceThreads = 256;
constexpr int kReduceUnroll = 4;

// all_gather / all_to_all. Box origins are functions of (sender, receiver). PULL=false: this
// device sends its box to every receiver (remote stores). PULL=true: it fetches every sender's box
// into its own output (remote loads). Same bytes; the link direction of the data differs.
template <int VEC, bool PULL>
__global__ void __launch_bounds__(kCopyThreads) copy_kernel(Group g, Box box, const char* src, char* dst) {
  OpProtocol op(g);
  void* const local[2] = {const_cast<char*>(src), dst};
  op.publish(local, 2);
  pgl<char> bufs[2];
  if (op.acquire(local, bufs)) {
    using S = Segments<kCopyUnroll>;
    const WarpWork w;
    const int64_t segs = S::per_row(box);
    const int64_t items = int64_t(g.size) * box.rows * segs;
    // Peer is the fastest index: every link carries traffic at once, and repeated reads of one
    // local segment hit L2 after the first. The warp stride is kept = 1 (mod G) so each warp
    // rotates through the peers; with a stride divisible by G, some warps would only ever do the
    // (fast) local copy and the NVLink traffic would come from a fraction of the warps.
    const int64_t stride = w.nwarps - (w.nwarps - 1) % g.size;
    for (int64_t it = w.warp; w.warp < stride && it < items; it += stride) {
      const int peer = int((g.rank + 1 + it % g.size) % g.size);
      const int sender = PULL ? peer : g.rank, receiver = PULL ? g.rank : peer;
      const int64_t rest = it / g.size;
      const int64_t seg = rest % segs, row = rest / segs;
      int64_t so, dof;
      box.row_offsets(row, so, dof);
      so += box.src_origin(sender, receiver) + seg * S::kVectors;
      dof += box.dst_origin(sender, receiver) + seg * S::kVectors;
      const int64_t left = box.inner - seg * S::kVectors;
      const char* s = bufs[0][sender];
      char* d = bufs[1][receiver];
      vec_t<VEC> v[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t i = u * 32 + w.lane;
        if (i < left) v[u] = load_vec<VEC>(s, so + i);
      }
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t i = u * 32 + w.lane;
        if (i < left) store_vec<VEC>(d, dof + i, v[u]);
      }
    }
  }
  op.finish();
}

template <typename T, int VEC, int G>
__global__ void __launch_bounds__(kReduceThreads)
    pull_reduce_kernel(Group g, Box box, const char* src, char* dst, int broadcast) {
  OpProtocol op(g);
  void* const local[2] = {const_cast<char*>(src), dst};
  op.publish(local, 2);
  pgl<char> bufs[2];
  if (op.acquire(local, bufs)) {
    using S = Segments<kReduceUnroll>;
    using L = lanes<T, VEC>;
    const WarpWork w;
    const int64_t segs = S::per_row(box);
    const int64_t items = box.rows * segs;
    for (int64_t it = w.warp; it < items; it += w.nwarps) {
      const int64_t seg = it % segs, row = it / segs;
      int64_t so, dof;
      box.row_offsets(row, so, dof);
      so += box.src_origin(g.rank, 0) + seg * S::kVectors;
      dof += box.dst_origin(g.rank, 0) + seg * S::kVectors;
      const int64_t left = box.inner - seg * S::kVectors;
      float acc[kReduceUnroll][L::kCount] = {};
      // Fixed summation order (rank 0..G-1): every member computes identical bits.
#pragma unroll
      for (int p = 0; p < G; ++p) {
        vec_t<VEC> v[kReduceUnroll];
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u) {
          const int64_t i = u * 32 + w.lane;
          if (i < left) v[u] = load_vec<VEC>(bufs[0][p], so + i);
        }
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u)
          if (u * 32 + w.lane < left) L::add(acc[u], v[u]);
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        const int64_t i = u * 32 + w.lane;
        if (i >= left) continue;
        const vec_t<VEC> r = L::pack(acc[u]);
        if (broadcast) {
#pragma unroll
          for (int p = 1; p <= G; ++p) store_vec<VEC>(bufs[1][(g.rank + p) % G], dof + i, r);
        } else {
          store_vec<VEC>(bufs[1][g.rank], dof + i, r);
        }
      }
    }
  }
  op.finish();
}

__global__ void wait_for_peer_kernel(Group g, int peer_rank) {
  if (threadIdx.x == 0) {
    const uint64_t expected = g.self()->test_flag[g.slot[peer_rank]] + 1;
    wait(&g.self()->test_flag[g.slot[peer_rank]], expected, g, peer_rank, kTimeoutTest);
  }
}

// Co-resident CTAs per SM of each kernel, measured once by configure_kernels().
std::unordered_map<const void*, int>& blocks_per_sm() {
  static std::unordered_map<const void*, int> table;
  return table;
}

// Every CTA must be resident at once (CTAs wait on peers), so the grid never exceeds what fits.
int grid_for(const void* kernel, int64_t warp_items, int threads, const LaunchLimits& lim,
             int max_ctas_per_sm = kAnyCtasPerSm) {
  const auto it = blocks_per_sm().find(kernel);
  const int fit = it == blocks_per_sm().end() ? 1 : it->second;
  const int64_t cap = int64_t(lim.num_sms) * (fit < max_ctas_per_sm ? fit : max_ctas_per_sm);
  const int64_t per_block = threads / 32;
  const int64_t want = (warp_items + per_block - 1) / per_block;
  return int(want < 1 ? 1 : (want < cap ? want : cap));
}

template <typename Kernel, typename... Args>
cudaError_t launch(Kernel kernel, int grid, int threads, cudaStream_t stream, Args... args) {
  kernel<<<grid, threads, 0, stream>>>(args...);
  return cudaGetLastError();
}

// Reduction kernels for every (dtype, vector width, group size): G is a template parameter so the
// peer loop unrolls and all G loads are in flight together.
template <typename T, int VEC, int... Gs>
struct ReduceTable {
  static const void* get(int g) {
    const void* table[] = {reinterpret_cast<const void*>(&pull_reduce_kernel<T, VEC, Gs>)...};
    const int gs[] = {Gs...};
    for (size_t i = 0; i < sizeof(gs) / sizeof(int); ++i)
      if (gs[i] == g) return table[i];
    return nullptr;
  }
  static void all(std::vector<const void*>& out) {
    (out.push_back(reinterpret_cast<const void*>(&pull_reduce_kernel<T, VEC, Gs>)), ...);
  }
};
template <typename T, int VEC>
using ReduceKernels = ReduceTable<T, VEC, 2, 3, 4, 5, 6, 7, 8>;

const void* reduce_kernel(DType dtype, int vec_bytes, int g) {
  switch (dtype) {
    case DType::kF32:
      return vec_bytes == 16 ? ReduceKernels<float, 16>::get(g) : ReduceKernels<float, 4>::get(g);
    case DType::kBF16:
      return vec_bytes == 16 ? ReduceKernels<__nv_bfloat16, 16>::get(g) : ReduceKernels<__nv_bfloat16, 2>::get(g);
    case DType::kF16:
      return vec_bytes == 16 ? ReduceKernels<__half, 16>::get(g) : ReduceKernels<__half, 2>::get(g);
  }
  return nullptr;
}

template <bool PULL>
const void* copy_kernel_for(int vec_bytes) {
  switch (vec_bytes) {
    case 16: return reinterpret_cast<const void*>(&copy_kernel<16, PULL>);
    case 8: return reinterpret_cast<const void*>(&copy_kernel<8, PULL>);
    case 4: return reinterpret_cast<const void*>(&copy_kernel<4, PULL>);
    case 2: return reinterpret_cast<const void*>(&copy_kernel<2, PULL>);
  }
  return nullptr;
}

const void* copy_kernel_for(int vec_bytes, bool pull) {
  return pull ? copy_kernel_for<true>(vec_bytes) : copy_kernel_for<false>(vec_bytes);
}

}  // namespace

cudaError_t launch_copy(const Group& g, const Box& box, int vec_bytes, bool pull, const void* src, void* dst,
                        const LaunchLimits& lim, cudaStream_t stream) {
  const void* k = copy_kernel_for(vec_bytes, pull);
  if (!k) return cudaErrorInvalidValue;
  const int64_t items = int64_t(g.size) * box.rows * Segments<kCopyUnroll>::per_row(box);
  const int grid = grid_for(k, items, kCopyThreads, lim);
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  void* args[] = {const_cast<Group*>(&g), const_cast<Box*>(&box), &s, &d};
  return cudaLaunchKernel(k, grid, kCopyThreads, args, 0, stream);
}

cudaError_t launch_pull_reduce(const Group& g, const Box& box, int vec_bytes, DType dtype, bool broadcast,
                               const void* src, void* dst, const LaunchLimits& lim, cudaStream_t stream) {
  const void* k = reduce_kernel(dtype, vec_bytes, g.size);
  if (!k) return cudaErrorInvalidValue;
  const int64_t items = box.rows * Segments<kReduceUnroll>::per_row(box);
  const int grid = grid_for(k, items, kReduceThreads, lim);
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  int b = broadcast ? 1 : 0;
  void* args[] = {const_cast<Group*>(&g), const_cast<Box*>(&box), &s, &d, &b};
  return cudaLaunchKernel(k, grid, kReduceThreads, args, 0, stream);
}

int resident_grid(const void* kernel, int64_t warp_items, int threads, const LaunchLimits& lim, int max_ctas_per_sm) {
  return grid_for(kernel, warp_items, threads, lim, max_ctas_per_sm);
}

cudaError_t launch_wait_for_peer(const Group& g, int peer_rank, cudaStream_t stream) {
  return launch(wait_for_peer_kernel, 1, 32, stream, g, peer_rank);
}

cudaError_t configure_kernels() {
  for (const void* k : collective_kernels()) {
    cudaFuncAttributes attr;
    int blocks = 0;
    cudaError_t e = cudaFuncGetAttributes(&attr, k);  // loads the module on this device
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, attr.maxThreadsPerBlock, 0);
    if (e != cudaSuccess) return e;
    if (blocks < 1) return cudaErrorLaunchOutOfResources;
    auto& slot = blocks_per_sm()[k];
    slot = slot == 0 ? blocks : (blocks < slot ? blocks : slot);
  }
  return cudaSuccess;
}

std::vector<const void*> collective_kernels() {
  std::vector<const void*> out;
  for (int v : {16, 8, 4, 2}) {
    out.push_back(copy_kernel_for(v, false));
    out.push_back(copy_kernel_for(v, true));
  }
  ReduceKernels<float, 16>::all(out);
  ReduceKernels<float, 4>::all(out);
  ReduceKernels<__nv_bfloat16, 16>::all(out);
  ReduceKernels<__nv_bfloat16, 2>::all(out);
  ReduceKernels<__half, 16>::all(out);
  ReduceKernels<__half, 2>::all(out);
  out.push_back(reinterpret_cast<const void*>(&wait_for_peer_kernel));
  for (const void* k : small_collective_kernels()) out.push_back(k);
  for (const void* k : moe_kernels()) out.push_back(k);
  for (const void* k : ring_shift_kernels()) out.push_back(k);
  return out;
}

}  // namespace pk
