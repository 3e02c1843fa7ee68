// Fused tensor-parallel GEMMs (paper 3.1.3, 4.1): the GEMM of gemm_kernel.cuh plus the communication
// each op needs. Everything below the GEMM's own code is the communication, kept in one Ext struct
// per op (tile order, a wait before loads or a signal after stores, and the comm SMs' loop).
//
//   AllGatherMatmul      out = all_gather(x) @ w. Comm SMs push x's row chunks into every peer's
//                        `gathered` buffer (TMA bulk copies) and signal each chunk; the loader waits
//                        for a chunk's signal before loading its rows. Own rows are computed first,
//                        straight from x; the own copy into `gathered` goes last.
//   AllGatherMatmulIntraSM  the same without comm SMs: a pusher thread of every compute CTA sends
//                        pieces of the chunks while its SM computes; receivers count the pieces.
//   MatmulReduceScatter  out = psum_scatter(x @ w) (rows). Compute SMs write the partial product
//   MatmulAllReduce      locally and signal each tile to its owner (row block m/G); the owner's comm
//                        SMs sum the tile over all members in rank order (deterministic) and write it
//                        to their own output (RS) or to every member's output (AR). Tiles of the
//                        owners are interleaved so every member's comm SMs work from the start.
//   MatmulStoreAdd       the same two ops without comm SMs (intra-SM): the storer adds each tile of
//                        the product straight into its owner's output (RS) or into every member's (AR)
//                        with bulk store-add copies; a pusher thread per SM zeroes the member's output
//                        block by block and counts each block at every member, the adds into a block
//                        wait for its count; the finish protocol means every peer's adds have landed.
//                        AR over > 2 members relays: tiles are added into their owner's rows only, and
//                        the owner's pushers copy each summed row block to the others once every
//                        member's adds into it are counted. Not bit-reproducible (the order of the adds varies).
#pragma once
#include "gemm_kernel.cuh"
#include "pk/bulk_broadcast.cuh"
#include "pk/chunk_counts.cuh"
#include "pk/item_flags.cuh"
#include "pk/op_protocol.cuh"
#include "pk/vec.cuh"

namespace pk::tp {

struct Globals : gemm::Globals {
  CUtensorMap a_own;   // AG: this member's x (its rows of A need no copy to be computed)
  Group group;
  TileGrid per_rank;   // the tiles of one member's rows (AG: its x rows; RS/AR: the rows it owns)
  int rows_per_rank;   // AG: rows of x; RS/AR: m / G
  int bm, bn;          // the GEMM's block tile
  const char* x;       // AG: this member's x (rows_per_rank x k)
  char* aux;           // AG: gathered x (G rows_per_rank x k); RS/AR: the partial product (m x n)
  char* out;           // RS: (m / G x n); AR: (m x n)
  int elem_bytes;
  int relay;           // AR store-add: add into the owners' rows only, the owners relay (MatmulStoreAdd)
};

// Tasks visit member (rank + s) % G's tile block s (AG) or tile i of every owner in turn (RS/AR).
__device__ __forceinline__ int2 member_major_tile(const Globals& g, int task, int first_member) {
  const int per = g.per_rank.count(), s = task / per;
  const int2 t = g.per_rank.tile(task % per);
  return make_int2(((first_member + s) % g.group.size) * g.per_rank.tiles_m + t.x, t.y);
}
__device__ __forceinline__ int2 owner_interleaved_tile(const Globals& g, int task) {
  const int2 t = g.per_rank.tile(task / g.group.size);
  return make_int2((task % g.group.size) * g.per_rank.tiles_m + t.x, t.y);
}

// AG: own rows straight from x, the other members' rows from the gathered buffer.
__device__ __forceinline__ const CUtensorMap* gathered_a_source(const Globals& g, int2 tile, int bm, int& row) {
  const bool own = tile.x / g.per_rank.tiles_m == g.group.rank;
  row = (own ? tile.x % g.per_rank.tiles_m : tile.x) * bm;
  return own ? &g.a_own : &g.a;
}

struct AllGatherMatmul : gemm::NoComm {
  using Globals = tp::Globals;
  static constexpr bool kHasCommunicator = true;
  static constexpr bool kTaskCounter = true;  // comm SMs compute too once their pushes are done
  using CommShared = BulkRing<6, 32 * 1024>;
  __device__ static uint32_t* task_counter(const Globals& g) { return &g.group.self()->next_task; }

