#include "copy_shift.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../kernels/pk/group.cuh"

namespace pk {
namespace {

// Shifts a member may run ahead of the slowest reader of its posts before it waits (a member passes step 2
// only when every target has posted, so members stay within a couple of shifts of each other).
constexpr int kBoardSlots = 16;
// Transfers per member and exchange: a shift's buffers, or an all-to-all's G - 1 targets.
constexpr int kMaxTransfers = 8;
static_assert(kMaxTransfers >= kMaxShiftBuffers && kMaxTransfers >= kMaxGroup - 1, "a post holds every transfer");

// What one member moves in one exchange (a shift or an all-to-all): transfer i goes to member rank + dist[i]
// and y[i] is where this member receives transfer i of member rank - dist[i]; a sender checks that its target
// posted the same `signature` (sizes and shape of the transfer).
struct Transfers {
  int n = 0;
  int32_t dist[kMaxTransfers] = {};
  char* y[kMaxTransfers] = {};
  int64_t signature[kMaxTransfers] = {};
};

// Enqueues transfer i's copy on the side stream into `target_y` of the member whose CUDA ordinal is given.
using CopyFn = std::function<cudaError_t(int i, char* target_y, int target_ordinal)>;

// One member's post for one exchange.
struct Post {
  uint64_t seq = ~uint64_t(0);  // which exchange of the group this slot holds
  int n = 0;                    // its transfers, their signatures and distances: a sender checks it pairs with the same op
  int64_t signature[kMaxTransfers] = {};
  int32_t dist[kMaxTransfers] = {};
  char* y[kMaxTransfers] = {};
  cudaEvent_t ready = nullptr;   // created once per slot on the member's device, recorded per shift
  cudaEvent_t copied = nullptr;
  bool copied_posted = false;
  int reads_left = 0;            // reads of y/ready and of copied still owed by other members
};

// Every shift of one group (members in rank order, named by their device slots).
struct Board {
  std::mutex mutex;
  std::condition_variable changed;
  // A failed shift stops every shift of the group until Runtime::reset (members may have stopped at different
  // shifts, and a late peer must not pair with a dead post); reset bumps the generation, so a thread still
  // inside a shift from before it writes nothing more.
  std::string failed;
  uint64_t generation = 0;
  std::vector<uint64_t> next_seq;                   // per rank: the next shift this member starts
  std::vector<std::array<Post, kBoardSlots>> post;  // per rank, per slot
};

std::mutex boards_mutex;

std::map<std::vector<int>, std::unique_ptr<Board>>& boards() {
  static auto* b = new std::map<std::vector<int>, std::unique_ptr<Board>>();  // kept for the process
  return *b;
}

Board& board_of(const Group& g) {
  std::vector<int> key(g.slot, g.slot + g.size);
  std::lock_guard<std::mutex> lock(boards_mutex);
  auto& b = boards()[key];
  if (!b) {
    b = std::make_unique<Board>();
    b->next_seq.assign(size_t(g.size), 0);
    b->post.resize(size_t(g.size));
  }
  return *b;
}

std::string cuda_message(const char* what, cudaError_t e) {
  return std::string("pk_jax ring shift (copy engine): ") + what + ": " + cudaGetErrorString(e);
}

// Waits on `board` (its mutex held by `lock`) until `ready()`, a failure, a reset or the runtime's timeout;
// true only for `ready()`.
template <class Pred>
bool wait_for(Board& board, std::unique_lock<std::mutex>& lock, const Group& g, uint64_t generation, Pred ready) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(g.timeout_ns);
  board.changed.wait_until(lock, deadline,
                           [&] { return !board.failed.empty() || board.generation != generation || ready(); });
  return board.failed.empty() && board.generation == generation && ready();
}

std::string late(const Group& g, int member, const char* what, uint64_t seq) {
  return "pk_jax ring shift (copy engine): member " + std::to_string(member) + " of the group of " +
         std::to_string(g.size) + " did not " + what + " shift " + std::to_string(seq) + " within " +
         std::to_string(g.timeout_ns / 1000000) + " ms of member " + std::to_string(g.rank) +
         " (did every member run the same program?)";
}

std::string create_events(Post& p, int ordinal) {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaEvent_t ready = nullptr, copied = nullptr;
  cudaError_t e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&copied, cudaEventDisableTiming);
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    if (ready) cudaEventDestroy(ready);
    return cuda_message("creating events", e);
  }
  p.ready = ready, p.copied = copied;  // both or neither
  return "";
}

