// DispatchMatmul: the MoE dispatch and the first grouped GEMM (gate and up projections) in one LCSC kernel
// (issue 27 item 3; docs/design.md, "Dispatch + grouped GEMM").
//   comm CTAs (the first num_comm_sms): the dispatch's count exchange (kernels/moe_dispatch.cu's protocol:
//     counts into every peer's moe_counts before ready, offsets by prefix over sources in rank order), then
//     every kept row of x pushed to its expert's member, local expert by local expert, in chunks of
//     kChunkRows rows (moe_arrivals.cuh); after each chunk the rows that landed are added to the receiver's
//     arrival count chunk_count[source][local expert] (release). Then send_row and the receive buffer's
//     zero tail, and (kTaskCounter) they join the GEMM.
//   compute CTAs: the grouped GEMM's forward tiles (grouped_gemm_kernel.cuh) over the received rows, n tiles
//     of gate then of up, claimed from a device-wide counter; before a tile's first load the loader waits
//     (acquire, bounded) until every source's rows of the tile's expert have landed.
// Deadlock freedom: one CTA per SM and grid <= SM count (all resident); comm CTAs wait only for the peers'
// ready (published by their comm CTA 0), never for a GEMM; GEMM waits are bounded (record_error, then every
// later wait fails fast).
#pragma once
#include "grouped_gemm_kernel.cuh"
#include "moe_arrivals.cuh"
#include "moe_dispatch.cuh"
#include "moe_layout.cuh"
#include "moe_rows.cuh"
#include "pk/chunk_counts.cuh"
#include "pk/item_flags.cuh"
#include "pk/op_protocol.cuh"

namespace pk::moe {

constexpr int kVec = 16;         // rows move in 16-byte vectors (the handler requires H * 2 % 16 == 0)
constexpr int kCountsItem = 0;   // item_ready slot comm CTA 0 signals to its own member: counts written

struct Globals {
  grouped::Globals half[2];  // gate (0) and up (1): a = recv (R, H), b = w (L, H, F), c / out = (R, F)
  Group group;
  MoeDims d;                 // T, K, E, R, row_vecs (16-byte vectors per row of x / recv)
  const char* x;
  const int32_t* key;        // (T * K,) global expert, anything outside [0, E) dropped
  const int32_t* pos;        // (T * K,) position among this member's kept rows of the expert
  const int32_t* order;      // (T * K,) assignments sorted by (key, pos): expert e's are order[own_start[e] ..]
  char* recv;                // (R, H) published: the peers push into it
  int32_t* recv_counts;      // (G, L) rows of each local expert from each source
  int32_t* totals;           // (L,) rows of each local expert from all sources (the GEMM's group sizes)
  int32_t* send_row;         // (T * K,) dest * R + row, -1 if dropped
  int tiles_n;               // n tiles of gate and up together (2 * half[h].tiles_n)
  int group_m;               // raster band (TileGrid)
  int max_tasks;             // static bound: (row tiles + L + 1) * tiles_n
  int num_comm_sms;
};

struct CommShared {
  int32_t own[kMoeMaxExperts];              // this member's kept rows per global expert
  int32_t own_start[kMoeMaxExperts + 1];    // their first index in `order` (exclusive prefix of own)
  int32_t base[kMoeMaxExperts];             // row at e's member of this member's first row of e
  int32_t chunk_start[kMoeMaxExperts + 1];  // first chunk of comm item j = l * G + i (totals before that)
  int32_t warp_sums[32];
  int64_t arrived;                          // rows this member receives (before the R bound)
};

// Exclusive prefix sum of v(0 .. n-1) into out[0 .. n] (out[n]: the total), every thread of the CTA;
// thread t sums a contiguous run, then the runs' sums are scanned by warp shuffles.
template <class V>
__device__ void block_exclusive_scan(V v, int n, int32_t* out, int32_t* warp_sums) {
  const int t = threadIdx.x, per = (n + blockDim.x - 1) / blockDim.x, lane = t % 32, warp = t / 32;
  const int lo = t * per < n ? t * per : n, hi = lo + per < n ? lo + per : n;
  int32_t run = 0;
  for (int i = lo; i < hi; ++i) run += v(i);
  int32_t incl = run;
  for (int off = 1; off < 32; off <<= 1) {
    const int32_t up = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += up;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (t == 0)
    for (int w = 1; w < int(blockDim.x / 32); ++w) warp_sums[w] += warp_sums[w - 1];
  __syncthreads();
  int32_t before = incl - run + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int i = lo; i < hi; ++i) {
    out[i] = before;
    before += v(i);
  }
  if (t == blockDim.x - 1) out[n] = before;
  __syncthreads();
}

// Adds `rows` to member dst's arrival count of (this member, local expert l). Every thread of the CTA
// fenced its own stores (system scope) before the CTA barrier that precedes this.
__device__ __forceinline__ void signal_rows(const Group& g, int dst, int l, uint32_t rows) {
  uint32_t* count = &g.ctrl[dst]->chunk_count[g.my_slot()][l];
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(count), "r"(rows) : "memory");
}

