// The ring shift by copy engines (PK_JAX_RING_SHIFT_ENGINE=copy): every member of the group is a GPU of this
// process, so a member's output buffers are addresses here and the handshakes can be CUDA events between the
// members' side streams instead of flags in symmetric memory. No SM does any of it: the attention beside it keeps
// every SM, and the copy engine pushes at the link rate (396 GB/s to a peer on 4x H200, against ~170-220 GB/s of
// the SM kernel beside the attention on 4x H100).
//
// Per shift, on member r's side stream (already ordered after XLA's stream, so x is written and this member's
// y may be overwritten):
//   1. record `ready` and post it with y's addresses on a process-wide board (host memory);
//   2. for each buffer i, wait (host, bounded) for member t = r + d_i's post of the same shift, make the side
//      stream wait for its `ready` (t's XLA stream reached this shift: its y is free), and copy x_i into t's
//      y_i with cudaMemcpyPeerAsync;
//   3. record `copied` and post it;
//   4. wait (host, bounded) for member r - d_i's `copied` of the same shift and make the side stream wait for
//      it: when the side stream gets past it, this member's y holds the sender's x.
// Every member posts before it waits, so the host waits cannot form a cycle. Shifts are matched by their order
// on the group (every member runs the same program). The board's slots and events are reused round robin;
// a slot is reused only after every member that reads it has.
//
// The same handshake carries the windowed all-to-all (copy_engine_all_to_all): every member's blocks go straight
// from strided windows of its input into strided windows of each target's one output, by 3-D copies, so no slice
// before the exchange and no assembly after it (Ulysses' exchanges, pk_jax/context/window_exchange.py).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../kernels/ring_shift.cuh"

namespace pk {

// Enqueues the shift of `b` on `side` (a stream of the device `ordinals[g.rank]`, ordered after XLA's stream).
// `ordinals[j]`: the CUDA ordinal of member j (all in this process). Returns an error message or "" (a peer
// that does not reach the same shift within the runtime's timeout is an error, not a hang).
std::string copy_engine_shift(const Group& g, const int* ordinals, const ShiftBuffers& b, cudaStream_t side);

// A block of depth x height rows of `width` contiguous bytes, in cudaMemcpy3D's layout on both sides: row y of
// slice z at base + z * slice + y * pitch (slice a multiple of pitch, pitch >= width).
struct Block3D {
  int64_t width, height, depth;
  int64_t src_pitch, src_slice, dst_pitch, dst_slice;
};

// The windowed all-to-all of one member: the block for member t starts at x + src_offset + t * src_stride, the
// block from member r lands at y + dst_offset + r * dst_stride (y: this member's output, `y` of every member
// written by all of them). The own block (t = r) is a local copy.
struct WindowExchange {
  const char* x;
  char* y;
  Block3D block;
  int64_t src_offset, src_stride, dst_offset, dst_stride;
  bool own_block;  // copy this member's own block too (false: the caller places it on XLA's stream)
};

// Enqueues the windowed all-to-all on `side` as copy_engine_shift does its shift (same board, same handshake).
std::string copy_engine_all_to_all(const Group& g, const int* ordinals, const WindowExchange& w, cudaStream_t side);

// Forgets every shift posted so far (Runtime::reset, after a timeout: members may have stopped at different
// shifts). No shift may be in flight.
void reset_copy_shift_boards();

}  // namespace pk