// The first failure of a shift of `board`'s group: kept (every later shift of the group refuses) and returned.
std::string fail(Board& board, std::unique_lock<std::mutex>& lock, uint64_t generation, std::string why) {
  if (!lock.owns_lock()) lock.lock();
  if (board.generation == generation && board.failed.empty()) board.failed = why;
  board.changed.notify_all();
  return why + " (the group's copy-engine shifts stop until pk_jax.runtime.reset())";
}

// One exchange on the board (the header's steps 1-4). CUDA calls are made with the board unlocked: an enqueue
// can block while the stream's queue is full, and the GPU draining it may wait on another member's post.
std::string exchange_on_board(const Group& g, const Transfers& b, const CopyFn& copy, const int* ordinals,
                              cudaStream_t side) {
  Board& board = board_of(g);
  const int me = g.rank;
  std::unique_lock<std::mutex> lock(board.mutex);
  if (!board.failed.empty())
    return "pk_jax ring shift (copy engine): an earlier shift of this group failed (" + board.failed +
           "); call pk_jax.runtime.reset()";
  const uint64_t gen = board.generation;
  const uint64_t seq = board.next_seq[size_t(me)]++;
  Post& mine = board.post[size_t(me)][seq % kBoardSlots];
  // 0. The slot's previous shift must have been read by every member before its events are recorded again.
  if (!wait_for(board, lock, g, gen, [&] { return mine.reads_left == 0; }))
    return fail(board, lock, gen, "pk_jax ring shift (copy engine): a member did not finish shift " +
                                      std::to_string(mine.seq) + " in time (did every member run the same program?)");
  lock.unlock();
  if (!mine.ready)
    if (std::string err = create_events(mine, ordinals[me]); !err.empty()) return fail(board, lock, gen, err);
  // 1. Post y and `ready` (the side stream is past XLA's: this member's outputs may be written).
  if (cudaError_t e = cudaEventRecord(mine.ready, side); e != cudaSuccess)
    return fail(board, lock, gen, cuda_message("record ready", e));
  lock.lock();
  if (board.generation != gen) return "pk_jax ring shift (copy engine): reset while a shift was in flight";
  mine.seq = seq;
  mine.n = b.n;
  for (int i = 0; i < kMaxTransfers; ++i) {
    mine.y[i] = i < b.n ? b.y[i] : nullptr;
    mine.signature[i] = i < b.n ? b.signature[i] : 0;
    mine.dist[i] = i < b.n ? b.dist[i] : 0;
  }
  mine.copied_posted = false;
  mine.reads_left = 2 * b.n;  // per buffer: its sender reads y and ready, its receiver reads copied
  board.changed.notify_all();
  // 2. Each buffer into its target's y, once the target's XLA stream reached this shift. After a failure from
  // here on, `copied` is still recorded, so what was queued is covered by `done`'s wait.
  std::string err;
  for (int i = 0; i < b.n && err.empty(); ++i) {
    const int t = (me + b.dist[i]) % g.size;
    Post& theirs = board.post[size_t(t)][seq % kBoardSlots];
    if (!wait_for(board, lock, g, gen, [&] { return theirs.seq == seq; })) {
      err = late(g, t, "start", seq);
      break;
    }
    if (theirs.n != b.n || theirs.signature[i] != b.signature[i] || theirs.dist[i] != b.dist[i]) {
      err = "pk_jax ring shift (copy engine): member " + std::to_string(t) + "'s shift " + std::to_string(seq) +
            " has other buffers than member " + std::to_string(me) + "'s (two programs' shifts over one group in "
            "different orders?)";
      break;
    }
    const cudaEvent_t their_ready = theirs.ready;
    char* dst = theirs.y[i];
    lock.unlock();
    cudaError_t e = cudaStreamWaitEvent(side, their_ready, 0);
    lock.lock();
    --theirs.reads_left;  // the wait above holds the record it needs: the event may be recorded again
    board.changed.notify_all();
    lock.unlock();
    if (e == cudaSuccess) e = copy(i, dst, ordinals[t]);
    if (e != cudaSuccess) err = cuda_message("copy to the target", e);
    lock.lock();
  }
  lock.unlock();
  // 3. Post `copied`: what this member sent has landed once it completes.
  if (cudaError_t e = cudaEventRecord(mine.copied, side); e != cudaSuccess && err.empty())
    err = cuda_message("record copied", e);
  lock.lock();
  if (board.generation != gen) return "pk_jax ring shift (copy engine): reset while a shift was in flight";
  mine.copied_posted = true;
  board.changed.notify_all();
  if (!err.empty()) return fail(board, lock, gen, err);
  // 4. This member's y is whole once every sender's copy into it completed.
  for (int i = 0; i < b.n; ++i) {
    const int s = (me - b.dist[i] + g.size) % g.size;
    Post& sender = board.post[size_t(s)][seq % kBoardSlots];
    if (!wait_for(board, lock, g, gen, [&] { return sender.seq == seq && sender.copied_posted; }))
      return fail(board, lock, gen, late(g, s, "finish sending", seq));
    const cudaEvent_t their_copied = sender.copied;
    lock.unlock();
    const cudaError_t e = cudaStreamWaitEvent(side, their_copied, 0);
    lock.lock();
    --sender.reads_left;
    board.changed.notify_all();
    if (e != cudaSuccess) return fail(board, lock, gen, cuda_message("wait for the sender", e));
  }
  return "";
}

}  // namespace

