// Host-side entry points of the fused MoE dispatch and combine kernels (kernels/moe_dispatch.cu).
// Protocol and accounting: docs/design-moe.md.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "collectives.cuh"

namespace pk {

// Static sizes of one routing, as the kernels see them. Assignment a = t * top_k + k of this member.
struct MoeDims {
  int64_t tokens;     // T: rows of x (dispatch, send) / of the combined output
  int32_t top_k;      // K
  int32_t experts;    // E (dispatch with counts only): global experts, L = E / G per member
  int64_t recv_rows;  // R: rows of every member's receive buffer (dispatch, send) or expert output y (combine)
  int64_t row_vecs;   // vec_bytes-wide vectors per row (x, recv, y and out rows have the same length)
  int32_t zero_tail = 1;  // dispatch, send: 1 zeroes recv's rows past those that arrived; 0 leaves them
};

// Forward dispatch: counts each member's rows per global expert (key[a] in [0, E); anything else is
// a dropped assignment), publishes them to every peer with the receive buffer's address, derives
// every (source, destination, expert) offset in rank order, and pushes row x[a / K] of each kept
// assignment to row base(dest, expert) + pos[a] of its destination's `recv` (rows at or past R drop).
// Outputs: recv (R rows; zero after the rows that arrived unless d.zero_tail is 0), recv_counts (G, L) rows of each local
// expert from each source, send_row (T * K) dest * R + row of each assignment or -1 if dropped.
// dedup: a token's row crosses to each peer once (at its primary row, MoeRoute::primary); src_of (R
// int32, scratch published with recv) gets each received row's primary, and a second, local launch
// copies the non-primary rows from their primaries. dedup = false: every kept choice's row is stored
// (src_of unused).
cudaError_t launch_moe_dispatch(const Group& g, const MoeDims& d, int vec_bytes, bool dedup, const void* x,
                                const int32_t* key, const int32_t* pos, void* recv, int32_t* src_of,
                                int32_t* recv_counts, int32_t* send_row, const LaunchLimits& lim,
                                cudaStream_t stream);

// Dispatch with the layout known (the backward of combine): row x[a / K] (times scale[a] in float32
// when `scaled`) to row send_row[a] % R of member send_row[a] / R; rows of `recv` from
// min(*received, R) on are zeroed (unless d.zero_tail is 0).
cudaError_t launch_moe_send(const Group& g, const MoeDims& d, int vec_bytes, DType dtype, bool scaled, const void* x,
                            const int32_t* send_row, const float* scale, const int32_t* received, void* recv,
                            const LaunchLimits& lim, cudaStream_t stream);

// Combine: pulls each assignment's row back from member send_row[a] / R's y. gather = false:
// out[t] = sum over k (in order) of weights[t * K + k] * row, float32, rounded once (T rows);
// gather = true: out[a] = the row, zero if dropped (T * K rows).
cudaError_t launch_moe_combine(const Group& g, const MoeDims& d, int vec_bytes, DType dtype, bool gather, const void* y,
                               const int32_t* send_row, const float* weights, void* out, const LaunchLimits& lim,
                               cudaStream_t stream);

// Combine (not gather) by pushed partials (kernels/moe_partials.cu): each member pushes, per (peer home,
// token) with kept choices here, the float32 sum of w * y over them (choice order) into the home's `partial`
// ((G - 1) slots of T x H' floats, published like recv; slot moe_partial_slot); a second, local launch adds
// the members' partials in rank order (its own from its y) and rounds once into out (T, H').
cudaError_t launch_moe_combine_partials(const Group& g, const MoeDims& d, int vec_bytes, DType dtype, const void* y,
                                        const int32_t* send_row, const float* weights, float* partial, void* out,
                                        const LaunchLimits& lim, cudaStream_t stream);

// Every kernel of moe_dispatch.cu and moe_partials.cu, for the up-front loading (collective_kernels()).
std::vector<const void*> moe_kernels();
std::vector<const void*> moe_partial_kernels();

}  // namespace pk
