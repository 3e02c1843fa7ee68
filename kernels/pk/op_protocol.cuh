// The per-launch protocol every collective kernel follows. Data moves directly between the XLA
// buffers of the group members (zero copy), so a launch must (1) learn the peers' buffer addresses
// for this op and know they are live, and (2) not return before every peer has stopped touching
// this device's buffers (XLA reuses them as soon as the kernel ends).
//
//   publish:  CTA 0 writes this device's buffer addresses (as each peer maps them: Group::map) into
//             every peer's mailbox, then signals ready (release). A device starts an op only after
//             its earlier work is done, so a published buffer is safe to read or write.
//   acquire:  every CTA waits for each peer's ready count to reach this op's epoch and loads the
//             peer addresses once into shared memory (then registers).
//   finish:   every CTA arrives on a local counter; the last one signals done to each peer and
//             waits for each peer's done, then advances the per-peer epochs (seq) in device memory.
//
// Epochs are per peer pair (seq[slot]), so groups of different mesh axes interleave freely and no
// host state is needed: the kernels replay correctly inside CUDA graphs.
//
// Channels (control_block.h): every op on XLA's stream uses kMainChannel (`OpProtocol`); the ring
// shift, which runs on a side stream at the same time as those ops, uses kSideChannel
// (`OpProtocolOn<kSideChannel>`): its own ready/done/mailbox/op_tag/seq/arrived, so neither takes the
// other's epochs. Errors and `aborted` stay shared: a timeout on either channel stops both.
#pragma once
#include "pgl.cuh"
#include "sync.cuh"

namespace pk {

// This op's epoch with member r on channel C (r == rank included: fused ops also signal items to themselves).
template <int C = kMainChannel>
__device__ __forceinline__ uint64_t op_epoch(const Group& g, int r) { return g.self()->channel[C].seq[g.slot[r]] + 1; }

template <int C>
struct OpProtocolOn {
  const Group& g;
  uint64_t epoch[kMaxGroup];  // this op's expected counter value for each peer (by rank)

  __device__ explicit OpProtocolOn(const Group& group) : g(group) {
#pragma unroll
    for (int r = 0; r < kMaxGroup; ++r) epoch[r] = r < g.size ? op_epoch<C>(g, r) : 0;
  }

  // Member b's block of this channel (b = a ControlBlock of any member).
  __device__ static ProtocolChannel& ch(ControlBlock* b) { return b->channel[C]; }

  // CTA 0 only: publish `n` addresses to every peer. Thread r handles peer r.
  __device__ void publish(const void* const* addrs, int n) const {
    const int r = threadIdx.x;
    if (blockIdx.x != 0 || r >= g.size || r == g.rank) return;
    uint64_t* box = ch(g.ctrl[r]).mailbox[g.my_slot()];
    for (int k = 0; k < n; ++k) box[k] = g.map.to_member(reinterpret_cast<uint64_t>(addrs[k]), r);
    ch(g.ctrl[r]).op_tag[g.my_slot()] = uint64_t(g.op);
    signal(&ch(g.ctrl[r]).ready[g.my_slot()]);
  }

  // After peer r's ready arrived: did it publish for this same op? A member that skipped an op (or
  // ran another) would otherwise pair its buffers with ours. Records kOpMismatch when not.
  __device__ bool same_op(int r) const {
    const int32_t theirs = int32_t(*reinterpret_cast<volatile const uint64_t*>(&ch(g.self()).op_tag[g.slot[r]]));
    if (theirs == g.op) return true;
    record_error(g, kOpMismatch, r, theirs);
    return false;
  }

  // All CTAs: wait until every peer published, then build one PGL per published address.
  // `local[k]` is this device's own k-th address. Returns false after a timeout.
  template <int N>
  __device__ bool acquire(void* const (&local)[N], pgl<char> (&out)[N]) const {
    __shared__ uint64_t addr[N][kMaxGroup];
    __shared__ int ok;
    const int r = threadIdx.x;
    if (r == 0) ok = 1;
    __syncthreads();
    if (r < g.size) {
      if (r == g.rank) {
        for (int k = 0; k < N; ++k) addr[k][r] = reinterpret_cast<uint64_t>(local[k]);
      } else if (wait(&ch(g.self()).ready[g.slot[r]], epoch[r], g, r, kTimeoutReady) && same_op(r)) {
        const uint64_t* box = ch(g.self()).mailbox[g.slot[r]];
        for (int k = 0; k < N; ++k) addr[k][r] = box[k];
      } else {
        ok = 0;
      }
    }
    __syncthreads();
    for (int k = 0; k < N; ++k) {
      out[k].size = g.size;
#pragma unroll
      for (int i = 0; i < kMaxGroup; ++i) out[k].ptr[i] = i < g.size ? reinterpret_cast<char*>(addr[k][i]) : nullptr;
    }
    return ok;
  }

  // One thread (a role of a warp-specialized CTA, where CTA barriers are not available): wait until
  // every peer published, then out[r] = member r's first published address. False after a timeout.
  __device__ bool acquire_thread(void* local, char* (&out)[kMaxGroup]) const {
    bool ok = true;
    for (int r = 0; r < g.size; ++r) {
      if (r == g.rank) {
        out[r] = static_cast<char*>(local);
      } else if (wait(&ch(g.self()).ready[g.slot[r]], epoch[r], g, r, kTimeoutReady) && same_op(r)) {
        out[r] = reinterpret_cast<char*>(ch(g.self()).mailbox[g.slot[r]][0]);
      } else {
        out[r] = nullptr;
        ok = false;
      }
    }
    return ok;
  }

  // All CTAs, after their last access to peer memory. Returns true in the last CTA to finish (after
  // every peer reported done: no peer touches this device's memory for this op any more).
  __device__ bool finish() const {
    __shared__ int last;
    ProtocolChannel& me = ch(g.self());
    __syncthreads();
    if (threadIdx.x == 0) {
      // GPU scope is enough here: the last CTA observes this arrival and its system-scope fence
      // below is cumulative, so this CTA's peer writes are ordered before `done`.
      __threadfence();
      last = atomicAdd(&me.arrived, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return false;
    const int r = threadIdx.x;
    if (r < g.size && r != g.rank) {
      __threadfence_system();  // every CTA's writes (seen through `arrived`) before done
      signal(&ch(g.ctrl[r]).done[g.my_slot()]);
      wait(&me.done[g.slot[r]], epoch[r], g, r, kTimeoutDone);
    }
    __syncthreads();
    if (r < g.size) me.seq[g.slot[r]] = epoch[r];  // own slot too: fused ops signal items to themselves
    if (r == 0) {
      me.arrived = 0;
      if (C == kMainChannel) {  // the fused kernels' counters belong to XLA's stream: never reset them from the side
        g.self()->next_task = 0;  // every CTA claimed its last task (and piece) before arriving
        g.self()->next_piece = 0;
      }
    }
    return true;
  }
};

// The protocol of every op on XLA's stream.
using OpProtocol = OpProtocolOn<kMainChannel>;

}  // namespace pk