std::string copy_engine_shift(const Group& g, const int* ordinals, const ShiftBuffers& b, cudaStream_t side) {
  Transfers t;
  t.n = b.n;
  for (int i = 0; i < b.n; ++i) t.dist[i] = b.dist[i], t.y[i] = b.y[i], t.signature[i] = b.bytes[i];
  const int me = ordinals[g.rank];
  return exchange_on_board(g, t, [&](int i, char* dst, int target) {
    return cudaMemcpyPeerAsync(dst, target, b.x[i], me, size_t(b.bytes[i]), side);
  }, ordinals, side);
}

namespace {

cudaPitchedPtr pitched(const void* base, int64_t pitch, int64_t width, int64_t slice) {
  return make_cudaPitchedPtr(const_cast<void*>(base), size_t(pitch), size_t(width), size_t(slice / pitch));
}

// How a strided block is copied (a contiguous one is always one cudaMemcpyPeerAsync):
//   default: one cudaMemcpy3DBatchAsync op with cudaMemcpyFlagPreferOverlapWithCompute, the runtime's hint to keep
//            a copy off the SMs (CUDA 12.8+). On 2x H100 (2026-11-26) a peer block copied so ran beside a kernel
//            holding every SM (67 MB in 173 us); a local strided block still waited for free SMs.
//   $PK_JAX_WINDOW_COPY=3d: one cudaMemcpy3DPeerAsync. On 2x H100 (2026-11-26 Ulysses timelines) it did not run
//            beside a kernel holding every SM: each began as the attention kernel retired its CTAs, as if the driver
//            ran it on SMs. (A cudaMemcpy2DAsync per slice did not overlap either, and was slower: 10.4 ms against
//            8.4 forward at S 2048 in 4 chunks.)
bool batch_copies() {
  static const bool batch = [] {
    const char* v = std::getenv("PK_JAX_WINDOW_COPY");
    return !(v && std::string(v) == "3d");
  }();
  return batch;
}

cudaMemcpy3DOperand pointer_operand(const char* base, int64_t pitch, int64_t slice) {
  cudaMemcpy3DOperand o = {};
  o.type = cudaMemcpyOperandTypePointer;
  o.op.ptr.ptr = const_cast<char*>(base);
  o.op.ptr.rowLength = size_t(pitch);         // elements of one byte (pointer-to-pointer copies)
  o.op.ptr.layerHeight = size_t(slice / pitch);
  return o;
}

cudaError_t copy_3d(const Block3D& k, char* dst, int dst_dev, const char* src, int src_dev, cudaStream_t side) {
  cudaMemcpy3DPeerParms p = {};
  p.srcPtr = pitched(src, k.src_pitch, k.width, k.src_slice);
  p.srcDevice = src_dev;
  p.dstPtr = pitched(dst, k.dst_pitch, k.width, k.dst_slice);
  p.dstDevice = dst_dev;
  p.extent = make_cudaExtent(size_t(k.width), size_t(k.height), size_t(k.depth));
  return cudaMemcpy3DPeerAsync(&p, side);
}

// Set once a batch copy was refused (a driver without it, or peer operands it does not take): the 3-D form then.
std::atomic<bool> batch_refused{false};

// Enqueues block `k` from src (on device `me`) to dst (on device dst_dev) on `side` (a stream of `me`).
cudaError_t copy_block(const Block3D& k, char* dst, int dst_dev, const char* src, int me, cudaStream_t side) {
  if (k.height == 1 && k.depth == 1)  // contiguous on both sides: the plain copy the ring's shifts make, which
    return cudaMemcpyPeerAsync(dst, dst_dev, src, me, size_t(k.width), side);  // ran beside full-SM kernels
  if (!batch_copies() || batch_refused.load()) return copy_3d(k, dst, dst_dev, src, me, side);
  // Unified addresses name both devices; the calling thread's device is made the stream's for the call.
  int prev = 0;
  cudaGetDevice(&prev);
  cudaError_t e = prev == me ? cudaSuccess : cudaSetDevice(me);
  if (e == cudaSuccess) {
    cudaMemcpy3DBatchOp op = {};
    op.src = pointer_operand(src, k.src_pitch, k.src_slice);
    op.dst = pointer_operand(dst, k.dst_pitch, k.dst_slice);
    op.extent = make_cudaExtent(size_t(k.width), size_t(k.height), size_t(k.depth));
    op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    op.flags = cudaMemcpyFlagPreferOverlapWithCompute;
#if CUDART_VERSION >= 13000
    e = cudaMemcpy3DBatchAsync(1, &op, 0, side);
#else  // CUDA 12.8 / 12.9 also return the index of a failed op
    size_t failed_op = 0;
    e = cudaMemcpy3DBatchAsync(1, &op, &failed_op, 0, side);
#endif
    if (e == cudaErrorInvalidValue || e == cudaErrorNotSupported || e == cudaErrorCallRequiresNewerDriver) {
      cudaGetLastError();  // refused at the call (one op: nothing was queued)
      if (!batch_refused.exchange(true))
        std::fprintf(stderr, "pk_jax windowed all-to-all: cudaMemcpy3DBatchAsync refused (%s); 3-D copies from now "
                     "on\n", cudaGetErrorString(e));
      e = copy_3d(k, dst, dst_dev, src, me, side);
    }
  }
  if (prev != me) cudaSetDevice(prev);
  return e;
}

}  // namespace

