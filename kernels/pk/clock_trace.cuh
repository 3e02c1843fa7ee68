// A kernel's own timeline, for diagnosis builds only (attention's PK_ATTN_TRACE): one thread per role stamps its steps
// with the SM clock into a global buffer of kCtas x kRoles x kEvents (clock, word) pairs. Entry 0 of a role holds
// (count, kMagic); word = event (8 bits) | task (12 bits) | index (12 bits). scripts/attention_trace.py reads it.
// The stamps are a few instructions and a global store each: read a traced build's cycles against each other, not
// against an untraced build's times.
#pragma once
#include <cstddef>
#include <cstdint>

namespace pk::clock_trace {

constexpr int kCtas = 8, kRoles = 4, kEvents = 8192;  // CTAs 0..7; roles: the kernel's (attention: loader, consumers, storer)
constexpr uint32_t kMagic = 0x7ACE;
constexpr size_t kWords = size_t(kCtas) * kRoles * kEvents * 2;  // 32-bit words the buffer must hold

// `count`: the role's events so far (the caller's register, 0 at kernel start); a full role drops later events.
__device__ __forceinline__ void stamp(uint32_t* buffer, int role, uint32_t& count, int event, int task, int index) {
  if (blockIdx.x >= kCtas || count + 1 >= kEvents) return;
  uint32_t clock;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(clock)::"memory");  // "memory": stays between the waits around it
  uint32_t* at = buffer + (size_t(blockIdx.x) * kRoles + role) * kEvents * 2;
  ++count;
  at[2 * count] = clock;
  at[2 * count + 1] = (uint32_t(event) << 24) | ((uint32_t(task) & 0xFFFu) << 12) | (uint32_t(index) & 0xFFFu);
  at[0] = count;
  at[1] = kMagic;
}

}  // namespace pk::clock_trace
