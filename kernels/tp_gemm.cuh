// Host interface of the fused tensor-parallel GEMMs (kernels/tp_gemm_kernel.cuh).
#pragma once
#include <cuda_runtime.h>

#include "../ffi/tensor_map.h"
#include "pk/group.cuh"

namespace pk::tp {

// Every op comes with comm SMs (AG push, RS/AR deterministic pull) and without (intra-SM: AG pushers
// on every compute SM, RS/AR store-add).
enum Kind : int {
  kAllGatherMatmul = 0,
  kMatmulReduceScatter = 1,
  kMatmulAllReduce = 2,
  kMatmulReduceScatterAdd = 3,
  kMatmulAllReduceAdd = 4,
  kAllGatherMatmulIntraSM = 5,
};
constexpr bool is_store_add(Kind k) { return k == kMatmulReduceScatterAdd || k == kMatmulAllReduceAdd; }
constexpr bool is_all_reduce(Kind k) { return k == kMatmulAllReduce || k == kMatmulAllReduceAdd; }
constexpr bool is_all_gather(Kind k) { return k == kAllGatherMatmul || k == kAllGatherMatmulIntraSM; }
constexpr bool is_intra_sm(Kind k) { return is_store_add(k) || k == kAllGatherMatmulIntraSM; }

struct Problem {
  Kind kind;
  Group group;
  const void* x;  // AG: (m, k) rows of this member; RS/AR: (m, k) with k the local contraction slice
  const void* w;  // (k, n), or (n, k) with transpose_w
  void* out;      // AG: (G m, n); RS: (m / G, n); AR: (m, n)
  void* aux;      // AG: gathered x (G m, k); RS/AR: partial product (m, n), unused in store-add mode
  int m, n, k;    // x is m x k
  ElemType type;  // bf16 or f16 everywhere
  int tile;       // gemm::Tile (128x256 or 128x128); kAuto picks
  int num_comm_sms;  // ignored (0) by the intra-SM kinds
  int num_sms;    // of this GPU
  bool transpose_w;  // w is stored (n, k): the product is x @ wᵀ, w read in place
};

// Whether AR store-add relays through the row blocks' owners (MatmulStoreAdd): over > 2 members, or at 2
// when PK_JAX_AR_RELAY=1 (so 2 GPUs can test the schedule).
bool all_reduce_relays(int group_size);
// Why the fused kernel cannot run this problem (empty string: it can). Checked at trace time too.
const char* unsupported(Kind kind, int group_size, int m, int n, int k, int tile);
// Throws std::invalid_argument / std::runtime_error. Returns the tile used.
int launch(const Problem& p, cudaStream_t stream);
// Loads every fused kernel on the current device (runtime start-up, before any cross-GPU wait).
cudaError_t configure();

}  // namespace pk::tp
