// Attention backward (dQ, dK, dV) on the LCSC template (pk/lcsc.cuh), after FlashAttention-2/3:
// P is recomputed from Q, K and the forward's saved LSE, delta = rowsum(dO * O) comes precomputed.
// q, dout (B, Tq, N, D), k, v (B, Tk, Nkv, D) as JAX stores them (GQA: query head h reads kv head
// h / (N / Nkv)), T = bf16 or f16, D = 64 or 128.
//
// A task is one key block of BN = 128 keys of one (batch, kv head); it loads K and V once and walks
// every (query head of the group, query block of BM = 64 rows) pair that sees one of its keys. The
// two consumer warpgroups own 64 keys each and compute in the "swapped" orientation (keys are the
// wgmma M dimension), so P and dS come out of the accumulators already transposed and feed dV and
// dK from registers:
//   Sᵀ  = K_wg Qᵀ                      (SS, K-major both)
//   Pᵀ  = exp2(Sᵀ * scale * log2e - lse2[q])          masked to 0 where a query cannot see the key
//   dV += Pᵀ dO                         (RS, dO MN-major: the transpose-B bit)
//   dPᵀ = V_wg dOᵀ                      (SS, K-major both)
//   dSᵀ = Pᵀ ∘ (dPᵀ − delta[q])
//   dK += dSᵀ Q                         (RS, Q MN-major)
//   dQ  = dS K                          (SS: dSᵀ from shared memory as the M-major A operand, the
//                                        transpose-A bit; K MN-major)
// dQ is a partial sum over this task's keys: each warpgroup writes a 64 x 64 float32 chunk to shared
// memory in its accumulator order (conflict-free float4 stores) and the storer thread adds it into a
// float32 buffer with a TMA bulk reduce-add (cp.reduce.async.bulk .add.f32). The buffer, zeroed by
// the host before the launch, is (B, N, tq_pad, D) in that chunk order; pk_jax/attention.py
// un-permutes it, scales it and casts it (one XLA fusion). The adds from different CTAs land in a
// run-dependent order: dQ's bits may differ between runs (dK and dV are deterministic, but with a head split
// of more than two tasks per kv head: Globals::head_split).
//   D = 128: warpgroup w computes dQ columns [64w, 64w + 64) over all 128 keys, so it reads both
//            warpgroups' dS: a 256-thread named barrier per block pair publishes it.
//   D = 64:  warpgroup w computes all 64 columns over its own 64 keys (its own dS only; a 128-thread
//            named barrier), and both warpgroups add into the same dQ block.
//   dSᵀ is double-buffered in shared memory either way.
// Scores that cannot be seen: keys past the sequence's end, and (causal) keys after the query's
// global position (q_offset + i >= kv_offset + j, as the forward). Query blocks in which no row sees
// a key of the task are skipped; a task with none writes dK = dV = 0. Rows past Tq read zeros (TMA)
// and lse2 = +inf (the host pads it), so their P is exactly 0. dK is scaled by `scale` here.
#pragma once
#include <cuda.h>
#include <math_constants.h>

#include <climits>
#include <cstdio>

#include "pk/acc_store.cuh"
#include "pk/debug_wait.cuh"
#include "pk/fast_exp2.cuh"
#include "pk/lcsc.cuh"
#include "pk/pipeline.cuh"
#include "pk/tma.cuh"
#include "pk/wgmma.cuh"

