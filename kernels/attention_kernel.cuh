// Attention forward, O = softmax(scale * Q Kᵀ + mask) V with its log-sum-exp, on the LCSC template
// (pk/lcsc.cuh), after FlashAttention-3's structure. q (B, Tq, N, D), k and v (B, Tk, Nkv, D) as JAX
// stores them (GQA: query head h reads kv head h / (N / Nkv)), T = bf16 or f16, D = 64 or 128.
// A task is one 128-row query tile of one (batch, head); two consumer warpgroups own 64 rows each.
//   loader:   Q tile once per task, then K and V tiles of BKV keys through a ring (separate K / V
//             barriers, so S = Q Kᵀ starts before V has landed). 4-D TMA maps read (B, T, N, D) in
//             place; rows past a sequence's end read as zeros.
//   consumer: S = Q Kᵀ by wgmma (Q and K K-major from smem), the mask, online softmax in registers
//             (exp2 with the scale folded in), P converted to 16 bits in registers and used as the A
//             operand of O += P V (V read MN-major, the transpose-B bit, as the GEMM reads B).
//   storer:   O tiles by TMA (clipped at the sequence end); the consumers write LSE rows directly.
// Causal masks are placed by global positions: query row i sits at q_offset + i, key j at
// kv_offset + j, and the row sees the key when q_offset + i >= kv_offset + j (offsets come from
// device memory so ring attention can pass traced values). Fully masked key blocks are skipped;
// blocks that cross the diagonal or the key sequence's end are masked. A row that sees no key
// gets O = 0 and LSE = -inf. Ext is the hook for a later ring communicator (NoRing: none).
//
// Forward variants (VARIANT_, picked per lowering by $PK_JAX_ATTENTION_FWD_VARIANT; 0 is the kernel above,
// untouched). Each adds to the one before it:
//   1 l2order:  tasks in L2 sections: a few (batch, head) pairs whose K/V fit in L2 (Globals::
//               heads_per_section), query tiles heaviest first, heads fastest; so ~132 / section CTAs read
//               the same K/V block at about the same time (one HBM read, the rest L2 hits) where the
//               default order (query tile slowest over all B x N heads) shares a K/V stream between ~2 CTAs.
//   2 pingpong: l2order + K and V released separately (ring.empty: K, v_empty: V) + FlashAttention-3's
//               warp-scheduler barriers: the two consumer warpgroups take turns issuing their GEMMs
//               ([P V of block kb - 1, Q Kᵀ of block kb] as one slot, named barriers 1 and 2), so one
//               warpgroup's softmax runs while the other's GEMMs do.
//   3 fa3:      pingpong + the intra-warpgroup overlap of the pipelined schedule (slot = [Q Kᵀ of kb,
//               P V of kb - 1]; block kb's softmax runs under P V of kb - 1): FA3's D = 128 mainloop.
//   4 fa3n160:  fa3 with key blocks of BKV = 160 instead of 128 (FA3 takes 128 x 176 for D = 128 non-causal,
//               with its O staging aliasing V's smem; ours keeps two 64-row O slots beside Q, so at D = 128
//               two stages of 160-key K and V are the most that fit: 32 + 2 x 80 + 32 KiB = 224 KiB), so each
//               block's fixed costs (turn barriers, waits, releases, the row max / sum shuffles, the O
//               rescale) are spread over 25% more MMA work. Same protocol as fa3 (only BKV differs); the
//               key-length tail and the causal diagonal go through the same mask (any BKV, multiple of 16).
//               Without a causal mask at D = 128 the last block is short (TAIL): its S and P V are as wide as
//               Tk's last keys rounded up to 32 (Tk 4096: 96 of 160), not a full block of padding.
//   5 fa3n176:  fa3 with FA3's own D = 128 key block, BKV = 176: the room comes from the output slots, which
//               this variant drops: each consumer writes its normalized O rows to global memory straight from
//               registers (16-bit pairs, rows past Tq skipped; 32 KiB per 128-row task against >= 1 MiB of
//               K/V reads), so smem is Q 32 KiB + 2 stages x 88 KiB = 208 KiB and the consumers never wait on
//               the storer (which has nothing to do). Registers: S 88 + P 44 + O 64 = 196 live per consumer
//               thread (FA3: the same 196 under 240).
//   6 fa3w3:    (D = 64) fa3 with three consumer warpgroups on 192-row query tiles (FA3's D = 64 tile): the
//               turns pass around the three (2 first, then 0 -> 1 -> 2 -> 0), so two warpgroups' GEMMs can run
//               under one's softmax, which at D = 64 is as long as its two GEMMs (the MUFU: 16 exp2 per clock).
//               Registers: 32 producer / 160 consumer (S 64 + P 32 + O 32 live). A warpgroup whose rows all lie
//               past Tq only takes its turns and releases its stages (blocks_idle). At D = 128 it is fa3.
// Variants 0-3 compute every output element with the same operations in the same order as variant 0
// (bit-identical outputs); variants 4 and 5 sum other blocks (other running maxima), and 6 visits key blocks
// that a causal mask hides from some of its rows: their outputs differ from the others' in the last bits
// (checked against the float32 reference). DEBUG_ (variants 2-6): every
// mbarrier wait is bounded (Globals::debug_timeout_ns), prints the barrier and traps, so a protocol hang
// becomes a launch error (host: PK_JAX_ATTENTION_FWD_DEBUG=1); the named-barrier turns are not bounded, but
// a stuck turn stops the consumers' releases, and the loader's bounded waits (and, but in fa3n176, the
// storer's) then report and trap.
#pragma once
#include <cuda.h>
#include <math_constants.h>

#include <cstdio>

#include "pk/acc_store.cuh"
#include "pk/clock_trace.cuh"
#include "pk/debug_wait.cuh"
#include "pk/fast_exp2.cuh"
#include "pk/lcsc.cuh"
#include "pk/pipeline.cuh"
#include "pk/tma.cuh"
#include "pk/wgmma.cuh"

