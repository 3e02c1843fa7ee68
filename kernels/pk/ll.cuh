// LL ("low latency") lines for small messages, after NCCL's LL protocol: 8 bytes = 4 payload bytes +
// a 4-byte flag (the op's epoch and code, ll_flag), written with one 8-byte store. An aligned 8-byte store is
// single-copy atomic, so a reader that sees the flag also sees that op's payload: the data carries
// its own ready signal, and a transfer costs one one-way NVLink trip instead of data + fence + flag.
#pragma once
#include <cstdint>
#include "sync.cuh"

namespace pk {

__device__ __forceinline__ void ll_store(uint64_t* line, uint32_t data, uint32_t flag) {
  const uint64_t v = (uint64_t(flag) << 32) | data;
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(line), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ll_load(const uint64_t* line) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(line) : "memory");
  return v;
}

// A line's flag: the pair's small-op epoch (low 28 bits) and the op code (4 bits). The code tells a
// member that ran another op at this point (its lines carry this epoch and another code) from one
// that is only late, so diverged op sequences fail at once instead of mixing payloads.
__device__ __forceinline__ uint32_t ll_flag(uint64_t epoch, int32_t op) {
  return (uint32_t(epoch) << 4) | (uint32_t(op) & 0xFu);
}
__device__ __forceinline__ uint32_t ll_parity(uint32_t flag) { return (flag >> 4) & 1u; }

__device__ __forceinline__ bool ll_ready(uint64_t v, uint32_t flag) { return uint32_t(v >> 32) == flag; }

// Spins until the line carries `flag`; its payload goes to `data`. False after the bounded wait gave
// up (kTimeoutSmall recorded against `peer_rank`) or when the line carries this epoch with another op
// code (kOpMismatch, with the peer's op).
__device__ inline bool ll_wait(const uint64_t* line, uint32_t flag, uint32_t& data, const Group& g, int peer_rank) {
  uint64_t v = 0;
  bool other_op = false;
  const bool ok = wait_until(
      [&] {
        v = ll_load(line);
        const uint32_t got = uint32_t(v >> 32);
        other_op = got != flag && (got >> 4) == (flag >> 4);
        return got == flag || other_op;
      },
      g, peer_rank, kTimeoutSmall);
  data = uint32_t(v);
  if (ok && other_op) {
    record_error(g, kOpMismatch, peer_rank, int32_t(uint32_t(v >> 32) & 0xFu));
    return false;
  }
  return ok;
}

// U lines at once (all loads in flight before the first check), then spins on the ones not ready.
template <int U>
__device__ inline bool ll_receive(const uint64_t* lines, const int64_t (&idx)[U], const bool (&valid)[U], uint32_t flag,
                                  uint32_t (&data)[U], const Group& g, int peer_rank) {
  uint64_t v[U];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (valid[u]) v[u] = ll_load(lines + idx[u]);
  bool ok = true;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!valid[u]) continue;
    if (ll_ready(v[u], flag)) {
      data[u] = uint32_t(v[u]);
    } else {
      ok = ll_wait(lines + idx[u], flag, data[u], g, peer_rank) && ok;
    }
  }
  return ok;
}

// U lines from possibly different senders (line[u], flag[u], peer[u]): all loads in flight first.
template <int U>
__device__ inline bool ll_receive_each(const uint64_t* const (&line)[U], const uint32_t (&flag)[U],
                                       const int (&peer)[U], const bool (&valid)[U], uint32_t (&data)[U],
                                       const Group& g) {
  uint64_t v[U];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (valid[u]) v[u] = ll_load(line[u]);
  bool ok = true;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!valid[u]) continue;
    if (ll_ready(v[u], flag[u])) {
      data[u] = uint32_t(v[u]);
    } else {
      ok = ll_wait(line[u], flag[u], data[u], g, peer[u]) && ok;
    }
  }
  return ok;
}

// Chunk-flag protocol (small_chunked): a chunk's flag, stored with release after its bytes were
// acknowledged, and the receiver's wait for it (acquire), with the LL lines' op-code check.
__device__ __forceinline__ void st_release_sys_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ inline bool chunk_flag_wait(const uint32_t* f, uint32_t flag, const Group& g, int peer_rank) {
  uint32_t got = 0;
  const bool ok = wait_until(
      [&] {
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(got) : "l"(f) : "memory");
        return got == flag || (got >> 4) == (flag >> 4);
      },
      g, peer_rank, kTimeoutSmall);
  if (ok && got != flag) {
    record_error(g, kOpMismatch, peer_rank, int32_t(got & 0xFu));
    return false;
  }
  return ok;
}

// A 16-bit or 32-bit element a peer wrote into this device's memory: read through L2 (not L1).
template <typename T>
__device__ __forceinline__ T ld_cg(const T* p) {
  if constexpr (sizeof(T) == 4) {
    const uint32_t v = __ldcg(reinterpret_cast<const unsigned int*>(p));
    T t;
    memcpy(&t, &v, 4);
    return t;
  } else {
    const unsigned short v = __ldcg(reinterpret_cast<const unsigned short*>(p));
    T t;
    memcpy(&t, &v, 2);
    return t;
  }
}

}  // namespace pk