namespace pk::attention_bwd {

struct Globals {
  CUtensorMap q, k, v, dout;  // 4-D maps (d, head, t, batch); boxes of 64 d x rows (q, dout: BM; k, v: BN)
  // Ring attention's float32 dQ state (B, S, N, D) as a 4-D map, boxes of 32 d x 64 rows (dq_direct only).
  CUtensorMap dq_state;
  const float* lse2;          // (B, N, tq_pad) float32: LSE * log2(e), +inf for padding and rows that see nothing
  const float* delta;         // (B, N, tq_pad) float32: rowsum(dO * O) - dLSE, 0 for padding
  float* dq_acc;              // (B, N, tq_pad, D) float32, zeroed; 64 x 64 chunks in accumulator order
  // In place (ring attention): the call's query i is row q_row0 + i of the q / dout maps (the member's whole
  // arrays; 0 for arrays of the call's own rows), and with dq_direct the storer adds dQ (scaled) straight into
  // rows dq_row0 + i of dq_state by TMA tensor reduce instead of into dq_acc (no zeroing, no conversion pass).
  // Rows past tq in the last query block hold other rows' data there: their P is 0 (lse2 = +inf), so they add
  // exact zeros to dK, dV and to the state.
  int q_row0, dq_row0, dq_direct;
  void* dk;                   // (B, Tk, Nkv, D), the input dtype
  void* dv;
  // Head split (GQA): each (batch, kv head, key block) is head_split tasks of group / head_split query heads each.
  // With head_split > 1 the tasks add their dK (scaled) and dV partials into dkv_acc, float32 (2, B, Tk, Nkv, D)
  // zeroed by the host (dK then dV), which the host converts into dk and dv after the kernel.
  int head_split;
  float* dkv_acc;
  const int* offsets;  // device int32[2]: q_offset, kv_offset
  int batch, tq, tk, heads, kv_heads, tq_pad;
  float scale, scale_log2;
  int causal;
  int num_comm_sms;  // always 0 (no communicator)
  unsigned long long debug_timeout_ns;  // the DEBUG variant's mbarrier wait limit (unused otherwise)
};

// Backward variants (VARIANT_, picked per lowering by $PK_JAX_ATTENTION_BWD_VARIANT; 0 is the kernel above,
// untouched). Each adds to the one before it:
//   1 dqfirst:  dQ = dS K issued before dK += dSᵀ Q, and only dV and dQ waited for before the dQ chunk goes
//               to its slot (wgmma groups retire in order), so the chunk's stores and the wait for the slot
//               run under dK's MMAs instead of after them (variant 0 waits for all three).
//   2 l2order_dqfirst: dqfirst + FlashAttention-3's task order: key blocks fastest, then kv head, then
//               batch (variant 0: the (batch, kv head) pairs fastest). The CTAs working at one time then hold
//               the key blocks of one or a few heads, so that head's Q, dO, lse2 and delta are read from HBM
//               about once and shared in L2, and the dQ reduce-adds of all its key blocks land in one head's
//               dq_acc (tq_pad x D x 4 bytes: 8 MiB at 16k) that stays in L2, where variant 0 has ~132 CTAs
//               on ~66 heads at once, each dQ reduce a read-modify-write of HBM (~1 GiB of dq_acc in flight
//               at B4 S16k N16). Per block pair and CTA that is 32 KiB of Q / dO loads and a 32 KiB reduce:
//               ~2.5 TB/s of HBM traffic at our ~350 TFLOP/s, which this order keeps in L2. (The order
//               without dqfirst made ptxas spill 20 bytes in the D = 128 consumer; with it, none.)
//   3 w3:       (D = 64; l2order_dqfirst at D = 128) l2order_dqfirst with three consumer warpgroups on 192-key
//               blocks: at D = 64 each warpgroup's block pairs are independent (its own dSᵀ, its own dQ chunk),
//               so a third one's GEMMs can run under the others' elementwise work (an exponential and the dS
//               math per score, as long as the GEMMs at D = 64). Registers: 32 producer / 160 consumer.
// Every variant computes each dK / dV element with the same operations in the same order (bit-identical
// dK and dV; dQ's reduce order varies between runs in all of them).
struct Work {
  int n0, kv_head, batch;
  int q_offset, kv_offset;
  int head0;     // first query head of the task (kv_head * group + its share of the group)
  int heads;     // query heads walked: group / head_split
  int m_begin;   // first query block any row of which sees a key of this block
  int m_count;   // query blocks visited per head (m_begin .. m_begin + m_count - 1)
  int iters;     // heads * m_count block pairs
};

// Under a causal mask variant 2 claims its tasks at run time (lcsc's task counter), from the kernel's own counter
// pair (kernel_counter_pair, pk/task_queue.cuh): the next task and the CTAs done; zero at module load, reset by each
// launch's last CTA
// (storer_finish), so graph replays start from zero (one launch of a kernel at a time per device, as the
// grouped GEMM's counters). A key block's work shrinks with its position, and the
// static round robin leaves CTAs far apart (GQA 8:1 at S 16384: 1,024 tasks of up to 2,048 block pairs on
// 132 CTAs). Measured on nvidia-h200 (2026-11-24): claiming took causal fwd+bwd from 0.65 to 0.89x cuDNN
// (GQA, S 16384) and 0.86 to 0.88 (S 16384), but non-causal from 1.01 to 0.92, so non-causal stays static.

// DEBUG_: every mbarrier wait is bounded (Globals::debug_timeout_ns); one that times out prints which
// role, barrier, stage and parity it waited on and every role's progress, then traps, so a hang
// becomes a launch failure that names the barrier (host: PK_JAX_ATTENTION_BWD_DEBUG=1). The default
// variant's waits are tma::mbar_wait, unchanged.
// SPLIT_: the kernel honours Globals::head_split (variants 2 and 3 only); without it head_split is taken as 1 and the
// code is the unsplit kernel's (the split's extra task arithmetic and dK / dV adds cost D 64 l2order_dqfirst 6 % when
// compiled into every kernel: one H100, session 43).
template <typename T, int D_, int STAGES_, bool DEBUG_ = false, int VARIANT_ = 0, bool SPLIT_ = false>
struct Kernel {
  using Globals = attention_bwd::Globals;
  struct CommShared {};
  static constexpr int D = D_, STAGES = STAGES_;
  static constexpr bool DEBUG = DEBUG_;
  static constexpr int VARIANT = VARIANT_;
  static constexpr bool kHeadSplit = SPLIT_;
  static_assert(!SPLIT_ || VARIANT_ >= 2, "the head split: variants 2 and 3");
  static_assert(VARIANT >= 0 && VARIANT <= 3, "backward variant 0..3");
  static constexpr bool kDqFirst = VARIANT >= 1;           // dQ before dK, its chunk stored under dK
  static constexpr bool kKeyBlocksFastest = VARIANT >= 2;  // l2order: FA3's task order
  static constexpr int WGS = VARIANT == 3 && D == 64 ? 3 : 2, BN = 64 * WGS, BM = 64;
  static constexpr int kBoxCols = 128 / int(sizeof(T));  // 64 elements per swizzled 128-byte box row
  static constexpr bool kDqShared = D == 128;            // dQ column halves over all keys (else own keys)
  // dSᵀ is double-buffered: a warp rewrites buffer b two block pairs later, after a named barrier that
  // every warp reading b (its dQ wgmma retired) has passed since.
  static constexpr int kDsBufs = 2;
  static constexpr int kConsumerWarpgroups = WGS;
  static constexpr bool kUniformWarpgroup = true;  // pk/lcsc.cuh UniformWarpgroup
  // The split must fit what the CTA holds from its launch: __launch_bounds__(384, 1) gives every thread
  // 168 registers (ptxas -v: "Used 168 registers"), 384 * 168 = 64512, and setmaxnreg.inc blocks until
  // the CTA's pool has the registers: 128 * 40 + 256 * 232 = 64512 exactly (as the forward and the
  // GEMM). (48 / 232 asked for 65536: the second consumer warpgroup's setmaxnreg.inc waited forever,
  // the hang of the first GPU run; lcsc.cuh now checks the sum at compile time.) The D = 128 consumer
  // (dK and dV: 128 accumulators) needs all of 232; the loader fits 40 with its loops kept rolled.
  static constexpr int kProducerRegs = WGS == 3 ? 32 : 40;    // three consumers: 128 x 32 + 384 x 160 = 65536
  static constexpr int kConsumerRegs = WGS == 3 ? 160 : 232;
  static constexpr bool kHasCommunicator = false;
  static constexpr bool kTaskCounter = VARIANT_ >= 2;
  static constexpr bool kHasPusher = false;
  static constexpr uint32_t kTileBytes = uint32_t(BM * D) * sizeof(T);  // one Q (or dO) tile
  static constexpr uint32_t kKvBytes = uint32_t(BN * D) * sizeof(T);    // one K (or V) tile
  static constexpr uint32_t kStageBytes = 2 * kTileBytes + 2 * BM * sizeof(float);
  static constexpr int kChunk = 64 * 64;  // floats of one warpgroup's dQ chunk
  static_assert(D == 64 || D == 128, "head dim 64 or 128");
  static_assert(sizeof(T) == 2, "16-bit inputs");
  static_assert(kBoxCols == BM, "a dSᵀ row of BM queries is one 128-byte box row");

