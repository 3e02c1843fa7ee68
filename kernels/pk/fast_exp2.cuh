// exp2 on the MUFU unit alone, for softmax weights.
#pragma once

namespace pk {

// ex2.approx.ftz: one MUFU.EX2. exp2f (without --use_fast_math) wraps the same MUFU.EX2 in a denormal range
// fix-up (FSETP, two predicated FMULs: seen in the attention kernels' SASS), three more issue slots per score
// on the softmax's critical path. The only difference: results below 2^-126 flush to 0, which changes no
// softmax weight that matters (exp2(-inf) is 0 either way).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace pk