  __device__ static int2 tile(const Globals& g, int task) { return member_major_tile(g, task, g.group.rank); }

  __device__ static const CUtensorMap* a_source(const Globals& g, int2 tile, int bm, int& row) {
    return gathered_a_source(g, tile, bm, row);
  }

  __device__ static void before_load(const Globals& g, int2 tile) {
    const int src = tile.x / g.per_rank.tiles_m, chunk = tile.x % g.per_rank.tiles_m;
    if (src != g.group.rank) wait_item(g.group, src, chunk, op_epoch(g.group, src));
  }
  __device__ static void communicator(const Globals& g, CommShared& ring, lcsc::CommRole role) {
    OpProtocol op(g.group);
    void* const local[1] = {g.aux};
    op.publish(local, 1);
    pgl<char> gathered[1];
    const bool ok = op.acquire(local, gathered);
    if (threadIdx.x != 0 || !ok) return;
    ring.init();
    const Group& grp = g.group;
    const uint64_t chunk_bytes = uint64_t(g.bm) * g.k * g.elem_bytes;
    const uint64_t my_rows = uint64_t(grp.rank) * g.rows_per_rank * g.k * g.elem_bytes;
    // Peers first (their compute waits on these chunks), the own copy (only an output) last.
    for (int c = role.index; c < g.per_rank.tiles_m; c += role.count) {
      char* dst[kMaxGroup];
      for (int i = 1; i < grp.size; ++i) dst[i - 1] = gathered[0][(grp.rank + i) % grp.size] + my_rows + c * chunk_bytes;
      ring.broadcast(g.x + c * chunk_bytes, dst, grp.size - 1, chunk_bytes);
      for (int i = 1; i < grp.size; ++i) {
        const int r = (grp.rank + i) % grp.size;
        signal_item(grp, r, c, op.epoch[r]);
      }
    }
    for (int c = role.index; c < g.per_rank.tiles_m; c += role.count) {
      char* own = gathered[0][grp.rank] + my_rows + c * chunk_bytes;
      ring.broadcast(g.x + c * chunk_bytes, &own, 1, chunk_bytes);
    }
    ring.inval();  // this CTA computes next, over the same shared memory
  }

  __device__ static void finish(const Globals& g) { OpProtocol(g.group).finish(); }
};

// AG without comm SMs (intra-SM): a pusher thread in every compute CTA sends pieces of x's row chunks
// to every member's `gathered` buffer (own copy included) while its SM computes, and counts each piece
// at the receivers (chunk_counts.cuh); the loader waits for a chunk's full count before its rows.
// Pushers claim pieces in chunk order from a device-wide counter, so the first chunks complete first
// and every piece is sent by a CTA that is running (no CTA waits on one that has not started).
struct AllGatherMatmulIntraSM : gemm::NoComm {
  using Globals = tp::Globals;
  static constexpr bool kHasCommunicator = true;  // no comm SMs; this runs the finish protocol
  static constexpr bool kHasPusher = true;
  static constexpr uint32_t kPiece = 32 * 1024;  // bytes of x per piece (one count each)
  struct SharedExt {
    BulkRing<2, 8 * 1024> ring;  // what fits beside the GEMM's stages
  };

  __device__ static uint64_t chunk_bytes(const Globals& g) { return uint64_t(g.bm) * g.k * g.elem_bytes; }
  __device__ static uint32_t pieces(const Globals& g) { return uint32_t((chunk_bytes(g) + kPiece - 1) / kPiece); }

  __device__ static int2 tile(const Globals& g, int task) { return member_major_tile(g, task, g.group.rank); }
  __device__ static const CUtensorMap* a_source(const Globals& g, int2 tile, int bm, int& row) {
    return gathered_a_source(g, tile, bm, row);
  }
  __device__ static void before_load(const Globals& g, int2 tile) {
    const int src = tile.x / g.per_rank.tiles_m;
    if (src != g.group.rank) wait_chunk(g.group, src, tile.x % g.per_rank.tiles_m, pieces(g));
  }

  __device__ static void begin(const Globals& g, SharedExt&) {
    void* const local[1] = {g.aux};
    OpProtocol(g.group).publish(local, 1);  // CTA 0; every pusher acquires on its own
  }