  // Tiles are D/64 boxes of `rows` x 64, one after another (box j holds columns 64j .. 64j+63).
  struct Stage {
    alignas(1024) T q[BM * D];
    alignas(1024) T dout[BM * D];
    alignas(16) float lse2[BM];
    alignas(16) float delta[BM];
  };
  // What each role has done (DEBUG variant only; written with volatile stores, read by a report):
  // task -1 = the role has not begun a task (e.g. blocked in setmaxnreg.inc before it), pairs = block
  // pairs loaded / finished / stored so far, step = where a consumer is in its block pair.
  struct Progress {
    int loader_task, loader_pairs;
    int consumer_task[WGS], consumer_pairs[WGS], consumer_step[WGS];
    int storer_task, storer_pairs;
  };
  enum Step { kStepIdle = 0, kStepKv = 1, kStepRingFull = 2, kStepDsBarrier = 3, kStepDqSlot = 4 };
  struct Shared {
    alignas(1024) T k[BN * D];
    alignas(1024) T v[BN * D];
    Stage stage[STAGES];
    alignas(1024) T ds[kDsBufs][BN * BM];  // dSᵀ: BN key rows x BM query columns, one swizzled box
    alignas(1024) float dq[WGS][kChunk];   // each warpgroup's dQ chunk, accumulator order
    Ring<STAGES> ring;  // full: Q, dO, lse2, delta landed; empty: every consumer warp is done with them
    Handoff kv_slot;    // full: K and V landed; empty: both consumers' last block pair is done
    Handoff dq_slot[WGS];
    Progress progress;  // DEBUG variant only
  };
  struct LoaderState {
    RingPos<STAGES> pos;
    uint32_t kv_phase;
  };
  struct ConsumerState {
    int warpgroup;
    RingPos<STAGES> pos;
    uint32_t kv_phase, dq_phase;
    int ds_buf;
  };
  struct StorerState {
    uint32_t dq_phase;
  };

  __host__ __device__ static int kv_blocks(const Globals& g) { return (g.tk + BN - 1) / BN; }
  __host__ __device__ static int q_blocks(const Globals& g) { return (g.tq + BM - 1) / BM; }
  __host__ __device__ static int head_split(const Globals& g) { return kHeadSplit ? g.head_split : 1; }
  __host__ __device__ static int num_tasks(const Globals& g) {
    return kv_blocks(g) * g.kv_heads * g.batch * head_split(g);
  }

  // Key blocks in ascending order: with a causal mask the first ones see the most query blocks, so
  // the heavy tasks start first and the persistent CTAs' last wave holds light ones.
  // A unit is (batch, kv head, share of the group): unit = (batch * kv_heads + kv head) * head_split + share.
  __device__ static Work work_of(const Globals& g, int task) {
    Work w;
    const int group = g.heads / g.kv_heads;
    if constexpr (kKeyBlocksFastest) {
      const int blocks = kv_blocks(g), unit = task / blocks;
      w.n0 = (task - unit * blocks) * BN;
      const int pair = kHeadSplit ? unit / g.head_split : unit;  // pair: batch * kv_heads + kv head
      w.kv_head = pair % g.kv_heads;
      w.batch = pair / g.kv_heads;
      w.heads = kHeadSplit ? group / g.head_split : group;
      w.head0 = w.kv_head * group + (kHeadSplit ? (unit - pair * g.head_split) * w.heads : 0);
    } else {
      const int per_block = g.kv_heads * g.batch;
      w.n0 = (task / per_block) * BN;
      w.kv_head = (task % per_block) % g.kv_heads;
      w.batch = (task % per_block) / g.kv_heads;
      w.heads = group;
      w.head0 = w.kv_head * group;
    }
    w.q_offset = g.offsets[0];
    w.kv_offset = g.offsets[1];
    const int all = q_blocks(g);
    w.m_begin = 0;
    if (g.causal) {
      // The first query row that sees key n0 (a later key is seen by no earlier row).
      const long long q_min = (long long)w.kv_offset + w.n0 - w.q_offset;
      if (q_min >= g.tq) w.m_begin = all;
      else if (q_min > 0) w.m_begin = int(q_min / BM);
    }
    w.m_count = all - w.m_begin;
    w.iters = w.heads * w.m_count;
    return w;
  }