namespace pk::attention {

struct Globals {
  CUtensorMap q, k, v, o;  // 4-D maps (d, head, t, batch); boxes of 64 d x rows (q: BM, k/v: BKV, o: 64)
  void* o_ptr;             // (B, Tq, N, D): variant fa3n176 stores O from registers (the others through `o`)
  float* lse;              // (B, N, lse_seq) float32 from this call's row 0, or nullptr
  // Ring attention's accumulator (acc_mode != 0; every variant): O goes, in float32 and from registers, into
  // `acc` (B, lse_seq, N, D) from this call's row 0 (a window of the ring's state), no O tile is stored, and
  // LSE into `lse`. acc_mode 1 writes them; 2 merges them with what is there (online softmax: weights
  // exp(lse_old - lse_new_total), exp(lse_block - lse_new_total)), in place.
  float* acc;
  int acc_mode;
  int lse_seq;             // rows of `lse` (and `acc`) per (batch, head): tq, or the ring state's length
  const int* offsets;      // device int32[2]: q_offset, kv_offset
  int batch, tq, tk, heads, kv_heads;
  float scale, scale_log2;  // softmax scale, and scale * log2(e) for exp2
  int causal;
  int num_comm_sms;  // SMs given to a communicator (0: none yet)
  int heads_per_section;                // variants >= 1: (batch, head) pairs per L2 section (>= 1)
  unsigned long long debug_timeout_ns;  // DEBUG variants: the mbarrier wait limit (unused otherwise)
};

// PK_ATTN_TRACE (cmake -DPK_JAX_ATTENTION_TRACE=ON; a diagnosis build): Kernel::kTrace.
#ifndef PK_ATTN_TRACE
#define PK_ATTN_TRACE 0
#endif

// The steps a PK_ATTN_TRACE build stamps (scripts/attention_trace.py names them alike).
enum TraceEvent : int {
  kTrTask = 1, kTrQReady, kTrKvReady, kTrIssued, kTrSReady, kTrPvReady, kTrFinished,  // consumers
  kTrLoaderQIssued = 9, kTrLoaderKIssued, kTrLoaderVIssued, kTrLoaderTask, kTrLoaderQEmpty,  // loader
  kTrFinNormed = 14, kTrFinSlot, kTrFinStored,  // consumers, inside finish_rows
  kTrStorerFull = 17, kTrStorerRead,            // storer: a slot's O arrived (index: warpgroup); TMA has read both
};

enum FwdVariant : int {
  kFwdDefault = 0, kFwdL2Order = 1, kFwdPingpong = 2, kFwdFa3 = 3, kFwdFa3N160 = 4, kFwdFa3N176 = 5, kFwdFa3W3 = 6
};

// What one task covers: the query tile, its (batch, head) and the key blocks it visits.
struct Work {
  int q0, head, kv_head, batch;
  int q_offset, kv_offset;
  int kv_blocks;  // key blocks [0, kv_blocks) hold a key some row of the tile sees
};

// Ring-attention hook: a communicator could move K/V blocks between GPUs; this version has none.
struct NoRing {
  struct CommShared {};
  static constexpr bool kHasCommunicator = false;
  __device__ static void communicator(const Globals&, CommShared&, lcsc::CommRole) {}
  __device__ static void finish(const Globals&) {}
};

// Under a causal mask the fa3 mainloops claim their tasks at run time (lcsc's task counter), from the kernel's own
// counter pair as the backward does (kernel_counter_pair in pk/task_queue.cuh, reset by each launch's last CTA in
// storer_finish). Tasks are still taken heaviest first, but a CTA takes the next
// one when it is free, so the tasks in flight stay a window of the task order and share their sections' K and V in
// L2. With the static round robin the CTAs drifted apart (a causal task's length depends on its tile), spread over
// many sections, and read K and V from HBM: one H200, B4 S16384 N16 D128 causal, Nsight Compute: L2 hit rate 63 %
// and DRAM 32 % of peak (cuDNN: 96 % and 3 %; ours without a mask: 96 % and 3 %), and under the 700 W cap the SM clock
// fell to ~1440 MHz against cuDNN's ~1630 (session 40, scripts/attention_power.py). Without a mask every task has
// the same length and the static order keeps the CTAs together.

// PIPELINED_: the consumers overlap one block's softmax with the previous block's P V (blocks_pipelined).
// VARIANT_: FwdVariant (see the top of the file; variants >= 2 take their own schedule and ignore
// PIPELINED_). DEBUG_: bounded mbarrier waits (variants 2 and 3).
// TAIL_ (0: none): every task's last key block is worked on TAIL_ keys wide (Tk's remainder rounded up to whole
// k-steps; attention.cu's short_tail_keys picks it, in steps of 32, for fa3n160 without a causal mask).
template <typename T, int D_, int STAGES_, class Ext = NoRing, bool PIPELINED_ = false, int VARIANT_ = 0,
          bool DEBUG_ = false, int TAIL_ = 0>
struct Kernel {
  using Globals = attention::Globals;
  using CommShared = typename Ext::CommShared;
  static constexpr int D = D_, STAGES = STAGES_;
  static constexpr bool PIPELINED = PIPELINED_;
  static constexpr int VARIANT = VARIANT_;
  static constexpr bool DEBUG = DEBUG_;
  static constexpr bool kSections = VARIANT >= kFwdL2Order;     // the L2-section task order
  static constexpr bool kSplitRelease = VARIANT >= kFwdPingpong;  // K and V stages released separately
  static constexpr bool kPingpong = VARIANT >= kFwdPingpong;      // warp-scheduler barriers between the consumers
  static constexpr bool kFa3Mainloop = VARIANT >= kFwdFa3;         // blocks_fa3 (fa3, fa3n160, fa3n176, fa3w3)
  // O from registers to global, no O slots: fa3n176 only. Each of a thread's D / 4 four-byte stores spans 8 rows of the
  // warp (8 L1 wavefronts, on the switch's path) where the slot takes D / 16 stmatrix and one TMA store: fa3 / fa3n160
  // with it ran 8-13 % slower at D 128 S 1024 and 2-6 % at S 4096 (session 49, one H100).
  static constexpr bool kDirectO = VARIANT == kFwdFa3N176;
  static_assert(VARIANT >= kFwdDefault && VARIANT <= kFwdFa3W3, "forward variant 0..6");
  static_assert(!DEBUG || kPingpong, "the DEBUG build is for the variants that change the barrier protocol");
  static constexpr int WGS = VARIANT == kFwdFa3W3 && D == 64 ? 3 : 2, BM = 64 * WGS;
  static constexpr int BKV = VARIANT == kFwdFa3N160 ? 160 : VARIANT == kFwdFa3N176 ? 176 : 128;  // keys per block
  static_assert(BKV % 16 == 0 && BKV <= 256, "key block: whole wgmma k-steps, one TMA box of rows");
  // Two-warpgroup fa3 mainloops carry a task's last P V into the next task: it is issued in the same turn as the
  // next task's first Q Kᵀ, and the task's rows are finished after it (blocks_fa3_carry; consumer_finish flushes
  // the CTA's last task). Without the carry each task switch ran that P V, finish_rows and the next first Q Kᵀ
  // one after another. Measured (one H200, session 38): D 128 forward +1-2 % from S 4096, S 1024 unchanged.
  static constexpr bool kCarry = kFa3Mainloop && WGS == 2;
  // A short last block (TAIL): without a causal mask every task visits the same blocks, and the last one's padding
  // (e.g. Tk 4096 in 160-key blocks: 96 keys of 160) cost a full block's MMAs and exponentials. With TAIL its S and
  // P V are TAIL keys wide. The carried P V is then always a last block's: TAIL keys.
  static constexpr int TAIL = TAIL_;
  static constexpr bool kShortTail = TAIL != 0;
  static_assert(!kShortTail || (kCarry && TAIL % 16 == 0 && TAIL > 0 && TAIL < BKV),
                "a short last block: the carrying mainloops, whole k-steps, narrower than a block");
  static constexpr int kCarriedKeys = kShortTail ? TAIL : BKV;  // the keys of a task's last block
  static constexpr int kBoxCols = 128 / int(sizeof(T));  // 64 elements per swizzled 128-byte box row
  static constexpr int kConsumerWarpgroups = WGS;
  static constexpr bool kUniformWarpgroup = true;  // pk/lcsc.cuh UniformWarpgroup
  // S (BKV/2) + O (D/2) + P (BKV/4) fp32/16-bit registers and the row state; three consumers share the 64K
  // registers of 512 threads (128 x 32 + 384 x 160 = 65536).
  static constexpr int kProducerRegs = WGS == 3 ? 32 : 40;
  static constexpr int kConsumerRegs = WGS == 3 ? 160 : 232;
  static constexpr bool kHasCommunicator = Ext::kHasCommunicator;
  // PK_ATTN_TRACE builds, two-warpgroup fa3 mainloops: CTAs 0-7's loader (role 0), consumers (1, 2) and storer (3)
  // stamp their steps into the LSE buffer (pk/clock_trace.cuh), which then holds no LSE: timing diagnosis only.
  static constexpr bool kTrace = PK_ATTN_TRACE && kCarry;
  static constexpr bool kTaskCounter = kFa3Mainloop && !Ext::kHasCommunicator;  // causal calls (task_counter)
  static constexpr bool kSingleWalk = kTaskCounter;  // pk/lcsc.cuh: one consumer body for both task orders
  static constexpr bool kHasPusher = false;
  static constexpr uint32_t kQBytes = uint32_t(BM * D) * sizeof(T);
  static constexpr uint32_t kKvBytes = uint32_t(BKV * D) * sizeof(T);  // one K (or V) tile
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static_assert(sizeof(T) == 2, "16-bit inputs");

  // DEBUG: a consumer's timed-out wait, for the loader's / storer's report (consumers do not print: a call
  // in their code makes ptxas spill the live accumulators and serialize the wgmmas).
  struct DebugRecord {
    const char* what;
    int index;
    uint32_t parity;
  };