std::string copy_engine_all_to_all(const Group& g, const int* ordinals, const WindowExchange& w, cudaStream_t side) {
  const Block3D& k = w.block;
  if (k.width < 1 || k.height < 1 || k.depth < 1 || k.src_pitch < k.width || k.dst_pitch < k.width ||
      k.src_slice % k.src_pitch || k.dst_slice % k.dst_pitch || k.src_slice < k.src_pitch * k.height ||
      k.dst_slice < k.dst_pitch * k.height)
    return "pk_jax windowed all-to-all: the block is not a cudaMemcpy3D layout (width " + std::to_string(k.width) +
           ", pitches " + std::to_string(k.src_pitch) + " / " + std::to_string(k.dst_pitch) + ")";
  const int me = ordinals[g.rank];
  const auto src = [&](int target) { return w.x + w.src_offset + int64_t(target) * w.src_stride; };
  // The own block: a local copy on the side stream, ahead of the handshake. Skipped when the caller places it:
  // a strided local copy beside a kernel holding every SM waited for that kernel and held up the peer copies
  // queued behind it (2x H100, 2026-11-26).
  if (w.own_block)
    if (cudaError_t e = copy_block(k, w.y + w.dst_offset + int64_t(g.rank) * w.dst_stride, me, src(g.rank), me, side);
        e != cudaSuccess)
      return std::string("pk_jax windowed all-to-all: the own block: ") + cudaGetErrorString(e);
  if (g.size == 1) return "";
  // Every incoming block lands in this member's one y; the signature pins the block's shape and strides.
  Transfers t;
  t.n = g.size - 1;
  const int64_t signature = ((k.width * 31 + k.height) * 31 + k.depth) * 31 + k.dst_pitch * 7 + k.dst_slice;
  for (int i = 0; i < t.n; ++i) t.dist[i] = i + 1, t.y[i] = w.y, t.signature[i] = signature;
  return exchange_on_board(g, t, [&](int i, char* target_y, int target) {
    const int target_rank = (g.rank + i + 1) % g.size;
    return copy_block(k, target_y + w.dst_offset + int64_t(g.rank) * w.dst_stride, target, src(target_rank), me, side);
  }, ordinals, side);
}

void reset_copy_shift_boards() {
  std::lock_guard<std::mutex> lock(boards_mutex);
  for (auto& [key, board] : boards()) {
    std::lock_guard<std::mutex> board_lock(board->mutex);
    board->failed.clear();
    ++board->generation;
    board->changed.notify_all();
    std::fill(board->next_seq.begin(), board->next_seq.end(), 0);
    for (auto& slots : board->post)
      for (Post& p : slots) {
        p.seq = ~uint64_t(0);
        p.copied_posted = false;
        p.reads_left = 0;  // the events stay: created once per slot
      }
  }
}

}  // namespace pk
