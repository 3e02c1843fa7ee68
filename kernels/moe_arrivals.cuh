// The index math of the fused dispatch + first grouped GEMM (kernels/moe_gemm_kernel.cuh) that both sides of
// an arrival count must agree on: which chunk of rows a comm CTA pushes next, how many of a chunk's rows land
// (below the R bound), and how many rows of (source, local expert) a GEMM tile waits for. pk_jax/moe/overlap.py
// mirrors it line for line (comm_items, landed_rows, expected_arrivals) and tests/test_moe_overlap_cpu.py
// checks the mirror against the dispatch layout. Docs: docs/design.md, "Dispatch + grouped GEMM".
#pragma once
#include <cstdint>

namespace pk::moe {

// Rows a comm CTA pushes between two arrival signals: one signal (a system-scope fence per thread and one
// remote add) per 64 rows of H = 7168 bf16 (~0.9 MB) keeps the signalling cost small and experts fine-grained.
constexpr int kChunkRows = 64;

__host__ __device__ __forceinline__ int32_t chunks_of(int32_t rows) { return (rows + kChunkRows - 1) / kChunkRows; }

// Destination of a member's `i`-th pair of a local expert (i = 0 .. G-1): the peers first (their rows cross
// NVLink, the slow part), its own member last (local stores).
__host__ __device__ __forceinline__ int comm_dest(int rank, int size, int i) { return (rank + 1 + i) % size; }

// Rows of a run of `count` rows starting at row `first` of the receive buffer that land below R (the rows
// past R drop: dispatch's recv_rows bound).
__host__ __device__ __forceinline__ int32_t landed_rows(int64_t first, int64_t count, int64_t recv_rows) {
  const int64_t room = recv_rows - first;
  return room <= 0 ? 0 : int32_t(room < count ? room : count);
}

}  // namespace pk::moe