  // Every tile is D/64 boxes of `rows` x 64, one after another (box j holds columns 64j .. 64j+63).
  struct Stage {
    alignas(1024) T k[BKV * D];
    alignas(1024) T v[BKV * D];
  };
  struct Shared {
    alignas(1024) T q[BM * D];
    Stage stage[STAGES];
    alignas(1024) T o[kDirectO ? 1 : WGS][kDirectO ? 8 : 64 * D];  // one output slot per consumer (swizzled
                                                                    // boxes of 64 rows); kDirectO: unused
    Ring<STAGES> ring;               // full: K landed; empty: both consumers are done with K and V
                                     // (kSplitRelease: with K only)
    uint64_t v_full[STAGES];         // V landed
    uint64_t v_empty[kSplitRelease ? STAGES : 1];  // kSplitRelease: both consumers are done with V
    Handoff q_slot;                  // full: Q landed; empty: both consumers' last S is done
    Work work;                       // the task whose Q is in q: written by the loader before q_slot.full's arrival
    Handoff o_slot[WGS];
    DebugRecord stuck[DEBUG ? WGS : 1];  // DEBUG: the wait a consumer timed out on (what == nullptr: none)
  };
  struct LoaderState {
    RingPos<STAGES> pos;
    uint32_t q_phase;
    uint32_t trace_count;  // kTrace: events stamped
    int trace_task;        // kTrace: tasks seen (the task number in each stamp)
  };
  // kCarry: the task whose last P V is pending. o, pa, m and l are the running task's registers themselves
  // (blocks_fa3_carry works in them), carried from one consumer call to the next.
  struct Pending {
    float o[D / 2];
    uint32_t pa[BKV / 16][4];
    float m[2], l[2];
    Work w;
    int row0;
    RingPos<STAGES> pos;  // the stage of its last V
    bool live;            // false before the CTA's first task (its first turn then issues a discarded P V)
  };
  struct ConsumerState {
    int warpgroup;
    RingPos<STAGES> pos;
    uint32_t q_phase, o_phase;
    bool turns_started;  // kPingpong: the first warpgroup's first turn has been granted
    Pending prev;        // kCarry only
    uint32_t trace_count;  // kTrace
    int trace_task;
  };
  struct StorerState {
    uint32_t o_phase;
    uint32_t trace_count;  // kTrace
    int trace_task;
  };

  // kTrace: one stamp of `role`'s step (its first thread's; a consumer's thread 0 of its warpgroup).
  template <class State>
  __device__ __forceinline__ static void trace(const Globals& g, State& st, int role, TraceEvent event, int index) {
    if constexpr (kTrace)
      if (g.lse != nullptr && (role == 0 || role == 3 || threadIdx.x % 128 == 0))
        clock_trace::stamp(reinterpret_cast<uint32_t*>(g.lse), role, st.trace_count, event, st.trace_task, index);
  }
  __device__ __forceinline__ static void trace(const Globals& g, ConsumerState& st, TraceEvent event, int index) {
    trace(g, st, 1 + st.warpgroup, event, index);
  }

  __host__ __device__ static int q_tiles(const Globals& g) { return (g.tq + BM - 1) / BM; }
  __host__ __device__ static int num_tasks(const Globals& g) { return q_tiles(g) * g.heads * g.batch; }

  // Heaviest tiles first (the causal diagonal's last query tiles see the most keys), so the
  // persistent CTAs' last wave holds the light ones.
  __device__ static Work work_of(const Globals& g, int task) {
    Work w;
    const int per_tile = g.heads * g.batch;
    if constexpr (kSections) {
      // Section sec holds (batch, head) pairs [sec * H, sec * H + hs) (the last may hold fewer), each of its
      // query tiles heaviest first, the pairs fastest: the CTAs working at one time share a few K/V streams.
      const int tiles = q_tiles(g), per = g.heads_per_section;
      const int sec = task / (per * tiles), r = task - sec * per * tiles;
      const int hs = per < per_tile - sec * per ? per : per_tile - sec * per;
      const int bh = sec * per + r % hs;
      w.q0 = (tiles - 1 - r / hs) * BM;
      w.head = bh % g.heads;
      w.batch = bh / g.heads;
    } else {
      w.q0 = (q_tiles(g) - 1 - task / per_tile) * BM;
      w.head = (task % per_tile) % g.heads;
      w.batch = (task % per_tile) / g.heads;
    }
    w.kv_head = w.head / (g.heads / g.kv_heads);
    w.q_offset = g.offsets[0];
    w.kv_offset = g.offsets[1];
    const int all = (g.tk + BKV - 1) / BKV;
    w.kv_blocks = all;
    if (g.causal) {
      // The tile's last row sees keys up to j_max; blocks past it are fully masked.
      const long long last_row = (w.q0 + BM < g.tq ? w.q0 + BM : g.tq) - 1;
      const long long j_max = w.q_offset + last_row - w.kv_offset;
      w.kv_blocks = j_max < 0 ? 0 : int(j_max / BKV + 1 < all ? j_max / BKV + 1 : all);
    }
    return w;
  }

  // A Work read from shared memory, broadcast from lane 0: ptxas then keeps its fields in uniform registers, as it
  // does for work_of's (warp-uniform arithmetic on the task). Read plainly, they were per-thread values to it and the
  // key-block loop converted them back every block (749 -> 798 instructions, 37 R2UR; -2 to -5 % measured).
  __device__ static Work broadcast_work(const Work& in) {
    Work w;
    w.q0 = __shfl_sync(0xffffffff, in.q0, 0);
    w.head = __shfl_sync(0xffffffff, in.head, 0);
    w.kv_head = __shfl_sync(0xffffffff, in.kv_head, 0);
    w.batch = __shfl_sync(0xffffffff, in.batch, 0);
    w.q_offset = __shfl_sync(0xffffffff, in.q_offset, 0);
    w.kv_offset = __shfl_sync(0xffffffff, in.kv_offset, 0);
    w.kv_blocks = __shfl_sync(0xffffffff, in.kv_blocks, 0);
    return w;
  }

  __device__ static void init(const Globals& g, Shared& s) {
    s.ring.init(1, 4 * WGS);  // full: the loader's expect_tx arrival; empty: one per consumer warp
    for (int i = 0; i < STAGES; ++i) tma::mbar_init(&s.v_full[i], 1);
    if constexpr (kSplitRelease)
      for (int i = 0; i < STAGES; ++i) tma::mbar_init(&s.v_empty[i], 4 * WGS);
    if constexpr (DEBUG)
      for (int w = 0; w < WGS; ++w) s.stuck[w] = DebugRecord{nullptr, -1, 0};
    s.q_slot.init(1, 4 * WGS);
    for (int w = 0; w < WGS; ++w) s.o_slot[w].init(128, 1);
    tma::prefetch_tensor_map(&g.q);
    tma::prefetch_tensor_map(&g.k);
    tma::prefetch_tensor_map(&g.v);
    tma::prefetch_tensor_map(&g.o);
  }

  // Every mbarrier wait of the variants' loader and storer: tma::mbar_wait, or (DEBUG) bounded: on a timeout
  // it prints the barrier and what the consumers are stuck on, then traps. `what` names the barrier,
  // `index` its stage (-1: none).
  __device__ __forceinline__ static void wait_bar(const Globals& g, Shared& s, uint64_t* bar, uint32_t parity,
                                                  const char* what, int index) {
    if constexpr (!DEBUG) {
      tma::mbar_wait(bar, parity);
    } else {
      if (debug::wait_bounded(bar, parity, g.debug_timeout_ns)) return;
      debug::spin_ns(g.debug_timeout_ns / 2);  // let stuck consumers record their waits first
      report_timeout(g, s, bar, parity, what, index);
      debug::spin_ns(1000000000ull);  // 1 s for the other stuck role to time out and report too
      __trap();
    }
  }

  // The consumers' waits: as wait_bar, but a timeout only records the wait (Shared::stuck) for the loader's
  // or storer's report (which follows: a stuck consumer stops releasing stages and output slots), then
  // traps after five more timeouts.
  __device__ __forceinline__ static void wait_cons(const Globals& g, Shared& s, uint64_t* bar, uint32_t parity,
                                                   const char* what, int index) {
    if constexpr (!DEBUG) {
      tma::mbar_wait(bar, parity);
    } else {
      if (debug::wait_bounded(bar, parity, g.debug_timeout_ns)) return;
      if (threadIdx.x % 128 == 0) {
        DebugRecord& r = s.stuck[threadIdx.x / 128 - 1];
        *reinterpret_cast<volatile int*>(&r.index) = index;
        *reinterpret_cast<volatile uint32_t*>(&r.parity) = parity;
        *reinterpret_cast<const char* volatile*>(&r.what) = what;
      }
      debug::spin_ns(5 * g.debug_timeout_ns);
      __trap();
    }
  }