  __device__ static void pusher(const Globals& g, SharedExt& ext) {
    const Group& grp = g.group;
    char* gathered[kMaxGroup];
    if (!OpProtocol(grp).acquire_thread(g.aux, gathered)) return;
    ext.ring.init();
    const uint64_t bytes = chunk_bytes(g), mine = uint64_t(grp.rank) * g.rows_per_rank * g.k * g.elem_bytes;
    const uint32_t per_chunk = pieces(g), total = per_chunk * g.per_rank.tiles_m;
    uint32_t* next = &grp.self()->next_piece;  // reset by the launch's last CTA (op_protocol.cuh finish)
    for (uint32_t q = atomicAdd(next, 1u); q < total; q = atomicAdd(next, 1u)) {
      const uint32_t c = q / per_chunk, p = q % per_chunk;
      const uint64_t at = c * bytes + uint64_t(p) * kPiece;
      char* dst[kMaxGroup];
      for (int i = 0; i < grp.size; ++i) dst[i] = gathered[(grp.rank + 1 + i) % grp.size] + mine + at;  // own last
      ext.ring.broadcast(g.x + at, dst, grp.size, min(uint64_t(kPiece), bytes - uint64_t(p) * kPiece));
      for (int i = 1; i < grp.size; ++i) signal_piece(grp, (grp.rank + i) % grp.size, c);
    }
    ext.ring.inval();
  }

  __device__ static void finish(const Globals& g) {
    if (OpProtocol(g.group).finish()) reset_chunks(g.group, g.per_rank.tiles_m);
  }
};

// RS and AR share everything but where the summed tile goes.
template <bool ALL_REDUCE, typename T>
struct MatmulReduce : gemm::NoComm {
  using Globals = tp::Globals;
  static constexpr bool kHasCommunicator = true;
  struct CommShared {};
  static constexpr int kVec = 16, kElems = kVec / int(sizeof(T)), kUnroll = 8;  // 8 x 16 B in flight per thread

  __device__ static int2 tile(const Globals& g, int task) { return owner_interleaved_tile(g, task); }

  // Storer thread: the tile's partial is in HBM once the TMA stores complete; tell its owner.
  template <class E>
  __device__ static void after_store(const Globals& g, E&, int2 tile) {
    tma::wait_group<0>();
    const int owner = tile.x / g.per_rank.tiles_m;
    const int item = (tile.x % g.per_rank.tiles_m) * g.per_rank.tiles_n + tile.y;
    signal_item(g.group, owner, item, op_epoch(g.group, owner));
  }

  __device__ static void communicator(const Globals& g, CommShared&, lcsc::CommRole role) {
    OpProtocol op(g.group);
    void* const local[2] = {g.aux, g.out};
    op.publish(local, 2);
    pgl<char> bufs[2];
    if (!op.acquire(local, bufs)) return;
    const Group& grp = g.group;
    const int row_vecs = g.bn / kElems;
    for (int i = role.index; i < g.per_rank.count(); i += role.count) {
      const int2 t = g.per_rank.tile(i);
      const int item = t.x * g.per_rank.tiles_n + t.y;
      if (threadIdx.x < grp.size) wait_item(grp, threadIdx.x, item, op.epoch[threadIdx.x]);
      __syncthreads();
      const int row0 = (grp.rank * g.per_rank.tiles_m + t.x) * g.bm, col0 = t.y * g.bn;
      const int rows = min(g.bm, g.m - row0), vecs = min(row_vecs, (g.n - col0) / kElems);
      for (int v0 = threadIdx.x; v0 < rows * row_vecs; v0 += blockDim.x * kUnroll) {
        int64_t at[kUnroll];  // vector index in the (m x n) matrices, -1 past the tile's edge
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int v = v0 + u * blockDim.x, r = v / row_vecs, c = v % row_vecs;
          at[u] = (v < rows * row_vecs && c < vecs) ? (int64_t(row0 + r) * g.n + col0 + c * kElems) / kElems : -1;
        }
        float acc[kUnroll][kElems] = {};
        uint4 cur[kUnroll], next[kUnroll];
        load_vectors(bufs[0][0], at, cur);
        for (int src = 0; src < grp.size; ++src) {  // rank order: every member gets the same bits
          if (src + 1 < grp.size) load_vectors(bufs[0][src + 1], at, next);  // in flight while we add
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            lanes<T, kVec>::add(acc[u], cur[u]);
            cur[u] = next[u];
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (at[u] < 0) continue;
          const uint4 sum = lanes<T, kVec>::pack(acc[u]);
          if constexpr (ALL_REDUCE) {
            for (int d = 0; d < grp.size; ++d) reinterpret_cast<uint4*>(bufs[1][(grp.rank + d) % grp.size])[at[u]] = sum;
          } else {
            const int64_t mine = int64_t(grp.rank) * g.rows_per_rank * g.n / kElems;
            reinterpret_cast<uint4*>(g.out)[at[u] - mine] = sum;
          }
        }
      }
    }
  }

