// NVLink multicast (NVSwitch in-network) operations on a multicast address (ffi/multicast_group.h):
// a load that returns the sum over every member's copy, a store that lands in every member's copy,
// and a reduction into every member's copy. sm_90+. Built and compile-checked only: these are never
// executed on our machines (multicast can take a shared host's GPUs out of service).
#pragma once
#include <cstdint>

namespace pk::multimem {

// 16 bytes: 8 bf16 / 8 f16 as four packed pairs, or 4 f32.
struct alignas(16) Vec16 {
  uint32_t w[4];
};

// Sum over every member of the 16 bytes at multicast address `mc`, accumulated in float32 by the switch
// (.acc::f32) and rounded once to the element type.
__device__ __forceinline__ Vec16 ld_reduce_bf16x8(const void* mc) {
  Vec16 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(mc)
               : "memory");
  return v;
}

__device__ __forceinline__ Vec16 ld_reduce_f16x8(const void* mc) {
  Vec16 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(mc)
               : "memory");
  return v;
}

__device__ __forceinline__ Vec16 ld_reduce_f32x4(const void* mc) {
  Vec16 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(mc)
               : "memory");
  return v;
}

// Stores 16 bytes into every member's copy. The bits are stored as-is, so one form serves every type.
__device__ __forceinline__ void st_16(void* mc, const Vec16& v) {
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(mc), "r"(v.w[0]),
               "r"(v.w[1]), "r"(v.w[2]), "r"(v.w[3])
               : "memory");
}

// Adds `v` to the counter in every member's copy, releasing this thread's earlier writes (and those it
// observed) at system scope: the multicast barrier's arrive.
__device__ __forceinline__ void red_add_release_sys(uint32_t* mc_counter, uint32_t v) {
  asm volatile("multimem.red.release.sys.global.add.u32 [%0], %1;" ::"l"(mc_counter), "r"(v) : "memory");
}

// Orders accesses made through the multicast alias against later ones through the unicast address of
// the same memory (and vice versa): a different virtual alias is a different proxy.
__device__ __forceinline__ void fence_alias() { asm volatile("fence.proxy.alias;" ::: "memory"); }

}  // namespace pk::multimem