  __device__ __forceinline__ static void report_timeout(const Globals& g, Shared& s, const uint64_t* bar,
                                                     uint32_t parity, const char* what, int index) {
    const char* role = threadIdx.x / 32 == 0 ? "loader" : "storer";
    const char* c0 = *reinterpret_cast<const char* volatile*>(&s.stuck[0].what);
    const char* c1 = *reinterpret_cast<const char* volatile*>(&s.stuck[WGS - 1].what);
    printf("pk_jax attention fwd<variant %d, D=%d, STAGES=%d> TIMEOUT after %llu ms: block %d (%s) waits on "
           "%s[%d] parity %u, word 0x%016llx | consumer wg0 waits on %s[%d] parity %u, wg1 on %s[%d] parity %u "
           "(none: not stuck on an mbarrier, e.g. a named-barrier turn) | tasks %d, grid %d, batch %d tq %d tk %d "
           "heads %d kv_heads %d causal %d section %d\n",
           VARIANT, D, STAGES, g.debug_timeout_ns / 1000000ull, int(blockIdx.x), role, what, index, parity,
           debug::raw_word(bar), c0 ? c0 : "none", s.stuck[0].index, s.stuck[0].parity, c1 ? c1 : "none",
           s.stuck[WGS - 1].index, s.stuck[WGS - 1].parity, num_tasks(g), int(gridDim.x), g.batch, g.tq, g.tk,
           g.heads, g.kv_heads, g.causal, g.heads_per_section);
  }

  __device__ static void load_boxes(T* dst, const CUtensorMap* map, int rows, int head, int row0, int batch,
                                    uint64_t* bar) {
#pragma unroll
    for (int j = 0; j < D / kBoxCols; ++j) tma::load_tile_4d(dst + j * rows * kBoxCols, map, j * kBoxCols, head, row0, batch, bar);
  }

  __device__ static void loader(const Globals& g, Shared& s, LoaderState& st, int task) {
    if constexpr (kSplitRelease) {
      loader_split(g, s, st, task);
      return;
    }
    const Work w = work_of(g, task);
    tma::mbar_wait(&s.q_slot.empty, st.q_phase ^ 1);
    s.work = w;
    tma::mbar_expect_tx(&s.q_slot.full, kQBytes);
    load_boxes(s.q, &g.q, BM, w.head, w.q0, w.batch, &s.q_slot.full);
    st.q_phase ^= 1;
    for (int kb = 0; kb < w.kv_blocks; ++kb) {
      st.pos.wait_empty(s.ring);
      Stage& dst = s.stage[st.pos.stage];
      tma::mbar_expect_tx(&s.ring.full[st.pos.stage], kKvBytes);
      load_boxes(dst.k, &g.k, BKV, w.kv_head, kb * BKV, w.batch, &s.ring.full[st.pos.stage]);
      tma::mbar_expect_tx(&s.v_full[st.pos.stage], kKvBytes);
      load_boxes(dst.v, &g.v, BKV, w.kv_head, kb * BKV, w.batch, &s.v_full[st.pos.stage]);
      st.pos.advance();
    }
  }

  // kSplitRelease: K waits for the K half of its stage to be released, V for the V half, so K of a later
  // block can land while the consumers still read the V of an earlier one.
  __device__ static void loader_split(const Globals& g, Shared& s, LoaderState& st, int task) {
    const Work w = work_of(g, task);
    ++st.trace_task;
    trace(g, st, 0, kTrLoaderTask, 0);
    wait_bar(g, s, &s.q_slot.empty, st.q_phase ^ 1, "q_slot.empty", -1);
    trace(g, st, 0, kTrLoaderQEmpty, 0);
    s.work = w;  // read by the consumers once Q has landed (see consumer)
    tma::mbar_expect_tx(&s.q_slot.full, kQBytes);
    load_boxes(s.q, &g.q, BM, w.head, w.q0, w.batch, &s.q_slot.full);
    trace(g, st, 0, kTrLoaderQIssued, 0);
    st.q_phase ^= 1;
    for (int kb = 0; kb < w.kv_blocks; ++kb) {
      const int i = st.pos.stage;
      Stage& dst = s.stage[i];
      wait_bar(g, s, &s.ring.empty[i], st.pos.phase ^ 1, "k_empty", i);
      tma::mbar_expect_tx(&s.ring.full[i], kKvBytes);
      load_boxes(dst.k, &g.k, BKV, w.kv_head, kb * BKV, w.batch, &s.ring.full[i]);
      trace(g, st, 0, kTrLoaderKIssued, kb);
      wait_bar(g, s, &s.v_empty[i], st.pos.phase ^ 1, "v_empty", i);
      tma::mbar_expect_tx(&s.v_full[i], kKvBytes);
      load_boxes(dst.v, &g.v, BKV, w.kv_head, kb * BKV, w.batch, &s.v_full[i]);
      trace(g, st, 0, kTrLoaderVIssued, kb);
      st.pos.advance();
    }
  }

  // Accumulator register i of a thread holds row kRow(i) (0 or 8, plus the thread's base row) and
  // column 8 * (i / 4) + 2 * (lane % 4) + i % 2 of the warpgroup's 64 x N tile (wgmma's layout).
  __device__ static constexpr int row_half(int i) { return (i / 2) % 2; }
  __device__ static int col_of(int i, int lane) { return 8 * (i / 4) + 2 * (lane % 4) + i % 2; }

  // Scores the row cannot see -> -inf: keys past the sequence's end, and (causal) past the diagonal. A row sees
  // keys up to min(Tk - 1, q_offset + row - kv_offset); as a limit on the column offset 8 (i / 4) + i % 2 of
  // register i (col_of without the lane's part), each score costs one compare with a constant and a select (the
  // per-key form cost three compares and an add per score: 320 instructions per masked block at D 64 against
  // the softmax's 347).
  template <int N = BKV>  // the block's keys (a short last block: N < BKV)
  __device__ static void mask(const Globals& g, const Work& w, int kb, int row0, int lane, float (&s)[N / 2]) {
    const int base = kb * BKV + 2 * (lane % 4);  // the key at column offset 0 of this thread's registers
    int last[2];                                 // per row half: the last visible column offset
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      long long key = g.tk - 1;
      if (g.causal) {
        const long long diagonal = (long long)w.q_offset + row0 + 8 * h - w.kv_offset;
        key = diagonal < key ? (diagonal < -1 ? -1 : diagonal) : key;
      }
      last[h] = int(key) - base;
    }
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
      if (8 * (i / 4) + i % 2 > last[row_half(i)]) s[i] = -CUDART_INF_F;
  }

  // Whether any score of block kb may be masked for this tile (a partial block, or the diagonal).
  template <int N = BKV>
  __device__ static bool block_needs_mask(const Globals& g, const Work& w, int kb) {
    const int last_key = kb * BKV + N - 1;
    return last_key >= g.tk || (g.causal && (long long)w.kv_offset + last_key > (long long)w.q_offset + w.q0);
  }