  __device__ static void load_vectors(const char* base, const int64_t (&at)[kUnroll], uint4 (&out)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      out[u] = at[u] >= 0 ? __ldcg(reinterpret_cast<const uint4*>(base) + at[u]) : make_uint4(0, 0, 0, 0);
  }

  __device__ static void finish(const Globals& g) { OpProtocol(g.group).finish(); }
};

template <bool ALL_REDUCE, typename T>
struct MatmulStoreAdd : gemm::NoComm {
  using Globals = tp::Globals;
  static constexpr bool kHasCommunicator = true;  // no comm SMs; this runs the finish protocol
  static constexpr bool kHasPusher = true;        // zeroes this member's output (AR relay: and relays it)
  static constexpr uint32_t kPiece = 32 * 1024;   // output bytes zeroed or relayed per claim
  static constexpr uint32_t kZeroBox = 4 * 1024;  // bytes of one bulk store of the zeroed smem box
  static constexpr uint32_t kZeroInFlight = 4;    // zeroed pieces whose stores may be in flight at once
  static constexpr uint32_t kSignalLag = 3;       // relay: tiles whose adds may be in flight unsignalled
  static constexpr int kTileGroups = 2;           // the storer's bulk groups per tile: one per consumer warpgroup
  struct SharedExt {
    BulkRing<2, kZeroBox> ring;  // the relay's copies; stage 0 is the zeroed box before that
    char* out[kMaxGroup];        // every member's output, by rank
    int ok;                      // 0 after a timed-out handshake: nothing is sent (the error is reported)
    int pending[kSignalLag];     // relay, storer: row blocks of the tiles added but not yet signalled
    uint32_t added;              // relay, storer: tiles added so far
  };
  template <typename OutT, int BN>
  using SlotLayout = PaddedRows<OutT, BN>;

  __device__ static int2 tile(const Globals& g, int task) { return owner_interleaved_tile(g, task); }

  // AR over more than 2 members relays (Globals::relay, set by the launch): each tile is added into its
  // owner's rows only, and the owner sends its summed rows to the others (traffic per member 2 (G-1)/G
  // of the product, not G-1 of it). At 2 members both ways move the same bytes, and adding into both
  // outputs needs no relay step.
  __device__ static bool relays(const Globals& g) { return ALL_REDUCE && g.relay; }
  // Row blocks (bm full rows) this member zeroes, from first_zeroed: RS and the relay its m / G rows,
  // direct AR all m rows. Every member adds into them, so each zeroed piece is counted at every member.
  __device__ static int zeroed_blocks(const Globals& g) {
    return (ALL_REDUCE && !relays(g) ? g.group.size : 1) * g.per_rank.tiles_m;
  }
  __device__ static int first_zeroed(const Globals& g) { return relays(g) ? g.group.rank * g.per_rank.tiles_m : 0; }
  __device__ static uint64_t block_bytes(const Globals& g) { return uint64_t(g.bm) * g.n * sizeof(T); }
  __device__ static uint32_t block_pieces(const Globals& g) {
    return uint32_t((block_bytes(g) + kPiece - 1) / kPiece);
  }
  // The j-th block to zero, in the order tiles reach the blocks (owner_interleaved_tile: for direct AR
  // the owners' regions in turn), so zeroing stays ahead of the adds.
  __device__ static int zero_order(const Globals& g, int j) {
    return ALL_REDUCE && !relays(g) ? (j % g.group.size) * g.per_rank.tiles_m + j / g.group.size
                                    : first_zeroed(g) + j;
  }
  // Destination d of a tile: the member, and the row block (its count) in that member's output.
  __device__ static int destinations(const Globals& g) { return ALL_REDUCE && !relays(g) ? g.group.size : 1; }
  __device__ static int destination(const Globals& g, int2 tile, int d) {
    return destinations(g) > 1 ? (g.group.rank + d) % g.group.size : tile.x / g.per_rank.tiles_m;
  }
  __device__ static int out_block(const Globals& g, int2 tile) {
    return ALL_REDUCE ? tile.x : tile.x % g.per_rank.tiles_m;
  }
  // Relay: the count of tiles a member added into the owner's row block b (of the owner's tiles_m),
  // kept after the zeroing counts.
  __device__ static int added_count(const Globals& g, int b) { return g.group.size * g.per_rank.tiles_m + b; }
  __device__ static int counts_used(const Globals& g) {
    return relays(g) ? added_count(g, g.per_rank.tiles_m) : zeroed_blocks(g);
  }

