// One side stream per device for work that must run *beside* XLA's stream (the ring shift): created
// lazily on first use, kept for the process, keyed by CUDA ordinal. Host state, so the handlers that use
// it are not command-buffer compatible (a captured graph would replay the side launch on XLA's stream).
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <vector>

namespace pk {

struct SideStream {
  cudaStream_t stream = nullptr;     // highest priority: its few CTAs get the SMs the attention left free
  cudaEvent_t main_ready = nullptr;  // recorded on XLA's stream, waited on by the side stream (start)
  cudaEvent_t side_done = nullptr;   // recorded on the side stream, waited on by XLA's stream (done)
  std::mutex mutex;                  // record + wait pairs of one device never interleave; guards the marks too
  int ordinal = 0;
  // Marks of the windowed exchanges in flight, by their token's address (mark_exchange), and spare events.
  std::map<const void*, cudaEvent_t> marks;
  std::vector<cudaEvent_t> spare_marks;
};

// The device's side stream, created on first call (throws std::runtime_error if CUDA refuses).
SideStream& side_stream(int ordinal);
// The device's side stream if one was created, else nullptr (nothing was ever issued on it).
SideStream* existing_side_stream(int ordinal);

// An exchange's mark: an event recorded on the side stream right after one exchange's copies, found again by the
// address of the exchange's token, so that its `done` waits for that exchange (and what was queued before it),
// not for the exchanges queued behind it since. Why: Ulysses starts chunk i+1's q, k and v exchanges together and
// places each own block once its exchange has landed; a wait that drained the side stream held q's placement
// until v had landed. The caller holds `s.mutex`. mark_exchange replaces a mark left at that address (an exchange
// whose done never ran); forget_exchange_mark drops one, so that a token at a reused address drains.
cudaError_t mark_exchange(SideStream& s, const void* token);
void forget_exchange_mark(SideStream& s, const void* token);
// The mark of `token`'s exchange, removed from the table (nullptr: none, drain instead); give it back with
// spare_exchange_mark once a wait on it is enqueued (a wait keeps the record it saw).
cudaEvent_t take_exchange_mark(SideStream& s, const void* token);
void spare_exchange_mark(SideStream& s, cudaEvent_t mark);

}  // namespace pk
