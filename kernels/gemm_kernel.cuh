// C = A @ B on the LCSC template: A (M x K) and B (K x N) row-major (as JAX stores them), T = bf16
// or f16 in, fp32 accumulation, OutT out. A block computes a (64 * WGS) x BN tile; each consumer
// warpgroup owns 64 rows of it (wgmma m64nBNk16, B read N-major straight from the TMA tile).
// Transposed operands are read in place (the backward pass's layouts, no transposes in HBM):
//   A_KM: A stored K x M (Aᵀ row-major): M-major smem boxes of 64 k-rows x 64 m, wgmma's transpose-A bit.
//   B_NK: B stored N x K (Bᵀ row-major): one K-major box of BN n-rows x 64 k, no transpose-B bit.
// The fused multi-GPU kernels reuse this struct's loader/consumer and add communication in the
// storer or communicator.
#pragma once
#include <cuda.h>

#include "pk/acc_store.cuh"
#include "pk/lcsc.cuh"
#include "pk/pipeline.cuh"
#include "pk/swizzle.cuh"
#include "pk/tile_scheduler.cuh"
#include "pk/tma.cuh"
#include "pk/wgmma.cuh"

namespace pk::gemm {

struct Globals {
  CUtensorMap a, b, c;  // boxes: A (BM x 64; A_KM: 64 x 64), B (64 x 64; B_NK: BN x 64), C (64 x 128 bytes)
  int m, n, k;
  TileGrid grid;
  int num_comm_sms;
};

// What a fused kernel adds to the GEMM (kernels/tp_gemm_kernel.cuh); the plain GEMM adds nothing.
//   tile(g, task)          which output tile a task is (the fused ops order tiles for their traffic)
//   a_source(g, tile)      the tensor map and first row the tile's A rows are loaded from
//   before_load(g, tile)   loader thread, before the tile's first TMA load (e.g. wait for its rows)
//   after_store(g, ext, tile)  storer thread, after the tile's TMA stores were issued (e.g. signal)
//   storer_done(g, ext)    storer thread, once every store of its tasks has completed
//   begin(g, ext)          every thread of a compute CTA, before the roles start (e.g. learn peer addresses)
//   pusher(g, ext)         one more producer thread, beside the roles (with kHasPusher)
//   store_slot<K>(...)     storer thread: issue the stores of one consumer's output slot
//   SlotLayout             how consumers lay out an output slot (TMA tensor boxes by default)
//   communicator / finish  the comm SMs' work, and the end-of-kernel protocol of every CTA
struct NoComm {
  using Globals = gemm::Globals;
  struct CommShared {};
  struct SharedExt {};
  template <typename OutT, int BN>
  using SlotLayout = SwizzledBoxes<OutT>;
  // (The defaults take any SharedExt, so an extension may replace the struct and keep the hooks.)
  template <class E>
  __device__ static void begin(const Globals&, E&) {}
  // Output boxes of warpgroup w's slot to the tensor map C (clipped at the matrix edge by TMA).
  template <class K, class E>
  __device__ static void store_slot(const Globals& g, E&, const typename K::Out* slot, int2 tile,
                                    int w) {
#pragma unroll
    for (int j = 0; j < K::BN / K::kOutBoxCols; ++j)
      tma::store_tile_2d(&g.c, tile.y * K::BN + j * K::kOutBoxCols, tile.x * K::BM + w * 64,
                         slot + j * 64 * K::kOutBoxCols);
  }
  static constexpr bool kHasCommunicator = false;
  static constexpr bool kTaskCounter = false;  // true: tasks claimed at run time (pk/task_queue.cuh)
  static constexpr bool kHasPusher = false;    // true: pusher(g, ext) runs beside the roles (lcsc.cuh)
  template <class E>
  __device__ static void pusher(const Globals&, E&) {}
  __device__ static uint32_t* task_counter(const Globals&) { return nullptr; }
  __device__ static int2 tile(const Globals& g, int task) { return g.grid.tile(task); }
  __device__ static const CUtensorMap* a_source(const Globals& g, int2 tile, int bm, int& row) {
    row = tile.x * bm;
    return &g.a;
  }
  __device__ static void before_load(const Globals&, int2) {}
  template <class E>
  __device__ static void after_store(const Globals&, E&, int2) {}
  template <class E>
  __device__ static void storer_done(const Globals&, E&) {}
  __device__ static void communicator(const Globals&, CommShared&, lcsc::CommRole) {}
  __device__ static void finish(const Globals&) {}
};

template <typename T, typename OutT, int WGS_, int BN_, int STAGES_, class Ext = NoComm, bool A_KM = false,
          bool B_NK = false>
struct Kernel {
  using Globals = typename Ext::Globals;
  using CommShared = typename Ext::CommShared;
  using Out = OutT;
  using SlotLayout = typename Ext::template SlotLayout<OutT, BN_>;
  static constexpr int WGS = WGS_, BN = BN_, STAGES = STAGES_;
  static constexpr int BM = 64 * WGS, BK = 64;
  static constexpr int kConsumerWarpgroups = WGS;
  // 64K registers per SM: consumers hold BN/2 fp32 accumulators per thread.
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr bool kHasCommunicator = Ext::kHasCommunicator;
  static constexpr bool kTaskCounter = Ext::kTaskCounter;
  static constexpr bool kHasPusher = Ext::kHasPusher;
  static constexpr int kBoxCols = 128 / int(sizeof(T));       // 64 elements per 128-byte TMA box row
  static constexpr int kOutBoxCols = 128 / int(sizeof(OutT));  // output boxes: 64 rows x 128 bytes
  static constexpr uint32_t kStageBytes = uint32_t(BM * BK + BK * BN) * sizeof(T);
  static_assert(BN % kBoxCols == 0 && BN % kOutBoxCols == 0, "tile width");