  // Learn the members' output addresses. A member publishes for this op only after its previous
  // kernel ended (stream order; no programmatic dependent launch), so once all have published none
  // of them still resets its counts from the previous op and the pushers may signal them.
  __device__ static void begin(const Globals& g, SharedExt& ext) {
    OpProtocol op(g.group);
    void* const local[1] = {g.out};
    op.publish(local, 1);
    pgl<char> out[1];
    const bool ok = op.acquire(local, out);
    if (threadIdx.x < kMaxGroup) ext.out[threadIdx.x] = out[0].ptr[threadIdx.x];
    if (threadIdx.x == 0) ext.ok = ok, ext.added = 0;
    __syncthreads();
  }

  // Pieces claimed from a device-wide counter: first the zeroing of this member's blocks, then (relay)
  // the copies of its summed blocks to the other members. This replaces a memset before the kernel:
  // an add waits only for the block it lands in, and blocks are zeroed in the order tiles reach them.
  __device__ static void pusher(const Globals& g, SharedExt& ext) {
    if (!ext.ok) return;
    uint32_t* next = &g.group.self()->next_piece;  // reset by the launch's last CTA (op_protocol.cuh finish)
    const uint32_t zero_total = block_pieces(g) * uint32_t(zeroed_blocks(g));
    uint32_t q = zero(g, ext, next, zero_total);
    if (relays(g)) relay(g, ext, next, q - zero_total);
  }

  // TMA stores of a zeroed smem box, kZeroInFlight pieces in flight; each landed piece is counted at
  // every member. Returns the first claim past the zeroing.
  __device__ static uint32_t zero(const Globals& g, SharedExt& ext, uint32_t* next, uint32_t total) {
    unsigned char* box = ext.ring.stage[0];
    for (uint32_t i = 0; i < kZeroBox / sizeof(uint4); ++i) reinterpret_cast<uint4*>(box)[i] = make_uint4(0, 0, 0, 0);
    tma::fence_proxy_async_shared();
    const Group& grp = g.group;
    const uint64_t bytes = block_bytes(g);
    const uint32_t per_block = block_pieces(g);
    int block[kZeroInFlight];  // block of each piece in flight, by issue number % kZeroInFlight
    uint32_t issued = 0, q;
    auto count_landed = [&](uint32_t piece) {  // piece's stores are complete: count it everywhere
      for (int i = 0; i < grp.size; ++i) signal_piece(grp, (grp.rank + i) % grp.size, block[piece % kZeroInFlight]);
    };
    for (q = atomicAdd(next, 1u); q < total; q = atomicAdd(next, 1u), ++issued) {
      const int b = zero_order(g, int(q / per_block));
      const uint64_t at = uint64_t(b) * bytes + uint64_t(q % per_block) * kPiece;
      const uint64_t end = min(at + kPiece, uint64_t(b + 1) * bytes);
      for (uint64_t o = at; o < end; o += kZeroBox)
        tma::store_async(g.out + o, box, uint32_t(min(uint64_t(kZeroBox), end - o)));
      tma::commit_group();
      block[issued % kZeroInFlight] = b;
      if (issued + 1 >= kZeroInFlight) {
        tma::wait_group<kZeroInFlight - 1>();  // the oldest piece in flight has landed
        count_landed(issued + 1 - kZeroInFlight);
      }
    }
    tma::wait_group<0>();
    for (uint32_t p = issued > kZeroInFlight - 1 ? issued - (kZeroInFlight - 1) : 0; p < issued; ++p) count_landed(p);
    return q;
  }