// The comm CTAs' part: the dispatch with per-(source, expert) arrival counts.
struct Dispatcher {
  const Globals& g;
  CommShared& s;
  lcsc::CommRole role;

  __device__ int experts() const { return g.d.experts; }
  __device__ int local() const { return g.d.experts / g.group.size; }

  // (1) This member's kept rows per global expert (every comm CTA: no grid-wide dependency before publish).
  __device__ void count_own() {
    const int E = experts();
    const int64_t n = g.d.tokens * g.d.top_k;
    for (int e = threadIdx.x; e < E; e += blockDim.x) s.own[e] = 0;
    __syncthreads();
    for (int64_t a = threadIdx.x; a < n; a += blockDim.x) {
      const int32_t k = g.key[a];
      if (k >= 0 && k < E) atomicAdd(&s.own[k], 1);
    }
    __syncthreads();
    block_exclusive_scan([&](int e) { return s.own[e]; }, E, s.own_start, s.warp_sums);
    if (role.index == 0) {  // into every peer's block, read there after our ready (release in publish)
      for (int i = threadIdx.x; i < g.group.size * E; i += blockDim.x) {
        const int r = i / E, e = i % E;
        if (r != g.group.rank) g.group.ctrl[r]->moe_counts[g.group.my_slot()][e] = s.own[e];
      }
      __threadfence_system();
      __syncthreads();
    }
  }

  // (2) After acquiring every peer's ready: offsets (as moe_dispatch_kernel), and CTA 0 writes recv_counts and
  // totals and tells its own compute CTAs (item kCountsItem to itself).
  __device__ void offsets(const OpProtocol& op) {
    const Group& grp = g.group;
    const int E = experts(), L = local();
    int32_t* total = s.chunk_start;  // scratch until the chunk prefix
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      int32_t before = 0, all = 0;
      for (int src = 0; src < grp.size; ++src) {
        const volatile int32_t* theirs = &grp.self()->moe_counts[grp.slot[src]][e];  // written before their ready
        const int32_t c = src == grp.rank ? s.own[e] : *theirs;
        if (src < grp.rank) before += c;
        all += c;
        if (role.index == 0 && e / L == grp.rank) g.recv_counts[src * L + e % L] = c;
      }
      s.base[e] = before;
      total[e] = all;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      int32_t start = 0;
      for (int j = (e / L) * L; j < e; ++j) start += total[j];
      s.base[e] += start;
      if (role.index == 0 && e / L == grp.rank) g.totals[e % L] = total[e];
    }
    if (threadIdx.x == 0) {
      int64_t sum = 0;
      for (int l = 0; l < L; ++l) sum += total[grp.rank * L + l];
      s.arrived = sum;
    }
    if (role.index == 0) __threadfence();
    __syncthreads();
    if (role.index == 0 && threadIdx.x == 0) signal_item(grp, grp.rank, kCountsItem, op.epoch[grp.rank]);
    // Chunks of comm item j = l * G + i: this member's rows of expert (comm_dest(i), l).
    const auto item_chunks = [&](int j) {
      return chunks_of(s.own[comm_dest(grp.rank, grp.size, j % grp.size) * L + j / grp.size]);
    };
    block_exclusive_scan(item_chunks, E, s.chunk_start, s.warp_sums);
  }

  // (3) Rows, chunk by chunk (CTA role.index takes chunks index, index + count, ...: all comm CTAs move through
  // the local experts together), each chunk's landed rows counted at its destination.
  __device__ void push_rows(const pgl<char>& recv) {
    const Group& grp = g.group;
    const int E = experts(), L = local(), G = grp.size;
    const int64_t segs = moe_segments(g.d.row_vecs), R = g.d.recv_rows;
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32, lane = threadIdx.x % 32;
    const int32_t chunks = s.chunk_start[E];
    for (int32_t q = role.index; q < chunks; q += role.count) {
      int lo = 0, hi = E - 1;  // the item holding chunk q: the last j with chunk_start[j] <= q
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (s.chunk_start[mid] <= q) lo = mid;
        else hi = mid - 1;
      }
      const int l = lo / G, dest = comm_dest(grp.rank, G, lo % G), e = dest * L + l;
      const int32_t p0 = (q - s.chunk_start[lo]) * kChunkRows;
      const int32_t rows = s.own[e] - p0 < kChunkRows ? s.own[e] - p0 : kChunkRows;
      const int64_t first = int64_t(s.base[e]) + p0;
      const int32_t landed = landed_rows(first, rows, R);  // rows past R drop (they are the chunk's last)
      if (landed == 0) continue;  // uniform over the CTA
      const int32_t* assignments = g.order + s.own_start[e] + p0;
      for (int64_t it = warp; it < int64_t(landed) * segs; it += warps) {
        const int64_t p = it / segs, seg = it % segs;
        const int64_t a = assignments[p];
        copy_segment<kVec>(g.x, (a / g.d.top_k) * g.d.row_vecs + seg * kSegVecs, recv[dest],
                           (first + p) * g.d.row_vecs + seg * kSegVecs, g.d.row_vecs - seg * kSegVecs, lane);
      }
      __threadfence_system();  // each thread's row stores, before the CTA's count (release) below
      __syncthreads();
      if (threadIdx.x == 0) signal_rows(grp, dest, l, uint32_t(landed));
    }
  }

  // (4) The layout for combine and the backward (send_row), and the own receive buffer's zero tail.
  __device__ void layout() {
    const Group& grp = g.group;
    const MoeRoute route{g.key, g.pos, s.base, experts(), local(), g.d.top_k, grp.rank, g.d.recv_rows};
    const int64_t n = g.d.tokens * g.d.top_k, R = g.d.recv_rows;
    const int64_t me = int64_t(role.index) * blockDim.x + threadIdx.x, stride = int64_t(role.count) * blockDim.x;
    for (int64_t a = me; a < n; a += stride) {
      const int64_t row = route.row(a);
      g.send_row[a] = row >= 0 ? int32_t(route.dest(a) * R + row) : -1;
    }
    const int64_t from = s.arrived < R ? s.arrived : R;
    zero_vecs<kVec>(g.recv, from * g.d.row_vecs, R * g.d.row_vecs, me, stride);
  }

  __device__ void run() {
    OpProtocol op(g.group);
    count_own();
    void* const local_bufs[1] = {g.recv};
    op.publish(local_bufs, 1);
    pgl<char> bufs[1];
    if (!op.acquire(local_bufs, bufs)) return;  // recorded; the compute CTAs' waits fail fast (aborted)
    offsets(op);
    push_rows(bufs[0]);
    layout();
  }
};

