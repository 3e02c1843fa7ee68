// What the attention kernels (forward and backward) share on the host: the shape checks and the
// dispatch to their bf16 / f16 x head_dim 64 / 128 instantiations.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../ffi/tensor_map.h"

namespace pk::attention_shape {

// Throws std::invalid_argument, prefixed by `op` ("pk_jax attention", ...), for what no attention kernel takes.
inline void check(const std::string& op, ElemType type, int batch, int tq, int tk, int heads, int kv_heads,
                  int head_dim, float scale) {
  if (type == ElemType::kF32) throw std::invalid_argument(op + ": inputs must be bfloat16 or float16");
  if (head_dim != 64 && head_dim != 128)
    throw std::invalid_argument(op + ": head_dim must be 64 or 128, got " + std::to_string(head_dim));
  if (batch <= 0 || tq <= 0 || tk <= 0 || heads <= 0 || kv_heads <= 0)
    throw std::invalid_argument(op + ": empty q or k/v (batch, lengths and heads must be > 0)");
  if (heads % kv_heads)
    throw std::invalid_argument(op + ": kv_heads (" + std::to_string(kv_heads) + ") must divide the query heads (" +
                                std::to_string(heads) + ")");
  if (!(scale > 0.f) || !std::isfinite(scale)) throw std::invalid_argument(op + ": scale must be a finite positive number");
}

// f(T{}, std::integral_constant<int, D>{}) for the element type and head dim (both checked by check()).
template <class F>
void dispatch(ElemType type, int head_dim, F&& f) {
  const bool bf16 = type == ElemType::kBF16;
  if (head_dim == 64) {
    if (bf16) f(__nv_bfloat16{}, std::integral_constant<int, 64>{});
    else f(__half{}, std::integral_constant<int, 64>{});
  } else {
    if (bf16) f(__nv_bfloat16{}, std::integral_constant<int, 128>{});
    else f(__half{}, std::integral_constant<int, 128>{});
  }
}

}  // namespace pk::attention_shape