  // Relay: copy each of this member's row blocks, once every member's tiles of it were added, to the
  // other members (blocks in tile order; pieces through the smem ring). `first` is this thread's first
  // claim, counted from the relay's start.
  __device__ static void relay(const Globals& g, SharedExt& ext, uint32_t* next, uint32_t first) {
    const Group& grp = g.group;
    const uint32_t per_block = block_pieces(g), total = per_block * uint32_t(g.per_rank.tiles_m);
    const uint32_t zero_total = per_block * uint32_t(zeroed_blocks(g));
    const uint64_t bytes = block_bytes(g);
    if (first >= total) return;
    ext.ring.init();
    int ready = -1;  // the last block seen complete
    for (uint32_t r = first; r < total; r = atomicAdd(next, 1u) - zero_total) {
      const int b = int(r / per_block);
      if (b != ready) {
        for (int src = 0; src < grp.size; ++src) wait_chunk(grp, src, added_count(g, b), uint32_t(g.per_rank.tiles_n));
        ready = b;
      }
      const uint64_t off = uint64_t(r % per_block) * kPiece, at = uint64_t(first_zeroed(g) + b) * bytes + off;
      char* dst[kMaxGroup];
      for (int i = 1; i < grp.size; ++i) dst[i - 1] = ext.out[(grp.rank + i) % grp.size] + at;
      ext.ring.broadcast(g.out + at, dst, grp.size - 1, min(uint64_t(kPiece), bytes - off));
    }
    ext.ring.inval();
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the copies before the finish protocol's signals
  }

  template <class K>
  __device__ static void store_slot(const Globals& g, const SharedExt& ext, const typename K::Out* slot, int2 tile,
                                    int w) {
    static_assert(K::kConsumerWarpgroups == kTileGroups, "after_store counts one bulk group per warpgroup");
    const int row0 = tile.x * K::BM + w * 64, col0 = tile.y * K::BN;
    const int rows = ext.ok ? min(64, g.m - row0) : 0;
    const uint32_t bytes = uint32_t(min(K::BN, g.n - col0)) * sizeof(T);
    const int64_t first_row = ALL_REDUCE ? row0 : row0 - int64_t(tile.x / g.per_rank.tiles_m) * g.rows_per_rank;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(slot);
    for (int d = 0; d < destinations(g); ++d) {
      const int dst_member = destination(g, tile, d);
      // The block must be zeroed first; after a timeout nothing is added (the error is reported).
      if (rows == 0 || !wait_chunk(g.group, dst_member, out_block(g, tile), block_pieces(g))) continue;
      T* dst = reinterpret_cast<T*>(ext.out[dst_member]) + first_row * g.n + col0;
      for (int r = 0; r < rows; ++r)
        tma::store_add_async(dst + int64_t(r) * g.n, reinterpret_cast<const T*>(src + r * K::SlotLayout::kPitch), bytes);
    }
  }

  // Relay: count a tile at its owner once its adds have landed. The storer waits only for tiles
  // kSignalLag - 1 behind the newest (each tile is one bulk group per consumer warpgroup).
  template <class E>
  __device__ static void after_store(const Globals& g, E& ext, int2 tile) {
    if (!relays(g)) return;
    ext.pending[ext.added % kSignalLag] = tile.x;
    if (++ext.added >= kSignalLag) {
      tma::wait_group<kTileGroups * (kSignalLag - 1)>();
      signal_added(g, ext.pending[ext.added % kSignalLag]);
    }
  }
  template <class E>
  __device__ static void storer_done(const Globals& g, E& ext) {  // every store has completed
    if (!relays(g)) return;
    for (uint32_t t = ext.added > kSignalLag - 1 ? ext.added - (kSignalLag - 1) : 0; t < ext.added; ++t)
      signal_added(g, ext.pending[t % kSignalLag]);
  }
  __device__ static void signal_added(const Globals& g, int block) {
    signal_piece(g.group, block / g.per_rank.tiles_m, added_count(g, block % g.per_rank.tiles_m));
  }

  __device__ static void finish(const Globals& g) {
    if (OpProtocol(g.group).finish()) reset_chunks(g.group, counts_used(g));
  }
};

}  // namespace pk::tp