template <typename T, int BN_, int STAGES_>
struct Kernel {
  using GK = grouped::Kernel<T, 2, BN_, STAGES_, grouped::kForward>;  // its tiles, MMAs and epilogue
  using Globals = moe::Globals;
  using CommShared = moe::CommShared;
  using Shared = typename GK::Shared;
  using Stage = typename GK::Stage;
  using ConsumerState = typename GK::ConsumerState;
  using StorerState = typename GK::StorerState;
  struct LoaderState {
    RingPos<STAGES_> pos;
    int ready_group = -1;  // the last expert whose arrivals this loader saw complete
  };
  static constexpr int WGS = 2, BN = BN_, STAGES = STAGES_, BM = GK::BM, BK = GK::BK;
  static constexpr int kConsumerWarpgroups = WGS;
  static constexpr int kProducerRegs = GK::kProducerRegs, kConsumerRegs = GK::kConsumerRegs;
  static constexpr bool kHasCommunicator = true;
  static constexpr bool kTaskCounter = true;  // comm CTAs take GEMM tiles once their rows are out
  static constexpr bool kHasPusher = false;
  static constexpr int kBoxCols = GK::kBoxCols, kOutBoxCols = GK::kOutBoxCols;

  __host__ __device__ static int num_tasks(const Globals& g) { return g.max_tasks; }
  __device__ static uint32_t* task_counter(const Globals& g) { return &g.group.self()->next_task; }

  // Task t: (row tile of an expert, n tile of gate then up) in the grouped GEMM's raster; `half` 0 gate, 1 up.
  __device__ static grouped::Task task_of(const Globals& g, const GroupTable& tb, int t, int& half) {
    grouped::Task r{};
    half = 0;
    const int groups = g.half[0].num_groups, per_half = g.half[0].tiles_n;
    const int tiles = tb.tile_start[groups + 1];
    if (t >= tiles * g.tiles_n) return r;  // valid = false
    const int2 tile = TileGrid{tiles, g.tiles_n, g.group_m}.tile(t);
    const int e = tb.group_of_tile(tile.x, groups);
    half = tile.y / per_half;
    r.valid = true;
    r.group = e;
    r.row0 = tb.start[e] + (tile.x - tb.tile_start[e]) * BM;
    r.row_end = tb.start[e + 1];
    r.col0 = (tile.y % per_half) * BN;
    r.k0 = 0;
    r.k_blocks = e == groups ? 0 : (g.half[0].k + BK - 1) / BK;  // the tail's tiles are zeros
    r.k_last = BK;
    return r;
  }

