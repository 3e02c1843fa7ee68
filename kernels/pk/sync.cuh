// signal / wait / barrier across GPUs, with release/acquire semantics at system scope.
// Waits are bounded: after `Group::timeout_ns` a wait records an error (host-mapped, so the host
// can name the op and the missing device) and gives up instead of hanging the GPU.
#pragma once
#include <cstdint>
#include "group.cuh"

namespace pk {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Records the first error of this device; later ones are dropped (the first is the cause).
__device__ inline void record_error(const Group& g, int32_t code, int peer_rank, int32_t peer_op = 0) {
  if (atomicCAS(&g.err->code, 0, code) == 0) {
    g.err->op = g.op;
    g.err->device_slot = g.my_slot();
    g.err->peer_slot = g.slot[peer_rank];
    g.err->peer_op = peer_op;
    __threadfence_system();
  }
  atomicExch(&g.self()->aborted, 1u);
}

// signal: add `val` to counter `index` of the peer's array (e.g. &ctrl[peer]->done[my_slot]).
// Release: every write this thread made, or observed, before the signal is visible to a peer that
// acquires the new value.
__device__ __forceinline__ void signal(uint64_t* peer_counter, uint64_t val = 1) {
  red_add_release_sys(peer_counter, val);
}

// wait_until: spin until reached() (which must load with acquire semantics). Returns false after
// Group::timeout_ns (recording `code` against `peer_rank`), or at once when an earlier wait on this
// device already timed out.
template <typename Reached>
__device__ inline bool wait_until(Reached reached, const Group& g, int peer_rank, int32_t code) {
  if (reached()) return true;
  const uint64_t start = global_timer_ns();
  const volatile uint32_t* aborted = &g.self()->aborted;
  for (uint32_t spins = 0;; ++spins) {
    if (reached()) return true;
    if ((spins & 63u) == 63u) {
      if (*aborted) return false;
      if (global_timer_ns() - start > g.timeout_ns) {
        record_error(g, code, peer_rank);
        return false;
      }
    }
  }
}

// wait: spin until *counter >= expected (acquire).
__device__ inline bool wait(const uint64_t* counter, uint64_t expected, const Group& g, int peer_rank,
                            int32_t code) {
  return wait_until([&] { return ld_acquire_sys(counter) >= expected; }, g, peer_rank, code);
}

// wait_word: spin until reached(v) for the acquire-loaded 32-bit word (a flag or count written by a
// peer), then order it before later TMA (async-proxy) reads of the data it guards.
template <typename Reached>
__device__ inline bool wait_word(const uint32_t* word, Reached reached, const Group& g, int peer_rank, int32_t code) {
  const bool ok = wait_until(
      [&] {
        uint32_t v;
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(word) : "memory");
        return reached(v);
      },
      g, peer_rank, code);
  asm volatile("fence.proxy.async.global;" ::: "memory");
  return ok;
}

// barrier: every member signals every other member, then waits for all of them. Uses the
// `test_flag` counters (a separate channel from the op protocol) and a caller-provided epoch.
// Call from one thread per peer (threadIdx.x < size).
__device__ inline bool barrier(const Group& g, uint64_t epoch) {
  const int t = threadIdx.x;
  bool ok = true;
  if (t < g.size && t != g.rank) {
    signal(&g.ctrl[t]->test_flag[g.my_slot()]);
    ok = wait(&g.self()->test_flag[g.slot[t]], epoch, g, t, kTimeoutTest);
  }
  return ok;
}

}  // namespace pk
