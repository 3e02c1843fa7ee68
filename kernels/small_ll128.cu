// all_reduce "small_ll128": the one-shot LL all_reduce with 128-byte lines (pk/ll128.cuh). Every member
// stores all of x, as lines of 120 payload bytes + a flag word, into every peer's area (chunk_data of
// the receiver's control block, sender's slot, the op's parity), then sums the G members in rank order
// in float32 from x and its own area, each line waited for by its flag. One one-way trip, no fence, no
// per-call handshake, 128 / 120 of the payload on the wire (the 8-byte LL lines send 2x). Epochs,
// parity and the last-CTA epoch advance are the LL path's (pk/small_epochs.cuh): every pair exchanges
// lines in every op, so the parity argument of small_collectives.cu holds unchanged.
#include "small_ll128.cuh"

#include <cstring>

#include "pk/env.h"
#include "pk/ll128.cuh"
#include "pk/small_epochs.cuh"
#include "pk/vec.cuh"

namespace pk {
namespace {

static_assert(kOpAllReduceLL128 <= 0xF, "ll_flag keeps 4 bits of the op code");

constexpr int kLL128Threads = 256;
// Lines per CTA (a multiple of the 32 lines one pass of 8 warps covers); CTAs up to one per SM, so all
// are resident and no receiver waits on a sender that cannot start. PK_JAX_SMALL_LL128_LINES_PER_CTA
// overrides it for sweeps (read once per process).
constexpr int64_t kLL128LinesPerCta = 32;
// One quad (4 lines) per warp at a time. Four in flight when sending and two when receiving (session 31, 2x H200)
// made every size slower: 5.6-6.7 us from 4 KiB to 512 KiB against 3.7-4.9, and 8 MiB 50.7 against 47.2-47.7 us.

int64_t ll128_lines_per_cta() {
  static const int64_t v = env_or("PK_JAX_SMALL_LL128_LINES_PER_CTA", kLL128LinesPerCta, 32, 1 << 16) / 32 * 32;
  return v;
}

// The 8 payload bytes at offset o (a multiple of 8) of a buffer of n bytes; bytes past n read as zero.
// n is a whole number of 16-bit or 32-bit elements, so the tail goes by 16-bit halves.
__device__ __forceinline__ uint64_t load_u64(const char* base, int64_t o, int64_t n) {
  if (o + 8 <= n) return *reinterpret_cast<const uint64_t*>(base + o);
  uint64_t v = 0;
  for (int k = 0; k < 4 && o + 2 * k < n; ++k)
    v |= uint64_t(*reinterpret_cast<const uint16_t*>(base + o + 2 * k)) << (16 * k);
  return v;
}

__device__ __forceinline__ void store_u64(char* base, int64_t o, int64_t n, uint64_t v) {
  if (o + 8 <= n) {
    *reinterpret_cast<uint64_t*>(base + o) = v;
    return;
  }
  for (int k = 0; k < 4 && o + 2 * k < n; ++k) *reinterpret_cast<uint16_t*>(base + o + 2 * k) = uint16_t(v >> (16 * k));
}

// Float32 sums of one 16-byte part (4 floats or 8 16-bit elements), over vec.cuh's lanes.
template <typename T>
struct PartSum {
  using L = lanes<T, 16>;
  float acc[L::kCount] = {};
  __device__ void add(uint64_t a, uint64_t b) {
    const uint64_t v[2] = {a, b};
    uint4 u;
    memcpy(&u, v, 16);
    L::add(acc, u);
  }
  __device__ void pack(uint64_t& a, uint64_t& b) const {
    const uint4 u = L::pack(acc);
    uint64_t v[2];
    memcpy(v, &u, 16);
    a = v[0];
    b = v[1];
  }
};

template <typename T>
__global__ void __launch_bounds__(kLL128Threads, 1) small_all_reduce_ll128(Group g, const char* x, char* y, int64_t n) {
  __shared__ uint32_t flag[kMaxGroup];
  load_small_flags(g, flag, kOpAllReduceLL128);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t lines = ll128_lines(n);
  const int64_t quads = (lines + kLL128LinesPerWarp - 1) / kLL128LinesPerWarp;
  const int64_t warp0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  // This lane's part in member r's area (this device's slot), and in its own area (r's slot).
  const auto out_at = [&](int r, const LL128Part& at) {
    return g.ctrl[r]->chunk_data[ll_parity(flag[r])][g.my_slot()] + at.area_offset();
  };
  const auto in_at = [&](int r, const LL128Part& at) -> const char* {
    return g.self()->chunk_data[ll_parity(flag[r])][g.slot[r]] + at.area_offset();
  };
  // Own x's part of this lane's line: (a, b); part 7's b is the flag word, set per receiver.
  const auto own = [&](const LL128Part& at, uint64_t& a, uint64_t& b) {
    const int64_t o = at.payload_offset();
    a = load_u64(x, o, n);
    b = at.flag_lane() ? 0 : load_u64(x, o + 8, n);
  };
  // (1) Every line to every peer first, so no peer's receive waits on this member's receive.
  for (int64_t q = warp0; q < quads; q += warps) {
    const LL128Part at = ll128_part(q, lane);
    if (at.line >= lines) continue;  // whole lines drop out together: the stores stay 128-byte writes
    uint64_t a, b;
    own(at, a, b);
    for (int p = 1; p < g.size; ++p) {
      const int r = (g.rank + p) % g.size;
      ll128_store(out_at(r, at), a, at.flag_lane() ? ll128_flag_word(flag[r]) : b);
    }
  }
  // (2) The rank-order float32 sum: every peer's line loads first, then each waits for its flag.
  bool ok = true;
  for (int64_t q = warp0; q < quads; q += warps) {
    const LL128Part at = ll128_part(q, lane);
    const bool valid = at.line < lines;
    uint64_t va[kMaxGroup], vb[kMaxGroup];
#pragma unroll
    for (int r = 0; r < kMaxGroup; ++r) {
      va[r] = vb[r] = 0;
      if (r >= g.size || !valid) continue;  // continue, not break: a break left va / vb in local memory
      if (r == g.rank) {
        own(at, va[r], vb[r]);
      } else {
        ll128_load(in_at(r, at), va[r], vb[r]);
      }
    }
    PartSum<T> sum;
#pragma unroll
    for (int r = 0; r < kMaxGroup; ++r) {
      if (r >= g.size) continue;
      if (r != g.rank) {
        ok = ll128_settle(in_at(r, at), valid, at, ll128_flag_word(flag[r]), va[r], vb[r], g, r) && ok;
        if (at.flag_lane()) vb[r] = 0;  // the flag word is not payload
      }
      sum.add(va[r], vb[r]);
    }
    if (valid && ok) {
      uint64_t a, b;
      sum.pack(a, b);
      const int64_t o = at.payload_offset();
      store_u64(y, o, n, a);
      if (!at.flag_lane()) store_u64(y, o + 8, n, b);
    }
  }
  finish_small_op(g);
}

const void* ll128_kernel(DType dtype) {
  switch (dtype) {
    case DType::kF32: return reinterpret_cast<const void*>(&small_all_reduce_ll128<float>);
    case DType::kBF16: return reinterpret_cast<const void*>(&small_all_reduce_ll128<__nv_bfloat16>);
    case DType::kF16: return reinterpret_cast<const void*>(&small_all_reduce_ll128<__half>);
  }
  return nullptr;
}

}  // namespace

cudaError_t launch_ll128(const Group& g, DType dtype, const void* x, void* y, int64_t bytes, const LaunchLimits& lim,
                         cudaStream_t stream) {
  if (bytes <= 0 || bytes > kChunkedBytes || g.size < 2) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y)) & 7) return cudaErrorMisalignedAddress;
  const void* k = ll128_kernel(dtype);
  if (!k) return cudaErrorInvalidValue;
  const int64_t per_cta = ll128_lines_per_cta();
  int64_t grid = (ll128_lines(bytes) + per_cta - 1) / per_cta;
  grid = grid > lim.num_sms ? lim.num_sms : grid;  // all CTAs co-resident
  const char* s = static_cast<const char*>(x);
  char* d = static_cast<char*>(y);
  void* args[] = {const_cast<Group*>(&g), &s, &d, &bytes};
  return cudaLaunchKernel(k, dim3(unsigned(grid)), dim3(kLL128Threads), args, 0, stream);
}

std::vector<const void*> ll128_kernels() {
  return {ll128_kernel(DType::kF32), ll128_kernel(DType::kBF16), ll128_kernel(DType::kF16)};
}

}  // namespace pk