  // Loader thread: until every source's rows of local expert l that land below R have arrived (bounded).
  __device__ static void wait_expert(const Globals& g, const GroupTable& tb, int l) {
    const Group& grp = g.group;
    const int L = g.half[0].num_groups;
    int64_t first = tb.start[l];  // clipped at R, as the rows it counts
    for (int src = 0; src < grp.size; ++src) {
      const int32_t count = g.recv_counts[src * L + l];
      const uint32_t need = uint32_t(landed_rows(first, count, g.d.recv_rows));
      first += count;
      if (need > 0) wait_chunk(grp, src, l, need);  // acquire, then ordered before the TMA loads
    }
  }

  __device__ static void init(const Globals& g, Shared& s) {
    s.ring.init(1, 4 * WGS);
    for (int w = 0; w < WGS; ++w) s.c_slot[w].init(128, 1);
    tma::prefetch_tensor_map(&g.half[0].a);
    for (int h = 0; h < 2; ++h) {
      tma::prefetch_tensor_map(&g.half[h].b);
      tma::prefetch_tensor_map(&g.half[h].c);
    }
  }

  // Every compute thread: the group table once comm CTA 0 has written the totals (acquire, bounded).
  __device__ static void begin(const Globals& g, Shared& s) {
    if (threadIdx.x == 0) wait_item(g.group, g.group.rank, kCountsItem, op_epoch(g.group, g.group.rank));
    __syncthreads();
    s.ext.table.build(g.totals, g.half[0].num_groups, g.half[0].tokens, BM, false);
  }

  __device__ static void loader(const Globals& g, Shared& s, LoaderState& st, int t) {
    int h;
    const grouped::Task task = task_of(g, s.ext.table, t, h);
    if (!task.valid) return;
    if (task.k_blocks > 0 && task.group != st.ready_group) {
      wait_expert(g, s.ext.table, task.group);
      st.ready_group = task.group;
    }
    for (int kb = 0; kb < task.k_blocks; ++kb) {
      st.pos.wait_empty(s.ring);
      Stage& dst = s.stage[st.pos.stage];
      uint64_t* full = &s.ring.full[st.pos.stage];
      tma::mbar_expect_tx(full, GK::kStageBytes);
      const int krow = kb * BK;
      tma::load_tile_2d(dst.a, &g.half[0].a, krow, task.row0, full);
#pragma unroll
      for (int j = 0; j < BN / kBoxCols; ++j)
        tma::load_tile_3d(dst.b + j * BK * kBoxCols, &g.half[h].b, task.col0 + j * kBoxCols, krow, task.group, full);
      st.pos.advance();
    }
  }

  __device__ static void consumer(const Globals& g, Shared& s, ConsumerState& st, int t) {
    int h;
    const grouped::Task task = task_of(g, s.ext.table, t, h);
    if (!task.valid) return;
    float acc[BN / 2];
    if (GK::slice_rows(task, st.warpgroup) == 0) GK::skip_task(s, st, task);
    else GK::mma_task(s, st, task, acc, false);
    GK::output(g.half[h], s, st, task, acc);
  }

  __device__ static void storer(const Globals& g, Shared& s, StorerState& st, int t) {
    int h;
    const grouped::Task task = task_of(g, s.ext.table, t, h);
    if (!task.valid) return;
    const grouped::Globals& gh = g.half[h];
    for (int w = 0; w < WGS; ++w) {
      tma::mbar_wait(&s.c_slot[w].full, st.c_phase);
      if (!GK::tma_stored(gh, task, w)) continue;
#pragma unroll
      for (int j = 0; j < BN / kOutBoxCols; ++j)
        tma::store_tile_2d(&gh.c, task.col0 + j * kOutBoxCols, task.row0 + w * 64, s.c[w] + j * 64 * kOutBoxCols);
      tma::commit_group();
    }
    tma::wait_group_read<0>();
    for (int w = 0; w < WGS; ++w) tma::mbar_arrive(&s.c_slot[w].empty);
    st.c_phase ^= 1;
  }

  __device__ static void storer_finish(const Globals&, Shared&, StorerState&) {
    tma::wait_group<0>();
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }

  __device__ static void pusher(const Globals&, Shared&) {}

  __device__ static void communicator(const Globals& g, CommShared& s, lcsc::CommRole role) {
    Dispatcher{g, s, role}.run();
  }

  // Every CTA: the op's completion protocol; the last one clears the arrival counts (no peer adds any more).
  __device__ static void finish(const Globals& g) {
    if (OpProtocol(g.group).finish()) reset_chunks(g.group, g.half[0].num_groups);
  }
};

}  // namespace pk::moe