  // Both layouts of an operand fill the same bytes; warpgroup w's A rows start at a + w * 64 * BK either way.
  struct Stage {
    alignas(1024) T a[BM * BK];  // one box: BM rows x 64 k, K-major (A_KM: BM/64 boxes of 64 k x 64 m, M-major)
    alignas(1024) T b[BK * BN];  // BN/64 boxes of 64 k-rows x 64 n, N-major (B_NK: one box of BN n x 64 k, K-major)
  };
  struct Shared {
    Stage stage[STAGES];
    alignas(1024) OutT c[WGS][SlotLayout::slot_bytes(BN) / sizeof(OutT)];  // one output slot per consumer
    Ring<STAGES> ring;
    Handoff c_slot[WGS];
    typename Ext::SharedExt ext;
  };
  struct LoaderState {
    RingPos<STAGES> pos;
  };
  struct ConsumerState {
    int warpgroup;
    RingPos<STAGES> pos;
    uint32_t c_phase;
  };
  struct StorerState {
    uint32_t c_phase;
  };

  __host__ __device__ static int num_tasks(const Globals& g) { return g.grid.count(); }
  __device__ static int k_blocks(const Globals& g) { return (g.k + BK - 1) / BK; }

  __device__ static void init(const Globals& g, Shared& s) {
    s.ring.init(1, 4 * WGS);  // full: the loader's expect_tx arrival; empty: one per consumer warp
    for (int w = 0; w < WGS; ++w) s.c_slot[w].init(128, 1);
    tma::prefetch_tensor_map(&g.a);
    tma::prefetch_tensor_map(&g.b);
    tma::prefetch_tensor_map(&g.c);
  }

  __device__ static void loader(const Globals& g, Shared& s, LoaderState& st, int task) {
    const int2 tile = Ext::tile(g, task);
    int a_row;
    const CUtensorMap* a_map = Ext::a_source(g, tile, BM, a_row);
    Ext::before_load(g, tile);
    for (int kb = 0, n = k_blocks(g); kb < n; ++kb) {
      st.pos.wait_empty(s.ring);
      Stage& dst = s.stage[st.pos.stage];
      uint64_t* full = &s.ring.full[st.pos.stage];
      tma::mbar_expect_tx(full, kStageBytes);
      if constexpr (A_KM) {  // map over (K rows, M cols): the tile's m range is columns
#pragma unroll
        for (int j = 0; j < BM / kBoxCols; ++j)
          tma::load_tile_2d(dst.a + j * BK * kBoxCols, a_map, a_row + j * kBoxCols, kb * BK, full);
      } else {
        tma::load_tile_2d(dst.a, a_map, kb * BK, a_row, full);
      }
      if constexpr (B_NK) {  // map over (N rows, K cols), one BN-row box
        tma::load_tile_2d(dst.b, &g.b, kb * BK, tile.y * BN, full);
      } else {
#pragma unroll
        for (int j = 0; j < BN / kBoxCols; ++j)
          tma::load_tile_2d(dst.b + j * BK * kBoxCols, &g.b, tile.y * BN + j * kBoxCols, kb * BK, full);
      }
      st.pos.advance();
    }
  }

