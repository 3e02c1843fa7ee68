// Bounded mbarrier waits for hunting hangs: a wait that has not seen its phase complete after a
// timeout returns false instead of spinning forever, so the caller can say which barrier, stage and
// parity it was stuck on and trap (the launch then fails with an error instead of a silent hang).
// For debug variants of kernels only: the kernels' fast paths use tma::mbar_wait.
#pragma once
#include <cstdint>

#include "tma.cuh"

namespace pk::debug {

// Nanoseconds of the GPU's global timer (the same clock on every SM).
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One probe of the barrier (mbarrier.try_wait may suspend the thread for a short, bounded time).
__device__ __forceinline__ bool try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(tma::smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// tma::mbar_wait with a limit: true once the phase with `parity` has completed, false after
// `timeout_ns` without it.
__device__ __forceinline__ bool wait_bounded(uint64_t* bar, uint32_t parity, uint64_t timeout_ns) {
  if (try_wait(bar, parity)) return true;
  const uint64_t start = now_ns();
  while (!try_wait(bar, parity))
    if (now_ns() - start > timeout_ns) return false;
  return true;
}

// The barrier's 64-bit state word as is, for a report (its phase bit, pending arrival count and
// transaction count are packed in a hardware-specific layout: compare words, do not decode them).
__device__ __forceinline__ unsigned long long raw_word(const uint64_t* bar) {
  unsigned long long v;
  asm volatile("ld.volatile.shared.u64 %0, [%1];" : "=l"(v) : "r"(tma::smem_addr(bar)) : "memory");
  return v;
}

// Spins for `ns` (lets other stuck threads reach their own timeouts and report before a trap).
__device__ __forceinline__ void spin_ns(uint64_t ns) {
  const uint64_t start = now_ns();
  while (now_ns() - start < ns) {
  }
}

}  // namespace pk::debug
