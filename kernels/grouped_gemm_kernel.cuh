// Grouped GEMM (jax.lax.ragged_dot and its VJP) on the GEMM's LCSC kernel: contiguous ragged groups of
// token rows, group e multiplied by its own matrix. group_sizes stay on the device: every CTA builds the
// group table itself (pk/group_table.cuh) and walks its tasks persistently.
//   kForward:    out(tokens, n) = x_e(rows, k) @ w[e](k, n),  w stored (E, k, n)
//   kInputGrad:  out(tokens, n) = x_e(rows, k) @ w[e]ᵀ,       w stored (E, n, k), read in place (B_NK)
//   kWeightGrad: out[e](m, n) = x_eᵀ @ y_e over group e's rows (a ragged K), x (tokens, m) read in place
//                (A_KM), y (tokens, n); groups without rows get zeros.
// Forward / input grad: a task is (row tile of a group, n tile); a group's tiles start at its first row
// (unaligned TMA boxes), so its last tile reads the next group's rows: those output rows are never stored
// (a consumer copies a partial 64-row slice itself, row by row; whole slices go out by TMA). The tail
// (rows past sum(group_sizes)) is one more group whose tiles are zeros and not tasks: CTA i's storer stores
// tail tiles i, i + CTAs, ... from a zeroed box in shared memory, a few after each of its tasks' stores and the
// rest at its end, so those stores run under the MMAs (an MoE layer's worst-case row bound leaves ~3/4 of the
// rows in the tail at G 4; as tasks they ran after every compute tile, bandwidth-bound). Tasks past the real
// count (the host launches a static bound) are skipped by every role alike.
// Variant bit `notail` leaves the tail's rows unwritten (moe_mlp reads only the rows in use). A second product
// (k2 > 0, forward / input grad): out = a @ b[e] + a2 @ b2[e], its k-blocks loaded after the first's into the same
// accumulator (moe_mlp's d recv = d_gate @ w_gateᵀ + d_up @ w_upᵀ in one pass).
// Weight grad: a task is (group, m tile, n tile), groups largest first (balance under skew); the last
// k-block of a group holds rows of the next one: the consumers zero those k-rows of A and B in shared
// memory before their MMAs.
// Variants (PK_JAX_GROUPED_VARIANT, read by pk_jax/moe/grouped_matmul.py at trace time; none: the schedule
// above): `dyn` claims tasks from a device-wide counter (pk/task_queue.cuh) instead of the static
// round-robin, so CTAs whose tasks are cheap (a group's short last row tile, where a consumer warpgroup
// skips its MMAs; a narrow n tail; a short-K weight-grad group) take more of them: the counter is reset by
// the launch's last CTA (one launch of a kernel at a time per device). `narrow`: a tile whose valid
// columns fit in BN/2 (the n tail, e.g. n = 1408 = 5.5 x 256) runs m64n(BN/2) wgmmas on half the
// accumulator. `n128` (host only, grouped_gemm.cu): the 128x128 tile where n % 256 is 1..128 in the weight grad
// too (the forward and input grad take it by default there). `pipe`
// (weight grad, 128x128 tiles): a consumer keeps a task's accumulator (a second 64-register copy) and writes
// it out after issuing the next task's first k-block, so the epilogue of a short-K tile runs under the
// next tile's MMAs (the last one in consumer_finish); with pipe the weight grad ignores narrow (its n tail
// is at most 128 wide already). `pair` (forward): clusters of two CTAs; a task is a pair of one group's row tiles
// (tiles 2i and 2i + 1) and an n tile, each CTA computing one of the two while each loads half of the B boxes and
// multicasts them to both (pk/cluster.cuh: within one GPU), so B is read from L2 once per pair instead of once per
// tile (one H100, k 7168, E 64 at 512 rows: L2 at 88 % of its throughput, tensor pipes at 76 %). A group's odd
// last tile leaves the second CTA a shadow: it loads and releases the stages, computes and stores nothing.
// Measured (one H200, 2026-11-27, m 32768 k 7168 n 2048 and the bench rows): 0.90-1.0x the default; with
// 128x128 tiles (5 stages) no better: halving B's L2 reads does not speed this kernel up.
// `w128` (host only): 128x128 tiles in every mode (5 stages): 0.85-0.93x.
// `split` (forward / input grad): a task whose rows fit in one 64-row slice (a group's short last tile) is
// computed by both consumer warpgroups on those rows, each over half the columns (m64n(BN/2) wgmmas from the same
// stage), instead of by the first warpgroup alone while the second skips (one H200, k 7168: a 64x256 tile on one
// warpgroup took ~1.1x the time of a 128x256 tile on two; docs/design-moe.md).
#pragma once
#include <climits>
#include <type_traits>