  __device__ static void init(const Globals& g, Shared& s) {
    s.ring.init(1, 4 * WGS);  // full: the loader's expect_tx arrival; empty: one per consumer warp
    s.kv_slot.init(1, 4 * WGS);
    for (int w = 0; w < WGS; ++w) s.dq_slot[w].init(128, 1);
    if constexpr (DEBUG) {
      s.progress.loader_task = s.progress.storer_task = -1;
      s.progress.loader_pairs = s.progress.storer_pairs = 0;
      for (int w = 0; w < WGS; ++w) {
        s.progress.consumer_task[w] = -1;
        s.progress.consumer_pairs[w] = 0;
        s.progress.consumer_step[w] = kStepIdle;
      }
    }
    tma::prefetch_tensor_map(&g.q);
    tma::prefetch_tensor_map(&g.k);
    tma::prefetch_tensor_map(&g.v);
    tma::prefetch_tensor_map(&g.dout);
    if (g.dq_direct) tma::prefetch_tensor_map(&g.dq_state);
  }

  // DEBUG variant: a volatile store into the progress record (nothing otherwise).
  __device__ static void note(int& field, int value) {
    if constexpr (DEBUG) *const_cast<volatile int*>(&field) = value;
  }

  // Every mbarrier wait of the kernel: tma::mbar_wait, or (DEBUG) bounded, reporting and trapping.
  // `what` names the barrier, `index` its stage (ring) or warpgroup (dq_slot), -1 for none.
  __device__ static void wait(const Globals& g, Shared& s, uint64_t* bar, uint32_t parity, const char* what,
                              int index) {
    if constexpr (!DEBUG) {
      tma::mbar_wait(bar, parity);
    } else {
      if (debug::wait_bounded(bar, parity, g.debug_timeout_ns)) return;
      report_timeout(g, s, bar, parity, what, index);
      debug::spin_ns(1000000000ull);  // 1 s for the other stuck roles to time out and report too
      __trap();
    }
  }

  __device__ __noinline__ static void report_timeout(const Globals& g, Shared& s, const uint64_t* bar,
                                                     uint32_t parity, const char* what, int index) {
    const int t = threadIdx.x, wg = t / 128;
    if (wg > 0 && t % 128 != 0) return;  // one line per consumer warpgroup (its threads wait alike)
    const char* role = wg > 0 ? (wg == 1 ? "consumer wg0" : "consumer wg1") : (t / 32 == 0 ? "loader" : "storer");
    const volatile Progress& p = s.progress;
    printf("pk_jax attention_bwd<D=%d, STAGES=%d> TIMEOUT after %llu ms: block %d thread %d (%s) waits on "
           "%s[%d] parity %u, word 0x%016llx | progress (task -1: not begun): loader task %d pairs %d; "
           "consumer0 task %d pairs %d step %d; consumer1 task %d pairs %d step %d; storer task %d pairs %d "
           "(steps: 1 kv_slot.full, 2 ring.full, 3 dS named barrier, 4 dq_slot.empty) | kv_slot words full "
           "0x%016llx empty 0x%016llx; tasks %d, grid %d, tq %d tk %d heads %d kv_heads %d\n",
           D, STAGES, g.debug_timeout_ns / 1000000ull, int(blockIdx.x), t, role, what, index, parity, debug::raw_word(bar), p.loader_task, p.loader_pairs,
           p.consumer_task[0], p.consumer_pairs[0], p.consumer_step[0], p.consumer_task[1], p.consumer_pairs[1],
           p.consumer_step[1], p.storer_task, p.storer_pairs, debug::raw_word(&s.kv_slot.full),
           debug::raw_word(&s.kv_slot.empty), num_tasks(g), int(gridDim.x), g.tq, g.tk, g.heads, g.kv_heads);
  }

  __device__ static void load_boxes(T* dst, const CUtensorMap* map, int rows, int head, int row0, int batch,
                                    uint64_t* bar) {
#pragma unroll
    for (int j = 0; j < D / kBoxCols; ++j)
      tma::load_tile_4d(dst + j * rows * kBoxCols, map, j * kBoxCols, head, row0, batch, bar);
  }

  __device__ static size_t row_index(const Globals& g, const Work& w, int head, int m) {
    return (size_t(w.batch) * g.heads + head) * g.tq_pad + size_t(m) * BM;
  }