  // The MMAs of one k-block (issued, not committed): acc (+)= warpgroup's 64 rows of A x B of stage `in`;
  // accumulate = false overwrites acc (a tile's first k-block).
  __device__ static void mma_stage(const Stage& in, int warpgroup, float (&acc)[BN / 2], bool accumulate) {
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      // K-major: a k step of 16 is 32 bytes into each swizzled 128-byte row (SBO 1024: 8-row groups).
      // MN-major: 16 k-rows of 128 bytes (LBO: the next 64-wide MN box, SBO 1024: 8 k-rows).
      const T* a_wg = in.a + warpgroup * 64 * BK;
      const uint64_t da = A_KM ? wgmma::desc_sw128(a_wg + kk * 16 * kBoxCols, BK * kBoxCols * sizeof(T), 1024)
                               : wgmma::desc_sw128(a_wg + kk * 16, 16, 1024);
      const uint64_t db = B_NK ? wgmma::desc_sw128(in.b + kk * 16, 16, 1024)
                               : wgmma::desc_sw128(in.b + kk * 16 * kBoxCols, BK * kBoxCols * sizeof(T), 1024);
      wgmma::mma<T, BN, A_KM ? 1 : 0, B_NK ? 0 : 1>(acc, da, db, (accumulate || kk != 0) ? 1u : 0u);
    }
  }

  // The warpgroup's 64 x BN accumulator over `n` k-blocks streamed through the ring. prepare(stage, kb)
  // runs on a landed stage before its MMAs (the grouped GEMM masks its last k-block there).
  template <class Prepare>
  __device__ static void mma_blocks(Shared& s, ConsumerState& st, int n, float (&acc)[BN / 2], Prepare&& prepare) {
    const int lane = threadIdx.x % 32;
    int prev = -1;
    for (int kb = 0; kb < n; ++kb) {
      st.pos.wait_full(s.ring);
      Stage& in = s.stage[st.pos.stage];
      prepare(in, kb);
      wgmma::fence();
      mma_stage(in, st.warpgroup, acc, kb != 0);
      wgmma::commit();
      wgmma::wait<1>();  // the previous k-block's MMAs are done: hand its stage back
      if (prev >= 0 && lane == 0) tma::mbar_arrive(&s.ring.empty[prev]);
      prev = st.pos.stage;
      st.pos.advance();
    }
    wgmma::wait<0>();
    wgmma::fence_operands(acc);
    if (prev >= 0 && lane == 0) tma::mbar_arrive(&s.ring.empty[prev]);
  }

  // The warpgroup's 64 x BN accumulator for one tile.
  __device__ static void mma_tile(const Globals& g, Shared& s, ConsumerState& st, float (&acc)[BN / 2]) {
    mma_blocks(s, st, k_blocks(g), acc, [](Stage&, int) {});
  }

  // Accumulators -> this warpgroup's output slot (swizzled boxes the storer's TMA reads).
  __device__ static void stage_output(Shared& s, ConsumerState& st, const float (&acc)[BN / 2]) {
    Handoff& slot = s.c_slot[st.warpgroup];
    tma::mbar_wait(&slot.empty, st.c_phase ^ 1);
    store_acc<OutT, BN, SlotLayout>(s.c[st.warpgroup], acc);
    tma::fence_proxy_async_shared();  // the storer's TMA (async proxy) reads what we just wrote
    tma::mbar_arrive(&slot.full);
    st.c_phase ^= 1;
  }

  __device__ static void consumer(const Globals& g, Shared& s, ConsumerState& st, int task) {
    float acc[BN / 2];
    mma_tile(g, s, st, acc);
    stage_output(s, st, acc);
  }

  __device__ static void storer(const Globals& g, Shared& s, StorerState& st, int task) {
    const int2 tile = Ext::tile(g, task);
    for (int w = 0; w < WGS; ++w) {
      tma::mbar_wait(&s.c_slot[w].full, st.c_phase);
      Ext::template store_slot<Kernel>(g, s.ext, s.c[w], tile, w);
      tma::commit_group();
    }
    tma::wait_group_read<0>();  // slots may be rewritten once TMA has read them
    for (int w = 0; w < WGS; ++w) tma::mbar_arrive(&s.c_slot[w].empty);
    st.c_phase ^= 1;
    Ext::after_store(g, s.ext, tile);
  }

  // Every store complete, and ordered (async -> generic proxy) before the finish protocol's signals.
  __device__ static void storer_finish(const Globals& g, Shared& s, StorerState&) {
    tma::wait_group<0>();
    asm volatile("fence.proxy.async.global;" ::: "memory");
    Ext::storer_done(g, s.ext);
  }

  __device__ static void communicator(const Globals& g, CommShared& s, lcsc::CommRole role) {
    Ext::communicator(g, s, role);
  }
  __device__ static void begin(const Globals& g, Shared& s) { Ext::begin(g, s.ext); }
  __device__ static uint32_t* task_counter(const Globals& g) { return Ext::task_counter(g); }
  __device__ static void pusher(const Globals& g, Shared& s) { Ext::pusher(g, s.ext); }
  __device__ static void finish(const Globals& g) { Ext::finish(g); }
};

}  // namespace pk::gemm
