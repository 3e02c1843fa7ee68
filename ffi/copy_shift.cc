#include "copy_shift.h"

#include <array>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "../kernels/pk/group.cuh"

namespace pk {
namespace {

// Shifts a member may run ahead of the slowest reader of its posts before it waits (a member passes step 2
// only when every target has posted, so members stay within a couple of shifts of each other).
constexpr int kBoardSlots = 16;

// One member's post for one shift.
struct Post {
  uint64_t seq = ~uint64_t(0);  // which shift of the group this slot holds
  char* y[kMaxShiftBuffers] = {};
  cudaEvent_t ready = nullptr;   // created once per slot on the member's device, recorded per shift
  cudaEvent_t copied = nullptr;
  bool copied_posted = false;
  int reads_left = 0;            // reads of y/ready and of copied still owed by other members
};

// Every shift of one group (members in rank order, named by their device slots).
struct Board {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<uint64_t> next_seq;                   // per rank: the next shift this member starts
  std::vector<std::array<Post, kBoardSlots>> post;  // per rank, per slot
};

std::mutex boards_mutex;

Board& board_of(const Group& g) {
  static auto* boards = new std::map<std::vector<int>, std::unique_ptr<Board>>();  // kept for the process
  std::vector<int> key(g.slot, g.slot + g.size);
  std::lock_guard<std::mutex> lock(boards_mutex);
  auto& b = (*boards)[key];
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

// Waits on `board` (its mutex held by `lock`) until `ready()` or the runtime's timeout.
template <class Pred>
bool wait_for(Board& board, std::unique_lock<std::mutex>& lock, const Group& g, Pred ready) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(g.timeout_ns);
  return board.changed.wait_until(lock, deadline, ready);
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
  cudaError_t e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&p.ready, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&p.copied, cudaEventDisableTiming);
  cudaSetDevice(prev);
  return e == cudaSuccess ? "" : cuda_message("creating events", e);
}

}  // namespace

// CUDA calls are made with the board unlocked: an enqueue can block while the stream's queue is full, and
// the GPU draining it may wait on another member's post.
std::string copy_engine_shift(const Group& g, const int* ordinals, const ShiftBuffers& b, cudaStream_t side) {
  Board& board = board_of(g);
  const int me = g.rank;
  std::unique_lock<std::mutex> lock(board.mutex);
  const uint64_t seq = board.next_seq[size_t(me)]++;
  Post& mine = board.post[size_t(me)][seq % kBoardSlots];
  // 0. The slot's previous shift must have been read by every member before its events are recorded again.
  if (!wait_for(board, lock, g, [&] { return mine.reads_left == 0; }))
    return "pk_jax ring shift (copy engine): a member did not finish shift " + std::to_string(mine.seq) +
           " within the timeout (did every member run the same program?)";
  lock.unlock();
  if (!mine.ready)
    if (std::string err = create_events(mine, ordinals[me]); !err.empty()) return err;
  // 1. Post y and `ready` (the side stream is past XLA's: this member's outputs may be written).
  if (cudaError_t e = cudaEventRecord(mine.ready, side); e != cudaSuccess) return cuda_message("record ready", e);
  lock.lock();
  mine.seq = seq;
  for (int i = 0; i < b.n; ++i) mine.y[i] = b.y[i];
  mine.copied_posted = false;
  mine.reads_left = 2 * b.n;  // per buffer: its sender reads y and ready, its receiver reads copied
  board.changed.notify_all();
  // 2. Each buffer into its target's y, once the target's XLA stream reached this shift.
  for (int i = 0; i < b.n; ++i) {
    const int t = (me + b.dist[i]) % g.size;
    Post& theirs = board.post[size_t(t)][seq % kBoardSlots];
    if (!wait_for(board, lock, g, [&] { return theirs.seq == seq; })) return late(g, t, "start", seq);
    const cudaEvent_t their_ready = theirs.ready;
    char* dst = theirs.y[i];
    lock.unlock();
    if (cudaError_t e = cudaStreamWaitEvent(side, their_ready, 0); e != cudaSuccess)
      return cuda_message("wait for the target", e);
    lock.lock();
    --theirs.reads_left;  // the wait above holds the record it needs: the event may be recorded again
    board.changed.notify_all();
    lock.unlock();
    if (cudaError_t e = cudaMemcpyPeerAsync(dst, ordinals[t], b.x[i], ordinals[me], size_t(b.bytes[i]), side);
        e != cudaSuccess)
      return cuda_message("cudaMemcpyPeerAsync", e);
    lock.lock();
  }
  lock.unlock();
  // 3. Post `copied`: what this member sent has landed once it completes.
  if (cudaError_t e = cudaEventRecord(mine.copied, side); e != cudaSuccess) return cuda_message("record copied", e);
  lock.lock();
  mine.copied_posted = true;
  board.changed.notify_all();
  // 4. This member's y is whole once every sender's copy into it completed.
  for (int i = 0; i < b.n; ++i) {
    const int s = (me - b.dist[i] + g.size) % g.size;
    Post& sender = board.post[size_t(s)][seq % kBoardSlots];
    if (!wait_for(board, lock, g, [&] { return sender.seq == seq && sender.copied_posted; }))
      return late(g, s, "finish sending", seq);
    const cudaEvent_t their_copied = sender.copied;
    lock.unlock();
    if (cudaError_t e = cudaStreamWaitEvent(side, their_copied, 0); e != cudaSuccess)
      return cuda_message("wait for the sender", e);
    lock.lock();
    --sender.reads_left;
    board.changed.notify_all();
  }
  return "";
}

}  // namespace pk