  __device__ static void loader(const Globals& g, Shared& s, LoaderState& st, int task) {
    const Work w = work_of(g, task);
    note(s.progress.loader_task, task);
    if (w.iters == 0) return;  // the consumers write dK = dV = 0 without K or V
    wait(g, s, &s.kv_slot.empty, st.kv_phase ^ 1, "kv_slot.empty", -1);
    tma::mbar_expect_tx(&s.kv_slot.full, 2 * kKvBytes);
    load_boxes(s.k, &g.k, BN, w.kv_head, w.n0, w.batch, &s.kv_slot.full);
    load_boxes(s.v, &g.v, BN, w.kv_head, w.n0, w.batch, &s.kv_slot.full);
    st.kv_phase ^= 1;
    // Rolled loops and one row index for lse2 and delta: the producer warpgroup has 40 registers.
#pragma unroll 1
    for (int head = w.head0; head < w.head0 + w.heads; ++head) {
#pragma unroll 1
      for (int m = w.m_begin; m < w.m_begin + w.m_count; ++m) {
        // tq_pad is a multiple of BM: rows row .. row + BM of lse2 / delta exist.
        const size_t row = row_index(g, w, head, m);
        wait(g, s, &s.ring.empty[st.pos.stage], st.pos.phase ^ 1, "ring.empty", st.pos.stage);
        Stage& dst = s.stage[st.pos.stage];
        uint64_t* bar = &s.ring.full[st.pos.stage];
        tma::mbar_expect_tx(bar, kStageBytes);
        load_boxes(dst.q, &g.q, BM, head, g.q_row0 + m * BM, w.batch, bar);
        load_boxes(dst.dout, &g.dout, BM, head, g.q_row0 + m * BM, w.batch, bar);
        tma::load_async(dst.lse2, g.lse2 + row, BM * sizeof(float), bar);
        tma::load_async(dst.delta, g.delta + row, BM * sizeof(float), bar);
        st.pos.advance();
        if constexpr (DEBUG) note(s.progress.loader_pairs, s.progress.loader_pairs + 1);
      }
    }
  }

  // Accumulator register i of a thread holds row kRow(i) (0 or 8, plus the thread's base row) and
  // column 8 * (i / 4) + 2 * (lane % 4) + i % 2 of the warpgroup's 64 x N tile (wgmma's layout).
  __device__ static constexpr int row_half(int i) { return (i / 2) % 2; }
  __device__ static int col_of(int i, int lane) { return 8 * (i / 4) + 2 * (lane % 4) + i % 2; }

  // Whether any (key, query) pair of the block pair may be invisible: a partial key block, or the
  // causal diagonal crossing it. (Query rows past Tq need no mask: lse2 = +inf makes their P 0.)
  __device__ static bool needs_mask(const Globals& g, const Work& w, int m) {
    const int last_key = w.n0 + BN - 1;
    return last_key >= g.tk || (g.causal && (long long)w.kv_offset + last_key > (long long)w.q_offset + m * BM);
  }

  // acc (+)= A B over `steps` k-steps of 16: both operands K-major tiles (rows of D along K).
  template <int N>
  __device__ static void issue_kmajor(const T* a, int a_rows, const T* b, int b_rows, float (&acc)[N / 2]) {
    const uint64_t da0 = wgmma::desc_sw128(a, 16, 1024), db0 = wgmma::desc_sw128(b, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int box = kk / 4, step = (kk % 4) * 16;  // k step kk: box kk / 4, 32 bytes per step inside a row
      const uint64_t da = wgmma::desc_advance(da0, (box * a_rows * kBoxCols + step) * sizeof(T));
      const uint64_t db = wgmma::desc_advance(db0, (box * b_rows * kBoxCols + step) * sizeof(T));
      wgmma::mma<T, N, 0, 0>(acc, da, db, kk != 0);
    }
    wgmma::commit();
  }

  // acc (D columns) += A(registers, 64 x BM) B, B = a BM x D tile read MN-major (transpose-B bit):
  // 16 rows per k step; LBO steps to the next 64-column box.
  __device__ static void issue_rs(const uint32_t (&a)[BM / 16][4], const T* b, float (&acc)[D / 2]) {
    const uint64_t db0 = wgmma::desc_sw128(b, BM * kBoxCols * sizeof(T), 1024);
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      const uint64_t db = wgmma::desc_advance(db0, kk * 16 * kBoxCols * sizeof(T));
      wgmma::mma_rs<T, D, 1>(acc, a[kk], db, 1);
    }
    wgmma::commit();
  }

