// Register-level transfers: VEC-byte loads and stores that work on local and peer addresses alike
// (peer memory is mapped into this device's address space). Best for element-wise work such as
// reductions, where data must pass through registers anyway (paper table 2).
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace pk {

template <int VEC> struct vec_storage;
template <> struct vec_storage<16> { using type = uint4; };
template <> struct vec_storage<8> { using type = uint2; };
template <> struct vec_storage<4> { using type = uint32_t; };
template <> struct vec_storage<2> { using type = uint16_t; };

template <int VEC>
using vec_t = typename vec_storage<VEC>::type;

// Streaming load: data that is read once should not evict the L2 working set of the next kernel.
template <int VEC>
__device__ __forceinline__ vec_t<VEC> load_vec(const char* base, int64_t index) {
  return __ldcs(reinterpret_cast<const vec_t<VEC>*>(base) + index);
}

template <int VEC>
__device__ __forceinline__ void store_vec(char* base, int64_t index, const vec_t<VEC>& v) {
  reinterpret_cast<vec_t<VEC>*>(base)[index] = v;
}

// Element access inside a vector, for arithmetic in float.
template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float(float x) { return x; }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }

template <typename T, int VEC>
struct lanes {
  static constexpr int kCount = VEC / sizeof(T);
  __device__ static void add(float (&acc)[kCount], const vec_t<VEC>& v) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < kCount; ++i) acc[i] += to_float(e[i]);
  }
  __device__ static vec_t<VEC> pack(const float (&acc)[kCount]) {
    vec_t<VEC> v;
    T* e = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int i = 0; i < kCount; ++i) e[i] = from_float<T>(acc[i]);
    return v;
  }
};

}  // namespace pk
