// dQ out of the attention backward kernel's float32 accumulator: (B, N, Tq_pad, D) in 64 x 64 chunks of
// wgmma accumulator order -> (B, Tq, N, D) row-major, times scale, in bf16 / f16 / f32. One CTA per 64-row
// block of a head: the block (64 x D floats, contiguous) is read coalesced into shared memory, then each row
// leaves as one contiguous D-element run. XLA's fusion of the same 10-D transpose ran at ~0.3 TB/s
// (3.8 ms per ring step at 4 GPUs, S 12288: docs/NOTES.md session 13). Also the head split's dK / dV cast.
#pragma once
#include <cuda_runtime.h>

#include "../ffi/tensor_map.h"

namespace pk::attention_bwd {

struct DqConvert {
  const float* acc;  // (batch, heads, tq_pad, head_dim) float32, the kernel's chunk order
  void* dq;          // (batch, dq_seq, heads, head_dim) from this call's row 0, `out_type`
  int batch, heads, tq, tq_pad, head_dim;
  float scale;
  ElemType out_type;
  int dq_seq = 0;    // rows of dq per batch: tq (0), or a ring's float32 dQ state's length
  bool add = false;  // float32 only: dq += dQ (ring attention's dQ state, in place) instead of dq = dQ
};

// Launches the conversion on `stream` (after the backward kernel, same stream).
cudaError_t launch_dq_convert(const DqConvert& c, cudaStream_t stream);
// A head split's float32 dK / dV sums (dkv_acc: dK's `count` elements, then dV's) -> dk and dv in `type`.
cudaError_t launch_dkv_convert(const float* dkv_acc, void* dk, void* dv, size_t count, ElemType type,
                               cudaStream_t stream);
// Loads its kernels on the current device (with the backward kernels, before any cross-GPU wait).
cudaError_t configure_dq_convert();

}  // namespace pk::attention_bwd