  // dQ chunk (64 queries x 64 columns) = dS K over `KEYS` keys starting at key row `key0`: A = dSᵀ
  // read M-major (transpose-A bit; M = the 64 queries of one box row), B = K's column box `box`
  // read MN-major.
  template <int KEYS>
  __device__ static void issue_dq(const T* ds, const T* k, int key0, int box, float (&acc)[32]) {
    const uint64_t da0 = wgmma::desc_sw128(ds + key0 * kBoxCols, BN * kBoxCols * sizeof(T), 1024);
    const uint64_t db0 = wgmma::desc_sw128(k + box * BN * kBoxCols + key0 * kBoxCols, BN * kBoxCols * sizeof(T), 1024);
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
      const uint64_t da = wgmma::desc_advance(da0, kk * 16 * kBoxCols * sizeof(T));
      const uint64_t db = wgmma::desc_advance(db0, kk * 16 * kBoxCols * sizeof(T));
      wgmma::mma<T, 64, 1, 1>(acc, da, db, kk != 0);
    }
    wgmma::commit();
  }

  __device__ static void to_a_fragments(const float (&p)[BM / 2], uint32_t (&a)[BM / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) a[kk][r] = pack2<T>(p[8 * kk + 2 * r], p[8 * kk + 2 * r + 1]);
  }

  __device__ static void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
  }

  __device__ static void consumer(const Globals& g, Shared& s, ConsumerState& st, int task) {
    const Work w = work_of(g, task);
    const int wg = st.warpgroup, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int key_row = wg * 64 + warp * 16 + lane / 4;  // the thread's key rows in the block: +0, +8
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    note(s.progress.consumer_task[wg], task);
    if (w.iters > 0) {
      note(s.progress.consumer_step[wg], kStepKv);
      wait(g, s, &s.kv_slot.full, st.kv_phase, "kv_slot.full", -1);
      st.kv_phase ^= 1;
      if (idle_keys(g, w, wg)) {
        for (int it = 0; it < w.iters; ++it) idle_pair(g, s, st);
      } else {
        // The loader's order (the group's heads outer, query blocks inner), the block counted without a division.
        int m = w.m_begin;
        for (int it = 0; it < w.iters; ++it) {
          block_pair(g, s, st, w, m, key_row, lane, dk, dv);
          if (++m == w.m_begin + w.m_count) m = w.m_begin;
        }
      }
      if (lane == 0) tma::mbar_arrive(&s.kv_slot.empty);  // this warp's last read of K and V is done
    }
    store_dkv(g, w, key_row, lane, dk, dv);
  }

  // Pᵀ = exp2(Sᵀ scale log2e - lse2) in place. MASKED (a block the causal diagonal or the key sequence's end
  // crosses) zeroes the pairs a query cannot see; most blocks need no mask, and skip its compare and select.
  template <bool MASKED>
  __device__ static void probabilities(const Globals& g, const Work& w, int m, int key_row, int lane, const Stage& in,
                                       float (&sc)[BM / 2]) {
    // Column (query in the block) from which each of the thread's two key rows is seen: the causal
    // diagonal, INT_MAX for keys past Tk (kv_offset + key <= q_offset + q  <=>  q - m BM >= first).
    int first[2] = {INT_MIN, INT_MIN};
    if constexpr (MASKED) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int key = w.n0 + key_row + 8 * h;
        first[h] = key >= g.tk ? INT_MAX : g.causal ? w.kv_offset + key - w.q_offset - m * BM : INT_MIN;
      }
    }