  // The row max of 4 lanes' values (the 4 lanes of a quad share a row).
  __device__ static float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  }
  __device__ static float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
  }

  // Online softmax over one block: new row maxima, the running sums rescaled, S -> P in place; `corr`
  // gets each row half's factor for O (rescale_o), which the pipelined consumer applies only once the
  // previous block's P V has left O's registers.
  template <int N = BKV>  // the block's keys (a short last block: N < BKV)
  __device__ static void softmax_scores(const Globals& g, float (&s)[N / 2], float (&m)[2], float (&l)[2],
                                        float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m[h];
#pragma unroll
      for (int i = 0; i < N / 2; ++i)
        if (row_half(i) == h) mx = fmaxf(mx, s[i]);
      mx = quad_max(mx);
      // A row that has seen nothing yet keeps -inf; subtracting 0 then leaves exp2(-inf) = 0.
      const float base = mx == -CUDART_INF_F ? 0.f : mx * g.scale_log2;
      corr[h] = fast_exp2(m[h] * g.scale_log2 - base);  // m = -inf: 0 (nothing to rescale)
      m[h] = mx;
      l[h] *= corr[h];
#pragma unroll
      for (int i = 0; i < N / 2; ++i)
        if (row_half(i) == h) {
          s[i] = fast_exp2(fmaf(s[i], g.scale_log2, -base));
          l[h] += s[i];  // this thread's share; the quad's shares are summed once, at the end
        }
    }
  }

  __device__ static void rescale_o(float (&o)[D / 2], const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= corr[row_half(i)];
  }

  // S = Q Kᵀ for the warpgroup's 64 rows and the first N keys of one K tile (issued, not waited for).
  template <int N = BKV>
  __device__ static void issue_qk(const T* q_wg, const Stage& in, float (&sc)[N / 2]) {
    const uint64_t da0 = wgmma::desc_sw128(q_wg, 16, 1024), db0 = wgmma::desc_sw128(in.k, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // K-major tiles: k step kk is box kk / 4, 32 bytes per step inside its swizzled rows.
      const int box = kk / 4, step = (kk % 4) * 16;
      const uint64_t da = wgmma::desc_advance(da0, (box * BM * kBoxCols + step) * sizeof(T));
      const uint64_t db = wgmma::desc_advance(db0, (box * BKV * kBoxCols + step) * sizeof(T));
      wgmma::mma<T, N, 0, 0>(sc, da, db, kk != 0);
    }
    wgmma::commit();
  }

  // O += P V for the first N keys of one V tile, P from registers (issued, not waited for).
  template <int N = BKV>
  __device__ static void issue_pv(const Stage& in, const uint32_t (&pa)[BKV / 16][4], float (&o)[D / 2]) {
    // V (keys x D) is MN-major for O += P V: 16 key rows per step; LBO steps to the next 64-wide box.
    const uint64_t db0 = wgmma::desc_sw128(in.v, BKV * kBoxCols * sizeof(T), 1024);
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      const uint64_t db = wgmma::desc_advance(db0, kk * 16 * kBoxCols * sizeof(T));
      wgmma::mma_rs<T, D, 1>(o, pa[kk], db, 1);
    }
    wgmma::commit();
  }

  // P (fp32 accumulator layout) -> 16-bit A fragments: k-step kk's fragment is registers 8kk..8kk+7.
  template <int N = BKV>  // the first N / 16 fragments (a short last block: N < BKV)
  __device__ static void to_a_fragments(const float (&p)[N / 2], uint32_t (&a)[BKV / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) a[kk][r] = pack2<T>(p[8 * kk + 2 * r], p[8 * kk + 2 * r + 1]);
  }

  __device__ static void consumer(const Globals& g, Shared& s, ConsumerState& st, int task) {
    float o[D / 2], m[2], l[2];
    start_rows(o, m, l);
    ++st.trace_task;
    trace(g, st, kTrTask, 0);
    wait_cons(g, s, &s.q_slot.full, st.q_phase, "q_slot.full", -1);
    trace(g, st, kTrQReady, 0);
    st.q_phase ^= 1;
    // The task's work as the loader wrote it before Q's arrival (the arrival releases it, this wait acquires it; it
    // is rewritten only after this task's last S). work_of here cost ~130 instructions (three divisions by runtime
    // values, two global loads of the offsets) between one task's last turn and the next one's first (session 39).
    const Work w = broadcast_work(s.work);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int row0 = w.q0 + st.warpgroup * 64 + warp * 16 + lane / 4;  // the thread's rows: row0, row0 + 8
    const T* q_wg = s.q + st.warpgroup * 64 * kBoxCols;  // the warpgroup's 64 rows of each Q box
    if constexpr (kPingpong) {
      if (!st.turns_started) {  // once per kernel: the last consumer grants itself the first turn
        st.turns_started = true;
        if (st.warpgroup == WGS - 1) turn_pass(WGS - 1);
      }
      if (WGS == 3 && w.q0 + st.warpgroup * 64 >= g.tq) {  // every row of this warpgroup lies past the sequence
        blocks_idle(g, s, st, w.kv_blocks);
        if (lane == 0) tma::mbar_arrive(&s.q_slot.empty);
        hand_empty_slot(g, s, st);
        return;
      }
      if constexpr (kFa3Mainloop) {
        if constexpr (WGS == 3) {
          // Causal: this warpgroup's own last key block (its 64 rows see fewer keys than the tile's last row); the
          // tile's later blocks are fully masked for it, so it only takes their turns and releases them.
          Work own = w;
          own.kv_blocks = own_kv_blocks(g, w, st.warpgroup);
          blocks_fa3(g, s, st, own, q_wg, row0, lane, o, m, l);
          blocks_idle(g, s, st, w.kv_blocks - own.kv_blocks);
        } else if constexpr (kCarry) {
          blocks_fa3_carry(g, s, st, w, q_wg, row0, lane);
          return;  // this task's rows are finished after its last P V, in the next call (or consumer_finish)
        } else {
          blocks_fa3(g, s, st, w, q_wg, row0, lane, o, m, l);
        }
      } else {
        blocks_pingpong(g, s, st, w, q_wg, row0, lane, o, m, l);
      }
    } else if constexpr (PIPELINED)
      blocks_pipelined(g, s, st, w, q_wg, row0, lane, o, m, l);
    else
      blocks_in_turn(g, s, st, w, q_wg, row0, lane, o, m, l);
    // This warp's last read of Q is done (blocks_fa3 released it after its last S, so the loader fetches the next
    // task's Q under this tile's last softmax, P V and finish_rows).
    if (!kFa3Mainloop && lane == 0) tma::mbar_arrive(&s.q_slot.empty);
    finish_rows(g, s, st, w, row0, lane, o, m, l);
  }

  // Each key block in turn: S = Q Kᵀ, wait, softmax, O += P V, wait.
  __device__ static void blocks_in_turn(const Globals& g, Shared& s, ConsumerState& st, const Work& w,
                                        const T* q_wg, int row0, int lane, float (&o)[D / 2], float (&m)[2],
                                        float (&l)[2]) {
    for (int kb = 0; kb < w.kv_blocks; ++kb) {
      const Stage& in = s.stage[st.pos.stage];
      st.pos.wait_full(s.ring);
      float sc[BKV / 2], corr[2];
      wgmma::fence();
      issue_qk(q_wg, in, sc);
      wgmma::wait<0>();
      wgmma::fence_operands(sc);
      if (block_needs_mask(g, w, kb)) mask(g, w, kb, row0, lane, sc);
      softmax_scores(g, sc, m, l, corr);
      rescale_o(o, corr);
      uint32_t pa[BKV / 16][4];
      to_a_fragments(sc, pa);
      tma::mbar_wait(&s.v_full[st.pos.stage], st.pos.phase);
      wgmma::fence();
      issue_pv(in, pa, o);
      wgmma::wait<0>();
      wgmma::fence_operands(o);
      if (lane == 0) tma::mbar_arrive(&s.ring.empty[st.pos.stage]);
      st.pos.advance();
    }
  }

  // FlashAttention-3's intra-warpgroup overlap: S of block kb is issued before O += P V of block kb - 1,
  // so block kb's softmax runs on the CUDA cores while the tensor cores do block kb - 1's P V. O's
  // rescale by block kb's maxima waits for that P V (it accumulates into O). Holds two stages at once
  // (K of kb, V of kb - 1): the loader runs one block ahead less than in turn. Unmeasured (opt-in).
  __device__ static void blocks_pipelined(const Globals& g, Shared& s, ConsumerState& st, const Work& w,
                                          const T* q_wg, int row0, int lane, float (&o)[D / 2], float (&m)[2],
                                          float (&l)[2]) {
    if (w.kv_blocks == 0) return;
    float sc[BKV / 2], corr[2];
    uint32_t pa[BKV / 16][4];
    RingPos<STAGES> cur = st.pos;  // the block whose P is in `pa`
    cur.wait_full(s.ring);
    wgmma::fence();
    issue_qk(q_wg, s.stage[cur.stage], sc);
    wgmma::wait<0>();
    wgmma::fence_operands(sc);
    if (block_needs_mask(g, w, 0)) mask(g, w, 0, row0, lane, sc);
    softmax_scores(g, sc, m, l, corr);  // O is still zero: nothing to rescale
    to_a_fragments(sc, pa);
    for (int kb = 1; kb < w.kv_blocks; ++kb) {
      RingPos<STAGES> next = cur;
      next.advance();
      next.wait_full(s.ring);
      wgmma::fence();
      issue_qk(q_wg, s.stage[next.stage], sc);
      tma::mbar_wait(&s.v_full[cur.stage], cur.phase);
      wgmma::fence();  // O and P are loop-carried: ptxas may move them after the first fence (it says so, C7519)
      issue_pv(s.stage[cur.stage], pa, o);
      wgmma::wait<1>();  // groups retire in order: S of block kb is done, P V of kb - 1 may still run
      wgmma::fence_operands(sc);
      if (block_needs_mask(g, w, kb)) mask(g, w, kb, row0, lane, sc);
      softmax_scores(g, sc, m, l, corr);
      wgmma::wait<0>();  // P V of kb - 1 is done: O and `pa` are free
      wgmma::fence_operands(o);
      rescale_o(o, corr);
      if (lane == 0) tma::mbar_arrive(&s.ring.empty[cur.stage]);
      to_a_fragments(sc, pa);
      cur = next;
    }
    tma::mbar_wait(&s.v_full[cur.stage], cur.phase);
    wgmma::fence();
    issue_pv(s.stage[cur.stage], pa, o);
    wgmma::wait<0>();
    wgmma::fence_operands(o);
    if (lane == 0) tma::mbar_arrive(&s.ring.empty[cur.stage]);
    cur.advance();
    st.pos = cur;
  }

  // Warp-scheduler turns (FlashAttention-3's NamedBarrier WarpSchedulerWG1/WG2/WG3): consumer w waits on named
  // barrier 1 + w (256 threads: its own 128 plus the previous consumer's 128 arrivals) before issuing its
  // GEMMs and passes the turn with an arrival on the next one's barrier (next_wg: w + 1, the last to 0) right
  // after. The last consumer grants itself the first turn once per kernel; all take one turn per key block, so
  // their turn counts match (the last pass is left pending at exit, as in FA3).
  __device__ __forceinline__ static void turn_wait(int warpgroup) {
    asm volatile("bar.sync %0, 256;" ::"r"(1 + warpgroup) : "memory");
  }
  __device__ __forceinline__ static void turn_pass(int other_warpgroup) {
    asm volatile("bar.arrive %0, 256;" ::"r"(1 + other_warpgroup) : "memory");
  }
  __device__ __forceinline__ static int next_wg(int warpgroup) { return warpgroup + 1 == WGS ? 0 : warpgroup + 1; }

  // Variant pingpong: per block, one turn issues [P V of kb - 1, Q Kᵀ of kb] (block 0's turn: Q Kᵀ only);
  // then wait, release K of kb and V of kb - 1, softmax of kb (the other consumer's turn runs meanwhile),
  // O rescale, P of kb. The same operations in the same order per element as blocks_in_turn. Block 0 is
  // peeled: a wgmma issued under a condition makes ptxas inject its own warpgroup waits (C7519).
  __device__ static void blocks_pingpong(const Globals& g, Shared& s, ConsumerState& st, const Work& w,
                                         const T* q_wg, int row0, int lane, float (&o)[D / 2], float (&m)[2],
                                         float (&l)[2]) {
    if (w.kv_blocks == 0) return;
    float sc[BKV / 2], corr[2];
    uint32_t pa[BKV / 16][4];
    RingPos<STAGES> prev = st.pos;  // the block whose P is in `pa`
    wait_cons(g, s, &s.ring.full[prev.stage], prev.phase, "k_full", prev.stage);
    turn_wait(st.warpgroup);
    wgmma::fence();
    issue_qk(q_wg, s.stage[prev.stage], sc);
    turn_pass(next_wg(st.warpgroup));
    wgmma::wait<0>();
    wgmma::fence_operands(sc);
    if (lane == 0) tma::mbar_arrive(&s.ring.empty[prev.stage]);
    if (block_needs_mask(g, w, 0)) mask(g, w, 0, row0, lane, sc);
    softmax_scores(g, sc, m, l, corr);
    rescale_o(o, corr);
    to_a_fragments(sc, pa);
    for (int kb = 1; kb < w.kv_blocks; ++kb) {
      RingPos<STAGES> cur = prev;
      cur.advance();
      wait_cons(g, s, &s.ring.full[cur.stage], cur.phase, "k_full", cur.stage);
      wait_cons(g, s, &s.v_full[prev.stage], prev.phase, "v_full", prev.stage);
      turn_wait(st.warpgroup);
      wgmma::fence();
      issue_pv(s.stage[prev.stage], pa, o);
      wgmma::fence();
      issue_qk(q_wg, s.stage[cur.stage], sc);
      turn_pass(next_wg(st.warpgroup));
      wgmma::wait<0>();
      wgmma::fence_operands(sc);
      wgmma::fence_operands(o);
      if (lane == 0) {
        tma::mbar_arrive(&s.ring.empty[cur.stage]);
        tma::mbar_arrive(&s.v_empty[prev.stage]);
      }
      if (block_needs_mask(g, w, kb)) mask(g, w, kb, row0, lane, sc);
      softmax_scores(g, sc, m, l, corr);
      rescale_o(o, corr);
      to_a_fragments(sc, pa);
      prev = cur;
    }
    wait_cons(g, s, &s.v_full[prev.stage], prev.phase, "v_full", prev.stage);
    wgmma::fence();
    issue_pv(s.stage[prev.stage], pa, o);
    wgmma::wait<0>();
    wgmma::fence_operands(o);
    if (lane == 0) tma::mbar_arrive(&s.v_empty[prev.stage]);
    prev.advance();
    st.pos = prev;
  }

  // Variant fa3: per block, one turn issues [Q Kᵀ of kb, P V of kb - 1]; wait for Q Kᵀ only, release K,
  // softmax of kb under P V of kb - 1 (and under the other consumer's turn), then wait for P V, release
  // V, rescale O (blocks_pipelined's order, with turns and split releases). Q is released as soon as the last
  // S is done (q_slot.empty): Q is single-buffered, and a release at the task's end held the next task's Q load
  // back until then.
  __device__ static void blocks_fa3(const Globals& g, Shared& s, ConsumerState& st, const Work& w, const T* q_wg,
                                    int row0, int lane, float (&o)[D / 2], float (&m)[2], float (&l)[2]) {
    if (w.kv_blocks == 0) {
      if (lane == 0) tma::mbar_arrive(&s.q_slot.empty);
      return;
    }
    float sc[BKV / 2], corr[2];
    uint32_t pa[BKV / 16][4];
    RingPos<STAGES> cur = st.pos;  // the block whose P is in `pa`
    wait_cons(g, s, &s.ring.full[cur.stage], cur.phase, "k_full", cur.stage);
    turn_wait(st.warpgroup);
    wgmma::fence();
    issue_qk(q_wg, s.stage[cur.stage], sc);
    turn_pass(next_wg(st.warpgroup));
    wgmma::wait<0>();
    wgmma::fence_operands(sc);
    first_scores(g, s, w, row0, lane, cur, sc, m, l, corr);
    to_a_fragments(sc, pa);
    blocks_fa3_rest(g, s, st, w, q_wg, row0, lane, cur, sc, corr, pa, o, m, l);
    last_pv(g, s, cur, lane, pa, o);
    cur.advance();
    st.pos = cur;
  }

  // kCarry: blocks_fa3 with the previous task's last P V issued in this task's first turn, after its first Q Kᵀ
  // (so block 0's softmax runs under it), and the previous task's rows finished once it is done. This task's last
  // P V is left pending in st.prev. The CTA's first task issues a P V whose product is discarded (no previous
  // task): a wgmma issued under a condition makes ptxas serialize the warpgroup's wgmmas (C7519).
  __device__ static void blocks_fa3_carry(const Globals& g, Shared& s, ConsumerState& st, const Work& w,
                                          const T* q_wg, int row0, int lane) {
    Pending& p = st.prev;
    float(&o)[D / 2] = p.o;
    float(&m)[2] = p.m;
    float(&l)[2] = p.l;
    if (w.kv_blocks == 0) {  // rows that see no key (offsets): O = 0, LSE = -inf, after the pending task's rows
      if (lane == 0) tma::mbar_arrive(&s.q_slot.empty);
      flush_pending(g, s, st);
      start_rows(o, m, l);
      finish_rows(g, s, st, w, row0, lane, o, m, l);
      return;
    }
    float sc[BKV / 2], corr[2];
    RingPos<STAGES> cur = st.pos;  // the block whose P is in `pa`
    wait_cons(g, s, &s.ring.full[cur.stage], cur.phase, "k_full", cur.stage);
    if (p.live) wait_cons(g, s, &s.v_full[p.pos.stage], p.pos.phase, "v_full", p.pos.stage);
    trace(g, st, kTrKvReady, 0);
    turn_wait(st.warpgroup);
    wgmma::fence();
    issue_qk(q_wg, s.stage[cur.stage], sc);
    wgmma::fence();
    issue_pv<kCarriedKeys>(s.stage[p.pos.stage], p.pa, o);  // the previous task's last P V
    turn_pass(next_wg(st.warpgroup));
    trace(g, st, kTrIssued, 0);
    wgmma::wait<1>();  // S of block 0 is done; the previous P V may still run
    wgmma::fence_operands(sc);
    trace(g, st, kTrSReady, 0);
    float m_prev[2] = {m[0], m[1]}, l_prev[2] = {l[0], l[1]};
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.f;
    first_scores(g, s, w, row0, lane, cur, sc, m, l, corr);
    wgmma::wait<0>();
    wgmma::fence_operands(o);
    trace(g, st, kTrPvReady, 0);
    if (p.live) {
      if (lane == 0) tma::mbar_arrive(&s.v_empty[p.pos.stage]);
      finish_rows(g, s, st, p.w, p.row0, lane, o, m_prev, l_prev);
    }
    trace(g, st, kTrFinished, 0);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    to_a_fragments(sc, p.pa);
    blocks_fa3_rest(g, s, st, w, q_wg, row0, lane, cur, sc, corr, p.pa, o, m, l);
    p.pos = cur;
    p.w = w;
    p.row0 = row0;
    p.live = true;
    cur.advance();
    st.pos = cur;
  }

  // fa3, block 0 after its S has landed: release K (and Q when it is the task's last block), mask, softmax.
  __device__ __forceinline__ static void first_scores(const Globals& g, Shared& s, const Work& w, int row0, int lane,
                                                      const RingPos<STAGES>& cur, float (&sc)[BKV / 2],
                                                      float (&m)[2], float (&l)[2], float (&corr)[2]) {
    if (lane == 0) tma::mbar_arrive(&s.ring.empty[cur.stage]);
    if (lane == 0 && w.kv_blocks == 1) tma::mbar_arrive(&s.q_slot.empty);  // the last S
    if (block_needs_mask(g, w, 0)) mask(g, w, 0, row0, lane, sc);
    softmax_scores(g, sc, m, l, corr);  // O is still zero: nothing to rescale
  }

  // fa3, blocks 1 .. kv_blocks - 1 (P of block 0 in `pa`, its stage `cur`): on return `pa` holds the last block's P
  // and `cur` its stage, whose P V is not yet issued. kShortTail: the last block's turn is peeled, TAIL keys wide (a
  // wgmma under a run-time condition would serialize the warpgroup's wgmmas, C7519); the host takes such a build
  // only where every task has >= 2 blocks.
  __device__ __forceinline__ static void blocks_fa3_rest(const Globals& g, Shared& s, ConsumerState& st,
                                                         const Work& w, const T* q_wg, int row0, int lane,
                                                         RingPos<STAGES>& cur, float (&sc)[BKV / 2],
                                                         float (&corr)[2], uint32_t (&pa)[BKV / 16][4],
                                                         float (&o)[D / 2], float (&m)[2], float (&l)[2]) {
    const int full_blocks = kShortTail ? w.kv_blocks - 1 : w.kv_blocks;
    for (int kb = 1; kb < full_blocks; ++kb) fa3_turn<BKV>(g, s, st, w, q_wg, row0, lane, kb, cur, sc, corr, pa, o, m, l);
    if constexpr (kShortTail) {
      // Scores of their own: as the first TAIL / 2 of `sc`, ptxas lacked the registers to pipeline the wgmmas
      // (C7511) at TAIL 64 and 96.
      float tail[TAIL / 2];
      fa3_turn<TAIL>(g, s, st, w, q_wg, row0, lane, full_blocks, cur, tail, corr, pa, o, m, l);
    }
  }

  // fa3, one block kb >= 1 of N keys (BKV, or TAIL for a short last block): one turn issues [Q Kᵀ of kb, P V of
  // kb - 1]; wait for Q Kᵀ only, release K (and Q after the last S), softmax of kb under P V of kb - 1, then wait for
  // P V, release V, rescale O and convert P of kb to `pa`. `cur` advances to kb's stage.
  template <int N>
  __device__ __forceinline__ static void fa3_turn(const Globals& g, Shared& s, ConsumerState& st, const Work& w,
                                                  const T* q_wg, int row0, int lane, int kb, RingPos<STAGES>& cur,
                                                  float (&sc)[N / 2], float (&corr)[2], uint32_t (&pa)[BKV / 16][4],
                                                  float (&o)[D / 2], float (&m)[2], float (&l)[2]) {
    RingPos<STAGES> next = cur;
    next.advance();
    wait_cons(g, s, &s.ring.full[next.stage], next.phase, "k_full", next.stage);
    wait_cons(g, s, &s.v_full[cur.stage], cur.phase, "v_full", cur.stage);
    trace(g, st, kTrKvReady, kb);
    turn_wait(st.warpgroup);
    wgmma::fence();
    issue_qk<N>(q_wg, s.stage[next.stage], sc);
    wgmma::fence();  // O and P are loop-carried: keep ptxas from injecting its own wait (C7519)
    issue_pv(s.stage[cur.stage], pa, o);  // block kb - 1: a full block
    turn_pass(next_wg(st.warpgroup));
    trace(g, st, kTrIssued, kb);
    wgmma::wait<1>();  // groups retire in order: S of block kb is done, P V of kb - 1 may still run
    wgmma::fence_operands(sc);
    trace(g, st, kTrSReady, kb);
    if (lane == 0) tma::mbar_arrive(&s.ring.empty[next.stage]);
    if (lane == 0 && kb == w.kv_blocks - 1) tma::mbar_arrive(&s.q_slot.empty);  // the last S
    if (block_needs_mask<N>(g, w, kb)) mask<N>(g, w, kb, row0, lane, sc);
    softmax_scores<N>(g, sc, m, l, corr);
    wgmma::wait<0>();  // P V of kb - 1 is done: O and `pa` are free
    wgmma::fence_operands(o);
    trace(g, st, kTrPvReady, kb);
    if (lane == 0) tma::mbar_arrive(&s.v_empty[cur.stage]);
    rescale_o(o, corr);
    to_a_fragments<N>(sc, pa);
    cur = next;
  }

  // A task's last P V (kCarriedKeys wide), outside the turns (its V at stage `at`), waited for; V released.
  __device__ __forceinline__ static void last_pv(const Globals& g, Shared& s, const RingPos<STAGES>& at, int lane,
                                                 const uint32_t (&pa)[BKV / 16][4], float (&o)[D / 2]) {
    wait_cons(g, s, &s.v_full[at.stage], at.phase, "v_full", at.stage);
    wgmma::fence();
    issue_pv<kCarriedKeys>(s.stage[at.stage], pa, o);
    wgmma::wait<0>();
    wgmma::fence_operands(o);
    if (lane == 0) tma::mbar_arrive(&s.v_empty[at.stage]);
  }

  // kCarry: the pending task's last P V and its rows (after the CTA's last task, or before a task without keys).
  __device__ static void flush_pending(const Globals& g, Shared& s, ConsumerState& st) {
    Pending& p = st.prev;
    if (!p.live) return;
    last_pv(g, s, p.pos, threadIdx.x % 32, p.pa, p.o);
    finish_rows(g, s, st, p.w, p.row0, threadIdx.x % 32, p.o, p.m, p.l);
    p.live = false;
  }

  // lcsc.cuh calls this after the consumer's last task.
  __device__ static void consumer_finish(const Globals& g, Shared& s, ConsumerState& st) {
    if constexpr (kCarry) flush_pending(g, s, st);
  }

  // A task's row state before its first block: O = 0, no maximum, no sum.
  __device__ __forceinline__ static void start_rows(float (&o)[D / 2], float (&m)[2], float (&l)[2]) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    m[0] = m[1] = -CUDART_INF_F;
    l[0] = l[1] = 0.f;
  }

  // fa3w3, a warpgroup whose 64 rows all lie past the query sequence (the last 192-row tile of Tq = 1024: two of its
  // three): no GEMMs and no softmax, only its part of the protocol, so the tile costs what its live rows do. Per key
  // block it takes and passes its turn (the others' turns follow it) and releases K and V once they have landed (an
  // earlier release would count toward the stage's previous use).
  __device__ static void blocks_idle(const Globals& g, Shared& s, ConsumerState& st, int blocks) {
    const int lane = threadIdx.x % 32;
    for (int kb = 0; kb < blocks; ++kb) {
      wait_cons(g, s, &s.ring.full[st.pos.stage], st.pos.phase, "k_full", st.pos.stage);
      wait_cons(g, s, &s.v_full[st.pos.stage], st.pos.phase, "v_full", st.pos.stage);
      turn_wait(st.warpgroup);
      turn_pass(next_wg(st.warpgroup));
      if (lane == 0) {
        tma::mbar_arrive(&s.ring.empty[st.pos.stage]);
        tma::mbar_arrive(&s.v_empty[st.pos.stage]);
      }
      st.pos.advance();
    }
  }

  // fa3w3: the key blocks warpgroup wg's own rows see (the tile's count without a causal mask; with one, up to the
  // block of its last row's diagonal, as work_of counts them for the tile's last row).
  __device__ static int own_kv_blocks(const Globals& g, const Work& w, int wg) {
    if (!g.causal) return w.kv_blocks;
    const int end = w.q0 + 64 * (wg + 1);
    const long long j_max = w.q_offset + (long long)(end < g.tq ? end : g.tq) - 1 - w.kv_offset;
    const int own = j_max < 0 ? 0 : int(j_max / BKV + 1);
    return own < w.kv_blocks ? own : w.kv_blocks;
  }

  // An idle warpgroup's output slot: handed to the storer unwritten (its TMA store clips every row past Tq).
  __device__ static void hand_empty_slot(const Globals& g, Shared& s, ConsumerState& st) {
    if (g.acc_mode != 0) return;  // the consumers accumulate rows themselves: no slots
    Handoff& slot = s.o_slot[st.warpgroup];
    wait_cons(g, s, &slot.empty, st.o_phase ^ 1, "o_slot.empty", st.warpgroup);
    tma::mbar_arrive(&slot.full);
    st.o_phase ^= 1;
  }

  // O /= l, the LSE rows (natural log) to global memory, and O to this warpgroup's output slot.
  __device__ static void finish_rows(const Globals& g, Shared& s, ConsumerState& st, const Work& w, int row0,
                                     int lane, float (&o)[D / 2], const float (&m)[2], float (&l)[2]) {
    float block_lse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] = quad_sum(l[h]);
      // One MUFU each (rcp / lg2 approx): IEEE 1 / l and logf took ~30 instructions per row half with slow-path
      // branches, once per task between two turns. l >= 1 where positive (the row maximum's own term).
      const float inv = l[h] > 0.f ? __fdividef(1.f, l[h]) : 0.f;