#include "gemm_kernel.cuh"
#include "pk/cluster.cuh"
#include "pk/group_table.cuh"

namespace pk::grouped {

enum Mode : int { kForward = 0, kInputGrad = 1, kWeightGrad = 2 };

struct Globals {
  CUtensorMap a, b, c;  // a: x; b: w (3-D, E matrices) or y; c: out (3-D for the weight grad)
  CUtensorMap a2, b2;   // forward / input grad with k2 > 0: a second product summed into the same tiles
  const int32_t* group_sizes;
  void* out;          // c's base, for the consumers' row-masked copies
  int tokens;         // rows of x (and y)
  int m, n, k;        // forward / input grad: out (tokens, n), contraction k; weight grad: out (E, m, n)
  int k2;             // forward / input grad: the second product's contraction (0: none)
  int num_groups;
  int tiles_m, tiles_n;  // weight grad: tiles of one output matrix; forward / input grad: tiles_n only
  int group_m;           // tile-rows per raster band (TileGrid)
  int max_tasks;         // static bound on the task count (the launch's)
  int num_comm_sms;      // 0
  int narrow_tail;       // variant `narrow`: tiles with <= BN/2 valid columns run half-width MMAs
  int store_tail;        // forward / input grad: 1 stores the tail's zeros; 0 (variant `notail`) leaves those rows
  int split_short;       // variant `split`: a task of <= 64 rows runs on both warpgroups (split_task); 0 elsewhere
  int k_slices;          // variant `kslice` (weight grad): a group's last k-block runs only its 16-row slices in use
};

// Variant bits (Problem::variant, the custom call's `variant` attribute).
enum Variant : int {
  kVariantDynamic = 1, kVariantNarrow = 2, kVariant128 = 4, kVariantPipe = 8,
  kVariantNoTail = 16,  // rows past sum(group_sizes) are left as they were (callers that never read them)
  kVariantPair = 32,    // forward: two-CTA clusters sharing B (other modes ignore it; it wins over dyn)
  kVariantTile128 = 64,  // host only: 128x128 tiles in every mode (5 stages instead of 3)
  kVariantSplit = 128,   // forward / input grad: a tile of <= 64 rows is computed by both warpgroups, half the columns each
  kVariantKSlice = 256,  // weight grad: the last k-block's MMAs stop at the group's last 16-row slice (mask_stage
                         // zeros only inside that slice, and not at all when the group ends on a slice boundary)
  kVariantMask = 511
};

// Variant `dyn`: per kernel instantiation (slot), the next task to claim and the CTAs done. Zero at module
// load; the last CTA of a launch resets both (storer_finish), so graph replays start from zero too.
constexpr int kCounterSlots = 16;
__device__ uint32_t g_task_counters[kCounterSlots][2];

// One 64-row x 128-byte output box of zeros: the tail's tiles are TMA stores of it.
constexpr int kZeroBoxBytes = 64 * 128;

template <int SLOT>  // SLOT >= 0: tasks claimed at run time from g_task_counters[SLOT]
struct Ext : gemm::NoComm {
  using Globals = grouped::Globals;
  struct SharedExt {
    GroupTable table;
    alignas(1024) unsigned char zero_box[kZeroBoxBytes];  // 1024: the output map's 128-byte swizzle period
  };
  static constexpr bool kTaskCounter = SLOT >= 0;
  __device__ static uint32_t* task_counter(const Globals&) { return g_task_counters[SLOT < 0 ? 0 : SLOT]; }
};

// Shared memory a grouped kernel holds beside its stages and output slots (group table, zero box): the hosts'
// stage counts (grouped_gemm.cu, moe_gemm.cu) subtract it.
constexpr size_t kSharedExtBytes = sizeof(Ext<-1>::SharedExt);

template <typename T, int BN, int MODE, bool DYN, bool PIPE>
constexpr int counter_slot() {
  static_assert(kWeightGrad * 4 + 4 + 1 < kCounterSlots, "counter slots");
  return !DYN ? -1 : PIPE ? 12 + (std::is_same_v<T, __half> ? 1 : 0)
                          : MODE * 4 + (BN == 256 ? 0 : 2) + (std::is_same_v<T, __half> ? 1 : 0);
}

// One task as every role sees it.
struct Task {
  bool valid;    // false: past the real task count, skipped
  int group;     // expert (forward: E for the tail's zero tiles)
  int row0;      // first output row of the tile (forward: a token row; weight grad: a row of out[e])
  int row_end;   // output rows >= row_end are not stored (forward: the group's end; weight grad: m)
  int col0;      // first output column
  int k0;        // first contraction row (weight grad: the group's first token row)
  int k_blocks;  // 64-deep k-blocks
  int k_last;    // valid k-rows of the last k-block (weight grad; 64 elsewhere)
};

template <typename T, int WGS_, int BN_, int STAGES_, int MODE, bool DYN = false, bool PIPE = false,
          bool PAIR = false>
struct Kernel : gemm::Kernel<T, T, WGS_, BN_, STAGES_, Ext<counter_slot<T, BN_, MODE, DYN, PIPE>()>, MODE == kWeightGrad,
                             MODE == kInputGrad> {
  using ExtT = Ext<counter_slot<T, BN_, MODE, DYN, PIPE>()>;
  using Base = gemm::Kernel<T, T, WGS_, BN_, STAGES_, ExtT, MODE == kWeightGrad, MODE == kInputGrad>;
  using Shared = typename Base::Shared;
  using Stage = typename Base::Stage;
  using LoaderState = typename Base::LoaderState;
  static_assert(!PIPE || (MODE == kWeightGrad && BN_ == 128), "pipe: weight grad, 128x128 tiles (two accumulators)");
  static_assert(!PAIR || (MODE == kForward && !DYN && !PIPE), "pair: the forward's static schedule");
  static constexpr int kClusterSize = PAIR ? 2 : 1;  // lcsc.cuh launches clusters of this size
  static constexpr bool kCounterAlways = DYN;  // lcsc.cuh compiles the claiming walk alone (no spills at 128x256)
  // Variant pipe: the previous task's accumulator and task, written out under the next task's first MMAs.
  // (prev is left uninitialized: registers the wgmma accumulator may share no non-wgmma definition with,
  // or ptxas serializes the wgmmas.)
  struct PipeState : Base::ConsumerState {
    float prev[BN_ / 2];
    Task prev_task;
    bool has_prev;
    __device__ PipeState() : Base::ConsumerState{}, prev_task{}, has_prev(false) {}
  };
  using ConsumerState = std::conditional_t<PIPE, PipeState, typename Base::ConsumerState>;
  struct StorerState : Base::StorerState {
    int zeros_done = 0;  // this CTA's tail tiles stored so far
  };
  // Tail tiles a storer stores after each task: at the G 4 MoE bound (3 tail tiles per compute tile) the tail is
  // done within the first ~3/4 of the tasks; 64 KiB each against a task's ~20-60 us of MMAs.
  static constexpr int kZeroTilesPerTask = 4;
  using SlotLayout = typename Base::SlotLayout;
  static constexpr int WGS = WGS_, BN = BN_, BM = Base::BM, BK = Base::BK;
  static constexpr int kBoxCols = Base::kBoxCols, kOutBoxCols = Base::kOutBoxCols;
  static constexpr bool kWeightGradMode = MODE == kWeightGrad;
  static constexpr bool A_KM = kWeightGradMode, B_NK = MODE == kInputGrad;
  static_assert(128 * (WGS + 1) >= kMaxGroups + 2, "the group table is built with one thread per group");
  static_assert(sizeof(T) == 2, "16-bit operands and output");

  __host__ __device__ static int num_tasks(const Globals& g) { return g.max_tasks; }
  __host__ __device__ static int k_blocks_of(int k) { return (k + BK - 1) / BK; }

  __device__ static Task task_of(const Globals& g, const GroupTable& tb, int t) {
    Task r{};
    const int groups = g.num_groups;
    if constexpr (kWeightGradMode) {
      const int per = g.tiles_m * g.tiles_n;
      const int e = tb.order[t / per];
      const int2 tile = TileGrid{g.tiles_m, g.tiles_n, g.group_m}.tile(t % per);
      const int rows = tb.start[e + 1] - tb.start[e];
      r.valid = true;
      r.group = e;
      r.row0 = tile.x * BM;
      r.row_end = g.m;
      r.col0 = tile.y * BN;
      r.k0 = tb.start[e];
      r.k_blocks = (rows + BK - 1) / BK;
      r.k_last = rows - (r.k_blocks - 1) * BK;  // 1..64 when k_blocks > 0
    } else if constexpr (PAIR) {
      const int pairs = tb.pair_start[groups];
      if (t >= pairs * g.tiles_n) return r;  // valid = false
      const int2 tile = TileGrid{pairs, g.tiles_n, g.group_m}.tile(t);
      const int e = tb.group_of_pair(tile.x, groups);
      const int mine = (tile.x - tb.pair_start[e]) * 2 + int(cluster::rank());
      const bool shadow = mine >= tb.tile_start[e + 1] - tb.tile_start[e];  // an odd group's last pair
      r.valid = true;
      r.group = e;
      r.row0 = tb.start[e] + (shadow ? mine - 1 : mine) * BM;  // a shadow loads its partner's rows
      r.row_end = shadow ? r.row0 : tb.start[e + 1];             // and stores none
      r.col0 = tile.y * BN;
      r.k0 = 0;
      r.k_blocks = k_blocks_of(g.k) + k_blocks_of(g.k2);
      r.k_last = BK;
    } else {
      const int tiles = tb.tile_start[groups];  // the groups' row tiles (the tail's are the storers')
      if (t >= tiles * g.tiles_n) return r;    // valid = false
      const int2 tile = TileGrid{tiles, g.tiles_n, g.group_m}.tile(t);
      const int e = tb.group_of_tile(tile.x, groups);
      r.valid = true;
      r.group = e;
      r.row0 = tb.start[e] + (tile.x - tb.tile_start[e]) * BM;
      r.row_end = tb.start[e + 1];
      r.col0 = tile.y * BN;
      r.k0 = 0;
      r.k_blocks = k_blocks_of(g.k) + k_blocks_of(g.k2);  // the second product's k-blocks follow the first's
      r.k_last = BK;
    }
    return r;
  }

  // Output rows of warpgroup w's 64-row slice that belong to the tile's group (0..64).
  __device__ static int slice_rows(const Task& task, int w) {
    const int rows = task.row_end - (task.row0 + w * 64);
    return rows < 0 ? 0 : (rows > 64 ? 64 : rows);
  }
  // Variant `split`: a forward / input-grad task with 1..64 rows, computed by both warpgroups (half the columns each).
  __device__ static bool split_task(const Globals& g, const Task& task) {
    if constexpr (kWeightGradMode || BN < 128) return false;
    else return g.split_short && task.row_end > task.row0 && task.row_end - task.row0 <= 64 && !narrow_task(g, task);
  }

  // Warpgroup w's part of a task's output: 64 rows (those of the group: `rows`) from row0, `width` columns from col0.
  struct Slice {
    int row0, rows, col0, width;
  };
  __device__ static Slice slice_of(const Globals& g, const Task& task, int w) {
    if (split_task(g, task)) return {task.row0, slice_rows(task, 0), task.col0 + w * (BN / 2), BN / 2};
    return {task.row0 + w * 64, slice_rows(task, w), task.col0, BN};
  }

  // Whether the storer's TMA stores the slice: all 64 rows are the group's, or the group ends at the
  // output's last row (TMA clips there). Otherwise a partial slice is copied by its consumers.
  __device__ static bool tma_stored(const Globals& g, const Task& task, int w) {
    const int rows = slice_of(g, task, w).rows;
    return rows > 0 && (rows == 64 || task.row_end >= (kWeightGradMode ? g.m : g.tokens));
  }

  // Forward / input grad: the tail's BM x BN tiles (rows past sum(group_sizes)), stored as zeros by the storers.
  __device__ static int zero_tiles(const Globals& g, const GroupTable& tb) {
    if (kWeightGradMode || !g.store_tail) return 0;
    return (tb.tile_start[g.num_groups + 1] - tb.tile_start[g.num_groups]) * g.tiles_n;
  }

  // Tail tile z as zeros: one TMA store of the zero box per 64-row x 128-byte box inside the output.
  __device__ static void store_zero_tile(const Globals& g, const Shared& s, int z) {
    const int row0 = s.ext.table.start[g.num_groups] + (z / g.tiles_n) * BM, col0 = (z % g.tiles_n) * BN;
    for (int w = 0; w < WGS && row0 + w * 64 < g.tokens; ++w) {
#pragma unroll
      for (int j = 0; j < BN / kOutBoxCols; ++j)
        if (col0 + j * kOutBoxCols < g.n)
          tma::store_tile_2d(&g.c, col0 + j * kOutBoxCols, row0 + w * 64, s.ext.zero_box);
    }
    tma::commit_group();
  }

  // This CTA's tail tiles (blockIdx.x, + gridDim.x, ...) up to `quota` of them in all (INT_MAX: every one).
  __device__ static void store_zero_tiles(const Globals& g, const Shared& s, StorerState& st, int quota) {
    const int total = zero_tiles(g, s.ext.table);
    for (; st.zeros_done < quota; ++st.zeros_done) {
      const int z = int(blockIdx.x) + st.zeros_done * int(gridDim.x);
      if (z >= total) break;
      store_zero_tile(g, s, z);
    }
  }

  __device__ static void begin(const Globals& g, Shared& s) {
    for (int i = threadIdx.x; i < kZeroBoxBytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(s.ext.zero_box)[i] = make_uint4(0, 0, 0, 0);
    tma::fence_proxy_async_shared();  // before the storer's TMA reads it (build() ends with a CTA barrier)
    s.ext.table.build(g.group_sizes, g.num_groups, g.tokens, kWeightGradMode ? 0 : BM, kWeightGradMode, PAIR);
  }

  // pair: each empty barrier counts the consumer warps of both CTAs (a stage is multicast into both).
  __device__ static void init(const Globals& g, Shared& s) {
    Base::init(g, s);
    if constexpr (PAIR)
      for (int i = 0; i < Base::STAGES; ++i) tma::mbar_init(&s.ring.empty[i], 2 * 4 * WGS);
  }

  // A consumer warp's release of a ring stage (lane 0): to its CTA's loader and, with pair, to the peer's.
  __device__ static void release(Shared& s, int stage) {
    tma::mbar_arrive(&s.ring.empty[stage]);
    if constexpr (PAIR) cluster::mbar_arrive_peer(&s.ring.empty[stage], cluster::rank() ^ 1u);
  }

  __device__ static void loader(const Globals& g, Shared& s, LoaderState& st, int t) {
    const Task task = task_of(g, s.ext.table, t);
    if (!task.valid) return;
    for (int kb = 0; kb < task.k_blocks; ++kb) {
      st.pos.wait_empty(s.ring);
      Stage& dst = s.stage[st.pos.stage];
      uint64_t* full = &s.ring.full[st.pos.stage];
      tma::mbar_expect_tx(full, Base::kStageBytes);  // out-of-bounds box parts count too (zero-filled)
      const int krow = task.k0 + kb * BK;
      if constexpr (kWeightGradMode) {
        // x (tokens, m): BM/64 M-major boxes of 64 token rows x 64 m; y (tokens, n): BN/64 N-major boxes.
#pragma unroll
        for (int j = 0; j < BM / kBoxCols; ++j)
          tma::load_tile_2d(dst.a + j * BK * kBoxCols, &g.a, task.row0 + j * kBoxCols, krow, full);
#pragma unroll
        for (int j = 0; j < BN / kBoxCols; ++j)
          tma::load_tile_2d(dst.b + j * BK * kBoxCols, &g.b, task.col0 + j * kBoxCols, krow, full);
      } else {
        // k-blocks past the first product's come from the second (a2, b2), from its k-row 0; a partial last
        // k-block of either reads TMA zeros past its k.
        const int first = k_blocks_of(g.k);
        const bool second = kb >= first;
        const CUtensorMap* a = second ? &g.a2 : &g.a;
        const CUtensorMap* b = second ? &g.b2 : &g.b;
        const int kr = second ? (kb - first) * BK : krow;
        tma::load_tile_2d(dst.a, a, kr, task.row0, full);  // BM token rows from the tile's first row
        if constexpr (MODE == kInputGrad) {  // w[e] stored (n, k): one K-major box of BN n-rows x 64 k
          tma::load_tile_3d(dst.b, b, kr, task.col0, task.group, full);
        } else if constexpr (PAIR) {  // this CTA's half of the boxes, multicast to both CTAs of the cluster
          const int rank = int(cluster::rank());
#pragma unroll
          for (int j = 0; j < BN / kBoxCols; ++j)
            if (j % 2 == rank)
              cluster::load_tile_3d_multicast(dst.b + j * BK * kBoxCols, b, task.col0 + j * kBoxCols, kr, task.group,
                                              full, uint16_t(0x3));
        } else {  // w[e] stored (k, n): BN/64 N-major boxes of 64 k-rows x 64 n
#pragma unroll
          for (int j = 0; j < BN / kBoxCols; ++j)
            tma::load_tile_3d(dst.b + j * BK * kBoxCols, b, task.col0 + j * kBoxCols, kr, task.group, full);
        }
      }
      st.pos.advance();
    }
  }

  // Zero k-rows [valid, end) of one 64-row x 128-byte box (a k-row is one whole swizzled 128-byte row).
  __device__ static void zero_k_rows(T* box, int valid, int end, int thread) {
    uint4* p = reinterpret_cast<uint4*>(box);
    for (int c = valid * 8 + thread; c < end * 8; c += 128) p[c] = make_uint4(0, 0, 0, 0);
  }

  // Weight grad, last k-block of a group: the consumers zero the k-rows [valid, end) in both operands (the next
  // group's rows; rows past `tokens` are already TMA zeros; rows from `end` on are read by no MMA), then all of
  // them sync before any MMA reads the stage. Warpgroup w zeros its own A box and B boxes w, w + WGS, ...
  __device__ static void mask_stage(Stage& in, int warpgroup, int valid, int end) {
    const int thread = threadIdx.x % 128;
    zero_k_rows(in.a + warpgroup * BK * kBoxCols, valid, end, thread);
#pragma unroll
    for (int j = warpgroup; j < BN / kBoxCols; j += WGS) zero_k_rows(in.b + j * BK * kBoxCols, valid, end, thread);
    tma::fence_proxy_async_shared();  // generic-proxy zeros before the async-proxy (wgmma) reads
    asm volatile("bar.sync 1, %0;" ::"n"(128 * WGS) : "memory");  // every consumer thread's zeros are in
  }

  // Base::mma_stage at wgmma width N (<= BN): acc holds N columns of the tile from column b_col (a multiple of
  // 64), rows of A slice a_slice (64-row slices).
  // SLICES < BK / 16: only the first SLICES 16-row k-slices (variant kslice: a group's last k-block).
  template <int N, int SLICES = BK / 16>
  __device__ static void mma_stage_n(const Stage& in, int a_slice, int b_col, float (&acc)[N / 2], bool accumulate) {
    const T* a_wg = in.a + a_slice * 64 * BK;
    // B_NK: one K-major box, n-row r at r * BK; otherwise N-major boxes of 64 columns
    const T* b0 = B_NK ? in.b + b_col * BK : in.b + (b_col / kBoxCols) * BK * kBoxCols;
#pragma unroll
    for (int kk = 0; kk < SLICES; ++kk) {
      const uint64_t da = A_KM ? wgmma::desc_sw128(a_wg + kk * 16 * kBoxCols, BK * kBoxCols * sizeof(T), 1024)
                               : wgmma::desc_sw128(a_wg + kk * 16, 16, 1024);
      const uint64_t db = B_NK ? wgmma::desc_sw128(b0 + kk * 16, 16, 1024)
                               : wgmma::desc_sw128(b0 + kk * 16 * kBoxCols, BK * kBoxCols * sizeof(T), 1024);
      wgmma::mma<T, N, A_KM ? 1 : 0, B_NK ? 0 : 1>(acc, da, db, (accumulate || kk != 0) ? 1u : 0u);
    }
  }

  // One stage's MMAs as one committed group.
  template <int N, int SLICES>
  __device__ __forceinline__ static void issue_stage(const Stage& in, int a_slice, int b_col, float (&acc)[N / 2],
                                                     bool accumulate) {
    wgmma::fence();
    mma_stage_n<N, SLICES>(in, a_slice, b_col, acc, accumulate);
    wgmma::commit();
  }

  // Base::mma_blocks at wgmma width N (the same ring protocol); after_first() runs once the first k-block's
  // MMAs are issued (variant pipe: the previous task's epilogue, under them).
  // a_slice (default: the warpgroup's own) and b_col pick the operands' part (mma_stage_n); the last k-block runs
  // its first last_slices 16-row slices.
  template <int N, class Prepare, class AfterFirst>
  __device__ static void mma_blocks_n(Shared& s, ConsumerState& st, int n, float (&acc)[N / 2], Prepare&& prepare,
                                      AfterFirst&& after_first, int a_slice = -1, int b_col = 0,
                                      int last_slices = BK / 16) {
    if (a_slice < 0) a_slice = st.warpgroup;
    const int lane = threadIdx.x % 32;
    int prev = -1;
    for (int kb = 0; kb < n; ++kb) {
      st.pos.wait_full(s.ring);
      Stage& in = s.stage[st.pos.stage];
      prepare(in, kb);
      // A shorter last k-block takes a path of its own, fence to commit: a data-dependent exit between wgmmas
      // makes ptxas serialize every wgmma of the kernel (C7520, "WG.AR in divergent path").
      const int slices = kb == n - 1 ? last_slices : BK / 16;
      static_assert(BK / 16 == 4, "the slice counts below");
      if (slices == 1) issue_stage<N, 1>(in, a_slice, b_col, acc, kb != 0);
      else if (slices == 2) issue_stage<N, 2>(in, a_slice, b_col, acc, kb != 0);
      else if (slices == 3) issue_stage<N, 3>(in, a_slice, b_col, acc, kb != 0);
      else issue_stage<N, 4>(in, a_slice, b_col, acc, kb != 0);
      if (kb == 0) after_first();
      wgmma::wait<1>();  // the previous k-block's MMAs are done: hand its stage back
      if (prev >= 0 && lane == 0) release(s, prev);
      prev = st.pos.stage;
      st.pos.advance();
    }
    wgmma::wait<0>();
    wgmma::fence_operands(acc);
    if (prev >= 0 && lane == 0) release(s, prev);
  }

  // Variant `narrow`: whether the task's valid columns fit in the first BN/2.
  __device__ static bool narrow_task(const Globals& g, const Task& task) {
    if constexpr (BN < 128) return false;
    else return g.narrow_tail && g.n - task.col0 <= BN / 2;
  }

  // Weight grad: the 16-row k-slices of the task's last k-block its MMAs read (variant kslice: those holding the
  // group's rows; else all BK / 16, rows past the group zeroed).
  __device__ static int last_slices(const Globals& g, const Task& task) {
    if (!kWeightGradMode || !g.k_slices || task.k_last >= BK) return BK / 16;
    return (task.k_last + 15) / 16;
  }

  // Weight grad, before the last k-block's MMAs: zero the rows past the group that they read.
  __device__ static void mask_last(Stage& in, const ConsumerState& st, const Task& task, int slices, int kb) {
    if (kb == task.k_blocks - 1 && task.k_last < 16 * slices) mask_stage(in, st.warpgroup, task.k_last, 16 * slices);
  }

  // The warpgroup's 64 x BN accumulator of a task (zeros without k-blocks). narrow: only the first BN/2
  // columns are computed (m64n(BN/2) wgmmas); the rest are zeros (past n: never stored).
  __device__ static void mma_task(Shared& s, ConsumerState& st, const Task& task, float (&acc)[BN / 2], bool narrow,
                                  bool split = false, int slices = BK / 16) {
    if (task.k_blocks == 0) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
      return;
    }
    auto prepare = [&](Stage& in, int kb) {
      if constexpr (kWeightGradMode) mask_last(in, st, task, slices, kb);
    };
    if constexpr (BN >= 128) {
      if (split) {  // the first slice's rows, this warpgroup's half of the columns
        mma_blocks_n<BN / 2>(s, st, task.k_blocks, *reinterpret_cast<float(*)[BN / 4]>(&acc[0]), prepare, [] {}, 0,
                             st.warpgroup * (BN / 2));
        return;  // (acc[BN / 4..] unused: output() stores BN / 2 columns)
      }
      if (narrow) {
        mma_blocks_n<BN / 2>(s, st, task.k_blocks, *reinterpret_cast<float(*)[BN / 4]>(&acc[0]), prepare, [] {});
#pragma unroll
        for (int i = BN / 4; i < BN / 2; ++i) acc[i] = 0.f;
        return;
      }
    }
    if constexpr (PAIR) mma_blocks_n<BN>(s, st, task.k_blocks, acc, prepare, [] {});  // releases to both CTAs
    else if constexpr (kWeightGradMode) mma_blocks_n<BN>(s, st, task.k_blocks, acc, prepare, [] {}, -1, 0, slices);
    else Base::mma_blocks(s, st, task.k_blocks, acc, prepare);
  }

  // A warpgroup whose slice stores nothing only walks the ring (hands each stage back unread).
  __device__ static void skip_task(Shared& s, ConsumerState& st, const Task& task) {
    for (int kb = 0; kb < task.k_blocks; ++kb) {
      st.pos.wait_full(s.ring);
      if (threadIdx.x % 32 == 0) release(s, st.pos.stage);
      st.pos.advance();
    }
  }

  // A partial slice: the warpgroup copies its first `rows` rows (columns < n) from the slot to out.
  __device__ static void copy_rows(const Globals& g, const T* slot, const Slice& sl, int w) {
    asm volatile("bar.sync %0, 128;" ::"r"(2 + w) : "memory");  // the warpgroup's stmatrix writes are in
    const int chunks = sl.width / 8;                            // 16-byte chunks of a slot row
    const int cols = g.n - sl.col0 < sl.width ? g.n - sl.col0 : sl.width;  // a multiple of 8 (n is); may be <= 0
    const unsigned char* src = reinterpret_cast<const unsigned char*>(slot);
    T* out = static_cast<T*>(g.out);
    for (int i = threadIdx.x % 128; i < sl.rows * chunks; i += 128) {
      const int r = i / chunks, c = (i % chunks) * 8;
      if (c < cols) {
        const uint4 v = *reinterpret_cast<const uint4*>(src + swizzled_tile_offset<T>(r, c, 64));
        *reinterpret_cast<uint4*>(out + size_t(sl.row0 + r) * size_t(g.n) + sl.col0 + c) = v;
      }
    }
  }

  // The warpgroup's slice of a task's output: into its slot for the storer's TMA, or copied row by row.
  __device__ __forceinline__ static void output(const Globals& g, Shared& s, ConsumerState& st, const Task& task,
                                                const float (&acc)[BN / 2]) {
    const int w = st.warpgroup;
    const Slice sl = slice_of(g, task, w);
    Handoff& slot = s.c_slot[w];
    tma::mbar_wait(&slot.empty, st.c_phase ^ 1);
    if (sl.rows > 0) {
      if constexpr (BN >= 128) {
        if (sl.width < BN) store_acc<T, BN / 2, SlotLayout>(s.c[w], *reinterpret_cast<const float(*)[BN / 4]>(&acc[0]));
        else store_acc<T, BN, SlotLayout>(s.c[w], acc);
      } else {
        store_acc<T, BN, SlotLayout>(s.c[w], acc);
      }
      if (tma_stored(g, task, w)) tma::fence_proxy_async_shared();  // the storer's TMA reads the slot
      else copy_rows(g, s.c[w], sl, w);
    }
    tma::mbar_arrive(&slot.full);
    st.c_phase ^= 1;
  }

  __device__ static void consumer(const Globals& g, Shared& s, ConsumerState& st, int t) {
    const Task task = task_of(g, s.ext.table, t);
    if (!task.valid) return;
    float acc[BN / 2];
    if constexpr (PIPE) {  // weight grad: the previous task's output goes out under this task's first MMAs
      auto flush = [&] {
        if (st.has_prev) output(g, s, st, st.prev_task, st.prev);
        st.has_prev = false;
      };
      if (task.k_blocks == 0) {  // an empty group: zeros (straight into prev: acc is only ever a wgmma's)
        flush();
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) st.prev[i] = 0.f;
      } else {
        const int slices = last_slices(g, task);
        mma_blocks_n<BN>(s, st, task.k_blocks, acc, [&](Stage& in, int kb) { mask_last(in, st, task, slices, kb); },
                         flush, -1, 0, slices);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) st.prev[i] = acc[i];
      }
      st.prev_task = task;
      st.has_prev = true;
    } else {
      // A slice past its group's end skips the MMAs (weight grad: every warpgroup joins mask_stage's sync), unless
      // the task is split over both warpgroups.
      const bool split = split_task(g, task);
      if (!kWeightGradMode && !split && slice_rows(task, st.warpgroup) == 0) skip_task(s, st, task);
      else mma_task(s, st, task, acc, narrow_task(g, task), split, last_slices(g, task));
      output(g, s, st, task, acc);
    }
  }

  // Variant pipe: the last task's output (lcsc.cuh calls this after every consumer's last task).
  __device__ static void consumer_finish(const Globals& g, Shared& s, ConsumerState& st) {
    if constexpr (PIPE) {
      if (st.has_prev) output(g, s, st, st.prev_task, st.prev);
      st.has_prev = false;
    }
  }

  __device__ static void storer(const Globals& g, Shared& s, StorerState& st, int t) {
    const Task task = task_of(g, s.ext.table, t);
    if (!task.valid) return;
    for (int w = 0; w < WGS; ++w) {
      tma::mbar_wait(&s.c_slot[w].full, st.c_phase);
      if (!tma_stored(g, task, w)) continue;
      const T* slot = s.c[w];
      const Slice sl = slice_of(g, task, w);
#pragma unroll
      for (int j = 0; j < BN / kOutBoxCols; ++j) {
        if (j * kOutBoxCols >= sl.width) break;
        const int col = sl.col0 + j * kOutBoxCols;
        if constexpr (kWeightGradMode) tma::store_tile_3d(&g.c, col, sl.row0, task.group, slot + j * 64 * kOutBoxCols);
        else tma::store_tile_2d(&g.c, col, sl.row0, slot + j * 64 * kOutBoxCols);
      }
      tma::commit_group();
    }
    tma::wait_group_read<0>();  // slots may be rewritten once TMA has read them
    for (int w = 0; w < WGS; ++w) tma::mbar_arrive(&s.c_slot[w].empty);
    st.c_phase ^= 1;
    store_zero_tiles(g, s, st, st.zeros_done + kZeroTilesPerTask);  // under the next task's MMAs
  }

  __device__ static void storer_finish(const Globals& g, Shared& s, StorerState& st) {
    store_zero_tiles(g, s, st, INT_MAX);
    tma::wait_group<0>();
    if constexpr (DYN) finish_counter_pair(ExtT::task_counter(g));
  }
};

}  // namespace pk::grouped