#pragma unroll
    for (int i = 0; i < BM / 2; i += 2) {
      const int col = col_of(i, lane);  // even: registers i, i + 1 are columns col, col + 1
      const float2 lse2 = *reinterpret_cast<const float2*>(&in.lse2[col]);
      const float p0 = fast_exp2(fmaf(sc[i], g.scale_log2, -lse2.x));
      const float p1 = fast_exp2(fmaf(sc[i + 1], g.scale_log2, -lse2.y));
      sc[i] = MASKED && col < first[row_half(i)] ? 0.f : p0;
      sc[i + 1] = MASKED && col + 1 < first[row_half(i)] ? 0.f : p1;
    }
  }

  // One (query block m, key block) pair of one head: dV and dK accumulate, the dQ chunk goes to the
  // storer. Both score-shaped products are waited for before the elementwise work, and P and dS are
  // packed before dV += Pᵀ dO is issued: fewer live registers (D = 128 holds dK and dV: 128 of them).
  __device__ static void block_pair(const Globals& g, Shared& s, ConsumerState& st, const Work& w, int m,
                                    int key_row, int lane, float (&dk)[D / 2], float (&dv)[D / 2]) {
    const int wg = st.warpgroup;
    const Stage& in = s.stage[st.pos.stage];
    note(s.progress.consumer_step[wg], kStepRingFull);
    wait(g, s, &s.ring.full[st.pos.stage], st.pos.phase, "ring.full", st.pos.stage);
    float sc[BM / 2], dp[BM / 2];
    wgmma::fence();
    issue_kmajor<BM>(s.k + wg * 64 * kBoxCols, BN, in.q, BM, sc);     // Sᵀ = K_wg Qᵀ
    issue_kmajor<BM>(s.v + wg * 64 * kBoxCols, BN, in.dout, BM, dp);  // dPᵀ = V_wg dOᵀ
    wgmma::wait<1>();  // Sᵀ is done (groups retire in order)
    wgmma::fence_operands(sc);
    if (needs_mask(g, w, m)) probabilities<true>(g, w, m, key_row, lane, in, sc);
    else probabilities<false>(g, w, m, key_row, lane, in, sc);
    wgmma::wait<0>();  // dPᵀ is done
    wgmma::fence_operands(dp);
#pragma unroll
    for (int i = 0; i < BM / 2; i += 2) {
      const float2 delta = *reinterpret_cast<const float2*>(&in.delta[col_of(i, lane)]);
      dp[i] = sc[i] * (dp[i] - delta.x);
      dp[i + 1] = sc[i + 1] * (dp[i + 1] - delta.y);
    }
    uint32_t pa[BM / 16][4];
    to_a_fragments(sc, pa);
    // dSᵀ to shared memory (this warpgroup's 64 key rows of the buffer), then to the async proxy.
    T* ds = s.ds[st.ds_buf];
    store_acc<T, BM>(ds + wg * 64 * kBoxCols, dp);
    tma::fence_proxy_async_shared();
    uint32_t dsa[BM / 16][4];
    to_a_fragments(dp, dsa);
    wgmma::fence();
    issue_rs(pa, in.dout, dv);                     // dV += Pᵀ dO
    if constexpr (!kDqFirst || WGS == 3) issue_rs(dsa, in.q, dk);  // dK += dSᵀ Q
    if constexpr (WGS == 3) {
      // 160 registers: P and dS (the RS operands) retire before dQ's accumulators are allocated; the other two
      // warpgroups keep the tensor cores busy meanwhile.
      wgmma::wait<0>();
      wgmma::fence_operands(dv);
      wgmma::fence_operands(dk);
      if (lane == 0) tma::mbar_arrive(&s.ring.empty[st.pos.stage]);
      st.pos.advance();
    }
    float dq[32];
    note(s.progress.consumer_step[wg], kStepDsBarrier);
    if constexpr (kDqShared) {
      named_sync(1, 256);  // both warpgroups' dSᵀ are in ds[ds_buf]
      issue_dq<BN>(ds, s.k, 0, wg, dq);
    } else {
      named_sync(1 + wg, 128);  // the warpgroup's four warps' dSᵀ rows are in
      // Three consumers: dQ accumulates in Sᵀ's registers (dead once P is packed); a separate array made ptxas
      // serialize the wgmmas for want of registers at 160.
      if constexpr (WGS == 3) issue_dq<64>(ds, s.k, wg * 64, 0, sc);
      else issue_dq<64>(ds, s.k, wg * 64, 0, dq);
    }
    st.ds_buf ^= 1;
    if constexpr (WGS == 3) {
      wgmma::wait<0>();
      wgmma::fence_operands(sc);
      store_dq_chunk(g, s, st, sc);
    } else if constexpr (kDqFirst) {
      issue_rs(dsa, in.q, dk);  // dK += dSᵀ Q: runs while the dQ chunk goes to the slot
      wgmma::wait<1>();         // dV and dQ are done (groups retire in order); dK may still run
      wgmma::fence_operands(dq);
      wgmma::fence_operands(dv);
      store_dq_chunk(g, s, st, dq);
      wgmma::wait<0>();  // dK is done: the stage (Q for dK) may be released
      wgmma::fence_operands(dk);
      if (lane == 0) tma::mbar_arrive(&s.ring.empty[st.pos.stage]);
      st.pos.advance();
    } else {
      wgmma::wait<0>();
      wgmma::fence_operands(dq);
      wgmma::fence_operands(dk);
      wgmma::fence_operands(dv);
      if (lane == 0) tma::mbar_arrive(&s.ring.empty[st.pos.stage]);
      st.pos.advance();
      store_dq_chunk(g, s, st, dq);
    }
    if constexpr (DEBUG) {
      if (threadIdx.x % 128 == 0) {
        note(s.progress.consumer_pairs[wg], s.progress.consumer_pairs[wg] + 1);
        note(s.progress.consumer_step[wg], kStepIdle);
      }
    }
  }

  // w3: whether all 64 keys of warpgroup wg lie past the key sequence (the last 192-key block of Tk 4096: two of its
  // three warpgroups). Such a warpgroup computes nothing (idle_pair) and the storer adds nothing of its slot.
  __device__ static bool idle_keys(const Globals& g, const Work& w, int wg) {
    return WGS == 3 && w.n0 + wg * 64 >= g.tk;
  }

  // An idle warpgroup's block pair: only its part of the protocol. The stage is released once it has landed (an
  // earlier release would count toward the stage's previous use), and the dQ slot is handed over unwritten.
  __device__ static void idle_pair(const Globals& g, Shared& s, ConsumerState& st) {
    const int wg = st.warpgroup, lane = threadIdx.x % 32;
    wait(g, s, &s.ring.full[st.pos.stage], st.pos.phase, "ring.full", st.pos.stage);
    if (lane == 0) tma::mbar_arrive(&s.ring.empty[st.pos.stage]);
    st.pos.advance();
    Handoff& slot = s.dq_slot[wg];
    wait(g, s, &slot.empty, st.dq_phase ^ 1, "dq_slot.empty", wg);
    tma::mbar_arrive(&slot.full);
    st.dq_phase ^= 1;
  }

  // The dQ chunk to this warpgroup's slot (once the storer has read the previous one), one float4 per thread
  // and register quad, then handed to the storer.
  __device__ __forceinline__ static void store_dq_chunk(const Globals& g, Shared& s, ConsumerState& st,
                                                        const float (&dq)[32]) {
    const int wg = st.warpgroup;
    Handoff& slot = s.dq_slot[wg];
    note(s.progress.consumer_step[wg], kStepDqSlot);
    wait(g, s, &slot.empty, st.dq_phase ^ 1, "dq_slot.empty", wg);
    const int t = threadIdx.x % 128;
    if (g.dq_direct) {
      store_dq_boxes(s.dq[wg], t, g.scale, dq);
    } else {
      float4* out = reinterpret_cast<float4*>(s.dq[wg]);
#pragma unroll
      for (int c = 0; c < 8; ++c) out[c * 128 + t] = make_float4(dq[4 * c], dq[4 * c + 1], dq[4 * c + 2], dq[4 * c + 3]);
    }
    tma::fence_proxy_async_shared();  // the storer's bulk reduce (async proxy) reads it
    tma::mbar_arrive(&slot.full);
    st.dq_phase ^= 1;
  }

  // dq_direct: the warpgroup's 64 x 64 dQ chunk, times scale, as two TMA boxes of 64 rows x 32 floats (128-byte
  // rows, 128-byte swizzle: 16-byte unit u of row r at unit u ^ (r % 8)), the layout the storer's tensor reduce
  // reads. Register i of thread t holds row 16 (t / 32) + 8 ((i / 2) % 2) + (t % 32) / 4, column col_of(i):
  // one float2 per register pair; the swizzle spreads a warp's 8 rows over the banks (two wavefronts per store).
  __device__ __forceinline__ static void store_dq_boxes(float* chunk, int t, float scale, const float (&dq)[32]) {
    const int lane = t % 32, row0 = 16 * (t / 32) + lane / 4;
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int row = row0 + 8 * row_half(i), col = col_of(i, lane);
      const int box = col / 32, c = col % 32;
      const int at = box * 64 * 32 + row * 32 + (((c / 4) ^ (row % 8)) * 4) + c % 4;
      *reinterpret_cast<float2*>(chunk + at) = make_float2(dq[i] * scale, dq[i + 1] * scale);
    }
  }

  // dK (scaled) and dV rows straight from the accumulators to global memory (keys past Tk skipped); with a head
  // split, float2 reduce-adds of the task's partials into dkv_acc (a task that saw no query adds nothing).
  __device__ static void store_dkv(const Globals& g, const Work& w, int key_row, int lane, const float (&dk)[D / 2],
                                   const float (&dv)[D / 2]) {
    const bool split = kHeadSplit && g.head_split > 1;
    if (split && w.iters == 0) return;
    T* dk_out = static_cast<T*>(g.dk);
    T* dv_out = static_cast<T*>(g.dv);
    const size_t dv_acc = size_t(g.batch) * g.tk * g.kv_heads * D;  // dV's offset in dkv_acc
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = w.n0 + key_row + 8 * h;
      if (key >= g.tk) continue;
      const size_t base = ((size_t(w.batch) * g.tk + key) * g.kv_heads + w.kv_head) * D;
#pragma unroll
      for (int i = 0; i < D / 2; i += 2)
        if (row_half(i) == h) {
          const int col = col_of(i, lane);
          if (kHeadSplit && split) {
            atomicAdd(reinterpret_cast<float2*>(g.dkv_acc + base + col), make_float2(dk[i] * g.scale, dk[i + 1] * g.scale));
            atomicAdd(reinterpret_cast<float2*>(g.dkv_acc + dv_acc + base + col), make_float2(dv[i], dv[i + 1]));
          } else {
            *reinterpret_cast<uint32_t*>(dk_out + base + col) = pack2<T>(dk[i] * g.scale, dk[i + 1] * g.scale);
            *reinterpret_cast<uint32_t*>(dv_out + base + col) = pack2<T>(dv[i], dv[i + 1]);
          }
        }
    }
  }

  // Adds every dQ chunk into the float32 buffer (TMA bulk reduce), in the consumers' order.
  __device__ static void storer(const Globals& g, Shared& s, StorerState& st, int task) {
    const Work w = work_of(g, task);
    note(s.progress.storer_task, task);
    for (int head = w.head0; head < w.head0 + w.heads; ++head) {
      float* block = g.dq_acc + row_index(g, w, head, w.m_begin) * D;
      for (int m = 0; m < w.m_count; ++m, block += BM * D) {
        for (int wg = 0; wg < WGS; ++wg) {
          wait(g, s, &s.dq_slot[wg].full, st.dq_phase, "dq_slot.full", wg);
          if (idle_keys(g, w, wg)) continue;  // handed over unwritten
          if (g.dq_direct) {  // two 32-column boxes into the state's rows (clipped at its end)
            const int row = g.dq_row0 + (w.m_begin + m) * BM, col = kDqShared ? wg * 64 : 0;
            for (int j = 0; j < 2; ++j)
              tma::store_add_tile_4d(&g.dq_state, col + 32 * j, head, row, w.batch, s.dq[wg] + j * 64 * 32);
          } else {
            tma::store_add_async(block + (kDqShared ? wg * kChunk : 0), s.dq[wg], kChunk * sizeof(float));
          }
          tma::commit_group();
        }
        tma::wait_group_read<0>();  // the slots may be rewritten once the reduce has read them
        for (int wg = 0; wg < WGS; ++wg) tma::mbar_arrive(&s.dq_slot[wg].empty);
        st.dq_phase ^= 1;
        if constexpr (DEBUG) note(s.progress.storer_pairs, s.progress.storer_pairs + 1);
      }
    }
  }

  __device__ static void storer_finish(const Globals& g, Shared&, StorerState&) {
    tma::wait_group<0>();
    if (uint32_t* counter = kTaskCounter ? task_counter(g) : nullptr) finish_counter_pair(counter);
  }
  __device__ static void communicator(const Globals&, CommShared&, lcsc::CommRole) {}
  __device__ static void begin(const Globals&, Shared&) {}
  __device__ static uint32_t* task_counter(const Globals& g) {
    return g.causal ? kernel_counter_pair<Kernel> : nullptr;
  }
  __device__ static void pusher(const Globals&, Shared&) {}
  __device__ static void finish(const Globals&) {}
};

}  // namespace pk::attention_bwd