#pragma unroll
      for (int i = 0; i < D / 2; ++i)
        if (row_half(i) == h) o[i] *= inv;
      const int row = row0 + 8 * h;
      block_lse[h] = l[h] > 0.f ? m[h] * g.scale + __logf(l[h]) : -CUDART_INF_F;
      if (!kTrace && g.acc_mode == 0 && g.lse != nullptr && lane % 4 == 0 && row < g.tq)
        g.lse[(size_t(w.batch) * g.heads + w.head) * g.lse_seq + row] = block_lse[h];
    }
    trace(g, st, kTrFinNormed, 0);
    if (g.acc_mode != 0) {
      accumulate_rows(g, w, row0, lane, o, block_lse);
      return;
    }
    if constexpr (kDirectO) {
      store_rows_direct(g, w, row0, o);
      return;
    }
    Handoff& slot = s.o_slot[st.warpgroup];
    wait_cons(g, s, &slot.empty, st.o_phase ^ 1, "o_slot.empty", st.warpgroup);
    trace(g, st, kTrFinSlot, 0);
    store_acc<T, D>(s.o[st.warpgroup], o);
    tma::fence_proxy_async_shared();  // the storer's TMA (async proxy) reads what we just wrote
    tma::mbar_arrive(&slot.full);
    trace(g, st, kTrFinStored, 0);
    st.o_phase ^= 1;
  }

  // kDirectO: the thread's normalized O values to (B, Tq, N, D) in global memory, two columns per 32-bit store
  // (register pair i, i + 1: adjacent columns of one row); rows past the query sequence are not written.
  __device__ static void store_rows_direct(const Globals& g, const Work& w, int row0, const float (&o)[D / 2]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
      if (row >= g.tq) continue;
      T* out = static_cast<T*>(g.o_ptr) + ((size_t(w.batch) * g.tq + row) * g.heads + w.head) * D;
#pragma unroll
      for (int i = 0; i < D / 2; i += 2)
        if (row_half(i) == h) *reinterpret_cast<uint32_t*>(out + col_of(i, lane)) = pack2<T>(o[i], o[i + 1]);
    }
  }

  // acc_mode != 0: the thread's normalized O values (and, per quad, the rows' LSE) into the ring's float32
  // accumulator, written (1) or merged with it (2). Every lane of a quad reads the row's old LSE before one
  // writes the new one (__syncwarp, reached by every lane: the loop is uniform). An old LSE of -inf means the
  // row holds nothing yet: its old O is not read into the sum (it may be anything).
  __device__ static void accumulate_rows(const Globals& g, const Work& w, int row0, int lane, const float (&o)[D / 2],
                                         const float (&block_lse)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
      const bool in_range = row < g.tq;
      float* lse_at = g.lse + (size_t(w.batch) * g.heads + w.head) * g.lse_seq + row;
      float w_old = 0.f, w_block = 1.f, lse_total = block_lse[h];
      if (in_range && g.acc_mode == 2) {
        const float old = *lse_at;
        const float top = fmaxf(old, block_lse[h]);
        if (top == -CUDART_INF_F) {
          w_block = 0.f;  // neither saw a key: O = 0, LSE = -inf
        } else {
          w_old = __expf(old - top);
          w_block = __expf(block_lse[h] - top);
          const float sum = w_old + w_block;
          lse_total = top + __logf(sum);
          w_old /= sum;
          w_block /= sum;
        }
      }
      __syncwarp();
      if (!in_range) continue;
      if (lane % 4 == 0) *lse_at = lse_total;
      float* out = g.acc + ((size_t(w.batch) * g.lse_seq + row) * g.heads + w.head) * D;
#pragma unroll
      for (int i = 0; i < D / 2; i += 2)
        if (row_half(i) == h) {
          float2* at = reinterpret_cast<float2*>(out + col_of(i, lane));
          float2 v = make_float2(o[i] * w_block, o[i + 1] * w_block);
          if (w_old != 0.f) {
            const float2 prev = *at;
            v.x += prev.x * w_old;
            v.y += prev.y * w_old;
          }
          *at = v;
        }
    }
  }

  __device__ static void storer(const Globals& g, Shared& s, StorerState& st, int task) {
    if constexpr (kDirectO) return;  // the consumers store O themselves
    if (g.acc_mode != 0) return;     // the consumers accumulate O in float32 themselves
    const Work w = work_of(g, task);
    ++st.trace_task;
    for (int wg = 0; wg < WGS; ++wg) {
      wait_bar(g, s, &s.o_slot[wg].full, st.o_phase, "o_slot.full", wg);
      trace(g, st, 3, kTrStorerFull, wg);
#pragma unroll
      for (int j = 0; j < D / kBoxCols; ++j)
        tma::store_tile_4d(&g.o, j * kBoxCols, w.head, w.q0 + wg * 64, w.batch, s.o[wg] + j * 64 * kBoxCols);
      tma::commit_group();
    }
    tma::wait_group_read<0>();  // slots may be rewritten once TMA has read them
    trace(g, st, 3, kTrStorerRead, 0);
    for (int wg = 0; wg < WGS; ++wg) tma::mbar_arrive(&s.o_slot[wg].empty);
    st.o_phase ^= 1;
  }

  __device__ static void storer_finish(const Globals& g, Shared&, StorerState&) {
    tma::wait_group<0>();
    if (uint32_t* counter = kTaskCounter ? task_counter(g) : nullptr) finish_counter_pair(counter);
  }
  __device__ static void communicator(const Globals& g, CommShared& c, lcsc::CommRole role) {
    Ext::communicator(g, c, role);
  }
  __device__ static void begin(const Globals&, Shared&) {}
  __device__ static uint32_t* task_counter(const Globals& g) {
    return kTaskCounter && g.causal ? kernel_counter_pair<Kernel> : nullptr;
  }
  __device__ static void pusher(const Globals&, Shared&) {}
  __device__ static void finish(const Globals& g) { Ext::finish(g); }
};

}  // namespace pk::attention
