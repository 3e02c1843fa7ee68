// Layout of the per-device control block that lives in symmetric (peer-mapped) memory.
// Shared by host and device code: plain C++ only.
#pragma once
#include <cstdint>

namespace pk {

constexpr int kMaxGroup = 8;      // largest communication group (paper: 8 GPUs per NVLink domain)
constexpr int kMaxSlots = 8;      // device slots with a control block (local devices in one process)
constexpr int kMaxPublished = 4;  // buffer addresses a device publishes per op (input, output; a ring shift's outputs)
constexpr int kMaxItems = 32768;  // fused ops: tiles / row chunks one device signals to another per op
constexpr int kMaxChunks = 4096;   // pushers on every SM: AG row chunks of x, store-add output row blocks
// Small-message path (kernels/small_collectives.cu): LL lines per (parity, sender). Each line carries
// 4 payload bytes, so a sender's payload per op is capped at kLLLines * 4 = 1 MiB; the LL area is
// 2 x kMaxSlots x kLLLines x 8 B = 32 MiB per device (pk_jax/collectives.py SMALL_MAX_BYTES matches).
constexpr int kLLLines = 1 << 18;
// Small-message path, chunk-flag protocol (kernels/small_collectives.cu, all_reduce "small_chunked"):
// payload bytes a sender may put in one receiver's area per op, and the chunks (CTAs) that carry it,
// each with one release flag. 2 x kMaxSlots x 8 MiB = 128 MiB per device.
constexpr int64_t kChunkedBytes = int64_t(8) << 20;
constexpr int kChunkedMaxChunks = 1024;
// The same areas hold the LL128 all_reduce's 128-byte lines ("small_ll128", pk/ll128.cuh): 120 payload
// bytes each, so an area is sized for kChunkedBytes of payload as lines (8,947,968 B instead of 8 MiB).
constexpr int64_t kLL128AreaLines = (kChunkedBytes + 119) / 120;
constexpr int64_t kSmallAreaBytes = kLL128AreaLines * 128;
static_assert(kSmallAreaBytes >= kChunkedBytes, "the chunk-flag payload must fit the area");
// Fused MoE dispatch (kernels/moe_dispatch.cu): experts whose per-sender counts a member can publish.
constexpr int kMoeMaxExperts = 1024;

// Error codes written by device code into a host-mapped ErrorRecord.
enum ErrorCode : int32_t {
  kOk = 0,
  kTimeoutReady = 1,  // a peer never published its buffers (never launched the op)
  kTimeoutDone = 2,   // a peer never finished touching our buffers
  kTimeoutTest = 3,   // the self-test wait
  kTimeoutItem = 4,   // a peer never delivered a tile / row chunk of a fused op
  kOpMismatch = 5,    // a peer published for a different op (the members' op sequences diverged)
  kTimeoutSmall = 6,  // a peer never delivered its LL lines of a small-message op
};

// Host-mapped, one per device: the first failure wins and stays until the runtime is reset.
struct ErrorRecord {
  int32_t code;
  int32_t op;           // OpCode of the failing launch
  int32_t device_slot;  // the device that waited
  int32_t peer_slot;    // the device it waited for
  int32_t peer_op;      // kOpMismatch: the op the peer ran instead
};

// One handshake channel of the op protocol (kernels/pk/op_protocol.cuh). Peers write `ready`, `done`,
// `mailbox` and `op_tag`; `seq` and `arrived` are only touched by the owner. Counters only grow (one step
// per op), so consecutive launches need no reset and CUDA graph replays stay correct: the expected value
// comes from `seq`, kept in device memory.
struct alignas(128) ProtocolChannel {
  uint64_t ready[kMaxSlots];                   // ready[src]: ops for which src published its buffers
  uint64_t done[kMaxSlots];                    // done[src]: ops after which src stopped touching ours
  uint64_t mailbox[kMaxSlots][kMaxPublished];  // mailbox[src]: addresses src published for this op
  uint64_t op_tag[kMaxSlots];                  // op_tag[src]: the OpCode src published them for
  alignas(128) uint64_t seq[kMaxSlots];        // local: ops completed with each peer slot
  uint32_t arrived;                            // local: CTAs of the running launch that finished
};

// Channels: ops on XLA's stream run one at a time per device and share kMainChannel. The ring shift
// (kernels/ring_shift.cu) runs on a side stream *concurrently* with them, so it has its own counters:
// on a shared channel, a shift and a collective in flight at once would take each other's epochs and
// mailboxes (docs/design.md, "The asynchronous ring shift").
constexpr int kMainChannel = 0;
constexpr int kSideChannel = 1;
constexpr int kNumChannels = 2;

struct alignas(128) ControlBlock {
  ProtocolChannel channel[kNumChannels];       // [kMainChannel] / [kSideChannel]
  uint64_t test_flag[kMaxSlots];               // self-test signals (never used by real ops)
  uint32_t aborted;                            // local: set after a timeout, later waits fail fast (any channel)
  uint32_t next_task;                          // local: fused kernels' task counter (task_queue.cuh)
  uint32_t next_piece;                         // local: pushers' piece counter (tp_gemm_kernel.cuh)
  // item_ready[src][i]: low 32 bits of the op epoch at which src finished item i for this device
  // (a GEMM tile it computed, a row chunk it delivered). Fused kernels only; compared modulo 2^32.
  alignas(128) uint32_t item_ready[kMaxSlots][kMaxItems];
  // chunk_count[src][c]: pieces of src's row chunk c that have landed here (AG), or that src zeroed of
  // its output row block c (store-add RS/AR), and after those (AR relay) tiles src added into this
  // member's row blocks (pk/chunk_counts.cuh, MatmulStoreAdd).
  // Peers add to it; the owner resets it at the end of the op.
  alignas(128) uint32_t chunk_count[kMaxSlots][kMaxChunks];
  // Small-message path: its own epochs, separate from seq[] so the ready/done counters of the
  // OpProtocol stay in step. ll_seq[slot]: small ops completed with that peer; ll_arrived: CTAs of
  // the running small launch that finished (the last one advances ll_seq and resets it).
  alignas(128) uint64_t ll_seq[kMaxSlots];
  uint32_t ll_arrived;
  // ll[parity][src][i]: LL line i from src: low 32 bits payload, high 32 bits the small-op epoch
  // (low 32 bits) it belongs to; parity = epoch & 1. One 8-byte store is single-copy atomic, so a
  // line whose flag matches carries that op's data: no fence, no separate ready flag.
  alignas(128) uint64_t ll[2][kMaxSlots][kLLLines];
  // Fused MoE dispatch: moe_counts[src][e] = rows src sends to global expert e in the running dispatch,
  // written by src before its ready signal (release) and read by this member after acquiring it. Never
  // reset: src writes the next dispatch's counts only after this member reported done for this one,
  // i.e. after it read them (docs/design-moe.md).
  alignas(128) int32_t moe_counts[kMaxSlots][kMoeMaxExperts];
  // Small-message path, chunk-flag protocol: chunk_data[parity][src] holds src's plain payload for
  // the running op of that parity; chunk_flag[parity][src][c] = the op's LL flag (ll_flag: epoch and
  // code), stored with release after chunk c's bytes were acknowledged (fence), read with acquire.
  // Same small-op epochs (ll_seq) and parity argument as the LL lines; stale flags carry older epochs.
  // The LL128 all_reduce stores its lines into chunk_data too (a stale plain word passes for its flag word only if
  // the data hold that exact pattern, a NaN in every dtype).
  alignas(128) uint32_t chunk_flag[2][kMaxSlots][kChunkedMaxChunks];
  alignas(128) char chunk_data[2][kMaxSlots][kSmallAreaBytes];
};

}  // namespace pk
