// The ring shift kernel (kernels/ring_shift.cuh). Every member runs it with the same buffer count
// and sizes; it follows the op protocol on the side channel:
//   publish: CTA 0 writes this member's y_i (as each peer maps them) into every peer's side mailbox
//            and signals ready. Every member publishes to every peer (not just the predecessor), so the
//            op-tag check catches a member whose side-channel op sequence diverged, as on the main channel.
//   acquire: every CTA waits for every peer's ready (bounded) and takes y_i of member rank + dist_i.
//   push:    the CTAs stride over x_i's 16-byte vectors and store them into that member's y_i (remote
//            16-byte stores, UNROLL loads in flight per thread: at 4 ~43-45 GB/s per SM on 2x H200, ~25-30
//            on 4x H100 beside the attention; 8 and 16 keep more bytes in flight per SM).
//   finish:  the last CTA fences at system scope, signals done to every peer and waits for every
//            peer's done: when the kernel ends, the predecessor's stores into our y have landed.
#include "ring_shift.cuh"
#include "pk/op_protocol.cuh"

namespace pk {
namespace {

static_assert(kMaxShiftBuffers <= kMaxPublished, "a shift publishes every output in one mailbox");

// UNROLL: 16-byte loads each thread keeps in flight before their stores (kShiftUnrolls).
template <int UNROLL>
__global__ void __launch_bounds__(kShiftThreads) ring_shift_kernel(Group g, ShiftBuffers b) {
  OpProtocolOn<kSideChannel> op(g);
  void* local[kMaxShiftBuffers];
#pragma unroll
  for (int i = 0; i < kMaxShiftBuffers; ++i) local[i] = i < b.n ? b.y[i] : nullptr;
  op.publish(local, b.n);
  pgl<char> ys[kMaxShiftBuffers];
  if (op.acquire(local, ys)) {
    const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t nthreads = int64_t(gridDim.x) * blockDim.x;
    for (int i = 0; i < b.n; ++i) {
      const int succ = (g.rank + b.dist[i]) % g.size;  // the handler checked 1 <= dist < G
      const uint4* src = reinterpret_cast<const uint4*>(b.x[i]);
      uint4* dst = reinterpret_cast<uint4*>(ys[i][succ]);
      const int64_t vecs = b.bytes[i] / 16;
      // UNROLL loads in flight before their stores: the remote stores are posted, so a thread's
      // throughput is bounded by how many loads it keeps outstanding.
      int64_t v = tid;
      for (; v + (UNROLL - 1) * nthreads < vecs; v += UNROLL * nthreads) {
        uint4 r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) r[u] = __ldcs(src + v + u * nthreads);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) dst[v + u * nthreads] = r[u];
      }
      for (; v < vecs; v += nthreads) dst[v] = __ldcs(src + v);
      // A tail of < 16 bytes (sizes the handler let through that are not whole vectors).
      const int64_t tail = vecs * 16;
      for (int64_t t = tail + tid; t < b.bytes[i]; t += nthreads) ys[i][succ][t] = b.x[i][t];
    }
  }
  op.finish();
}

}  // namespace

cudaError_t launch_ring_shift(const Group& g, const ShiftBuffers& b, int ctas, int unroll, cudaStream_t stream) {
  if (b.n < 1 || b.n > kMaxShiftBuffers || ctas < 1) return cudaErrorInvalidValue;
  switch (unroll) {
    case 4: ring_shift_kernel<4><<<ctas, kShiftThreads, 0, stream>>>(g, b); break;
    case 8: ring_shift_kernel<8><<<ctas, kShiftThreads, 0, stream>>>(g, b); break;
    case 16: ring_shift_kernel<16><<<ctas, kShiftThreads, 0, stream>>>(g, b); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

std::vector<const void*> ring_shift_kernels() {
  return {reinterpret_cast<const void*>(&ring_shift_kernel<4>), reinterpret_cast<const void*>(&ring_shift_kernel<8>),
          reinterpret_cast<const void*>(&ring_shift_kernel<16>)};
}

}  // namespace pk
