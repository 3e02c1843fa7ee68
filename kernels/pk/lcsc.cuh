// The load-compute-store-communicate (LCSC) program template (paper section 3.2.3, appendix D).
//
// A kernel is a struct K of four roles plus its state:
//   K::loader(g, smem, LoaderState&, task)        one thread: TMA loads (local or peer HBM)
//   K::consumer(g, smem, ConsumerState&, task)    one warpgroup each: tensor-core work
//   K::storer(g, smem, StorerState&, task)        one thread: TMA stores (local or peer HBM)
//   K::communicator(g, comm_smem, CommRole)       whole CTAs on the first num_comm_sms SMs
//   K::pusher(g, smem)                            one thread of every compute CTA (with kHasPusher):
//                                                 TMA work beside the GEMM (push x, zero the output)
// and K::Globals (with an int num_comm_sms), K::Shared (compute SMs), K::CommShared (comm SMs),
// K::init(g, Shared&) (barriers, run by one thread), K::begin(g, Shared&) (every compute thread, before
// the roles start), K::num_tasks(g), K::finish(g) (run by every
// thread of every CTA at the end: the cross-GPU completion protocol), and the constants
// kConsumerWarpgroups, kProducerRegs, kConsumerRegs, kHasCommunicator, kHasPusher, kTaskCounter. A communicator
// that joins compute (kTaskCounter) leaves no TMA in flight and no live mbarrier in CommShared.
//
// The template owns the persistent grid, the warpgroup specialization and the setmaxnreg register
// split: warpgroup 0 produces (loader in warp 0, storer in warp 1, pusher in warp 2), warpgroups 1..
// consume. Every role
// of a CTA walks the same task list in the same order, so the rings between them stay in step.
// Tasks are assigned statically (compute SM i takes i, i + workers, ...) unless K::kTaskCounter and
// K::task_counter(g) is not null: then the loader claims tasks from a device-wide counter (task_queue.cuh) and the comm CTAs, once their
// communication is done, join the compute SMs and take what is left (no idle SMs in the last wave).
// Optional K::kClusterSize (default 1): the CTAs launch in clusters of that size and a cluster walks one task
// list (task i of every CTA of a cluster is the same task; cluster::rank() tells the CTA its part). The
// template syncs the cluster after K::init (peers may signal this CTA's barriers from then on) and before
// exit (no peer signals or multicasts into a CTA that has left). Static tasks, no comm SMs.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cluster.cuh"
#include "task_queue.cuh"
#include "tile_scheduler.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace pk::lcsc {

struct CommRole {
  int index;  // 0 .. count-1
  int count;  // num_comm_sms
};

template <class K>
constexpr int threads() {
  return 128 * (K::kConsumerWarpgroups + 1);
}
template <class K>
constexpr size_t smem_bytes() {
  const size_t s = sizeof(typename K::Shared) > sizeof(typename K::CommShared) ? sizeof(typename K::Shared)
                                                                               : sizeof(typename K::CommShared);
  return s + 1024;  // slack to align the base to 1024 bytes (the 128-byte swizzle's period)
}

// Registers per thread a CTA of threads<K>() holds from its launch under __launch_bounds__(threads, 1):
// the 64K-register file split evenly, in the allocation unit of 8 (384 threads: 168). setmaxnreg only
// moves registers inside this per-CTA pool, and setmaxnreg.inc blocks until the pool has them: a split
// that asks for more than the pool deadlocks the warpgroup that asks last.
template <class K>
constexpr int launch_regs() {
  const int r = 65536 / threads<K>() / 8 * 8;
  return r > 255 ? 255 : r;
}
template <class K>
constexpr bool register_split_fits() {
  return 128 * K::kProducerRegs + 128 * K::kConsumerWarpgroups * K::kConsumerRegs <= threads<K>() * launch_regs<K>();
}

// Optional K::consumer_finish(g, Shared&, ConsumerState&): every consumer thread, after its last task (e.g.
// the output of a task whose epilogue a consumer defers under the next task's MMAs).
template <class K, class = void>
struct HasConsumerFinish : std::false_type {};
template <class K>
struct HasConsumerFinish<K, std::void_t<decltype(&K::consumer_finish)>> : std::true_type {};

// K::kClusterSize, 1 when K does not declare it.
template <class K, class = void>
struct ClusterSize : std::integral_constant<int, 1> {};
template <class K>
struct ClusterSize<K, std::void_t<decltype(K::kClusterSize)>> : std::integral_constant<int, K::kClusterSize> {};

// K::kCounterAlways (default false): K::task_counter(g) is never null, so only the claiming walk is compiled. (The
// static walk beside it cost the grouped GEMM's 128x256 dyn consumers 520 bytes of spill stores and 2,936 of
// spill loads: ptxas allocates both copies of the consumer's loop together.)
template <class K, class = void>
struct CounterAlways : std::false_type {};
template <class K>
struct CounterAlways<K, std::void_t<decltype(K::kCounterAlways)>> : std::bool_constant<K::kCounterAlways> {};

// K::kSingleWalk (default false): a kernel whose task_counter(g) may be null walks its tasks in one loop that takes
// each task from the counter's queue or from the static order (a uniform branch per task), so the body (the consumer)
// is compiled once. Two walks cost the attention forward 12-64 bytes of spills per variant (session 40), as they did
// the grouped GEMM (kCounterAlways). No clusters, no comm SMs.
template <class K, class = void>
struct SingleWalk : std::false_type {};
template <class K>
struct SingleWalk<K, std::void_t<decltype(K::kSingleWalk)>> : std::bool_constant<K::kSingleWalk> {};

// K::kUniformWarpgroup (default false): the warpgroup index is broadcast from lane 0 (CUTLASS's
// canonical_warp_group_idx), so ptxas knows it is warp-uniform and what a consumer derives from it (its shared-memory
// tiles, its wgmma descriptors) can live in uniform registers instead of being moved there (R2UR) before every wgmma.
// The attention kernels set it (one H200, 2026-11-28: R2UR 212 -> 119 in the D 128 forward, +4 % geomean); the
// GEMMs do not (with it everywhere: 1.000 vs 1.003 x jnp.dot over 17 shapes, one turn: no gain).
template <class K, class = void>
struct UniformWarpgroup : std::false_type {};
template <class K>
struct UniformWarpgroup<K, std::void_t<decltype(K::kUniformWarpgroup)>> : std::bool_constant<K::kUniformWarpgroup> {};

constexpr int kQueueDepth = 4;
// Only kernels that claim tasks at run time instantiate (and so allocate) the queue.
template <class K>
__device__ __forceinline__ TaskQueue<kQueueDepth>& task_queue() {
  __shared__ TaskQueue<kQueueDepth> queue;
  return queue;
}

// The compute SMs: warpgroup-specialized loader / consumers / storer over this CTA's tasks.
template <class K>
__device__ __forceinline__ void compute(const typename K::Globals& g, typename K::Shared& s) {
  const int comm = g.num_comm_sms;
  if (threadIdx.x == 0) {
    K::init(g, s);
    if constexpr (K::kTaskCounter) task_queue<K>().init(4 * K::kConsumerWarpgroups + 1);  // consumer warps + storer
    tma::fence_barrier_init();
  }
  if constexpr (ClusterSize<K>::value > 1) cluster::sync();  // the peers' barriers are initialized too
  else __syncthreads();
  K::begin(g, s);
  // One walk over this CTA's tasks for each role; `claims` marks the loader (the one that claims).
  auto each_task = [&](bool claims, bool whole_warp, auto&& body) {
    if constexpr (SingleWalk<K>::value) {
      static_assert(K::kTaskCounter && !CounterAlways<K>::value && ClusterSize<K>::value == 1 &&
                    !K::kHasCommunicator, "kSingleWalk: a task counter that may be null, no clusters, no comm SMs");
      uint32_t* counter = K::task_counter(g);
      TaskQueue<kQueueDepth>& queue = task_queue<K>();
      RingPos<kQueueDepth> pos;
      const int total = K::num_tasks(g);
      for (int next = int(blockIdx.x);; next += int(gridDim.x)) {  // next: the static order's task
        const int t = counter ? (claims ? queue.claim(pos, counter, total) : queue.take(pos, whole_warp))
                              : (next < total ? next : -1);
        if (t < 0) return;
        body(t);
      }
    } else {
      if constexpr (K::kTaskCounter) {
        uint32_t* counter = K::task_counter(g);
        if (CounterAlways<K>::value || counter) {  // null: this launch keeps the static order
          TaskQueue<kQueueDepth>& queue = task_queue<K>();
          RingPos<kQueueDepth> pos;
          for (int t; (t = claims ? queue.claim(pos, counter, K::num_tasks(g)) : queue.take(pos, whole_warp)) >= 0;)
            body(t);
          return;
        }
      }
      if constexpr (!CounterAlways<K>::value) {
        constexpr int C = ClusterSize<K>::value;  // a cluster's CTAs walk one list
        for (int t : TaskRange{(int(blockIdx.x) - comm) / C, (int(gridDim.x) - comm) / C, K::num_tasks(g)}) body(t);
      }
    }
  };
  const int warpgroup =
      UniformWarpgroup<K>::value ? __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0) : int(threadIdx.x / 128);
  if (warpgroup == 0) {
    wgmma::setmaxnreg_dec<K::kProducerRegs>();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) {
      typename K::LoaderState st{};
      each_task(true, false, [&](int t) { K::loader(g, s, st, t); });
    } else if (warp == 1 && lane == 0) {
      typename K::StorerState st{};
      each_task(false, false, [&](int t) { K::storer(g, s, st, t); });
      K::storer_finish(g, s, st);
    } else if (warp == 2 && lane == 0) {
      if constexpr (K::kHasPusher) K::pusher(g, s);  // intra-SM work beside the GEMM (push x, zero output)
    }
  } else {
    wgmma::setmaxnreg_inc<K::kConsumerRegs>();
    typename K::ConsumerState st{};
    st.warpgroup = warpgroup - 1;
    each_task(false, true, [&](int t) { K::consumer(g, s, st, t); });
    if constexpr (HasConsumerFinish<K>::value) K::consumer_finish(g, s, st);
  }
  __syncwarp();  // lanes 1-31 of the loader / storer warps wait for lane 0 before any CTA-wide barrier
}

template <class K>
__global__ void __launch_bounds__(threads<K>(), 1) kernel(const __grid_constant__ typename K::Globals g) {
  static_assert(register_split_fits<K>(), "setmaxnreg split: 128 * kProducerRegs + 128 * kConsumerWarpgroups * "
                "kConsumerRegs must not exceed threads * launch_regs (384 threads: 64512), or setmaxnreg.inc hangs");
  static_assert(K::kProducerRegs % 8 == 0 && K::kConsumerRegs % 8 == 0 && K::kProducerRegs >= 24 &&
                K::kConsumerRegs <= 256, "setmaxnreg counts: multiples of 8 in [24, 256]");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int comm = g.num_comm_sms;
  if (int(blockIdx.x) < comm) {  // the comm part: communicate, then (kTaskCounter) fall through to compute
    if constexpr (K::kHasCommunicator)
      K::communicator(g, *reinterpret_cast<typename K::CommShared*>(base), CommRole{int(blockIdx.x), comm});
    if constexpr (!K::kTaskCounter) {  // static tasks belong to the compute SMs: nothing left to take
      if constexpr (K::kHasCommunicator) K::finish(g);
      return;
    }
    __syncthreads();  // communication done: its shared memory becomes the compute roles'
  }
  compute<K>(g, *reinterpret_cast<typename K::Shared*>(base));  // the one compute call of every CTA
  if constexpr (ClusterSize<K>::value > 1) cluster::sync();  // the peers' last arrivals on this CTA are in
  if constexpr (K::kHasCommunicator) K::finish(g);
}

// Raises the kernel's shared-memory limit (and so loads it): call for every device before any
// cross-GPU wait can be in flight (a lazy module load takes a process-wide lock).
template <class K>
cudaError_t configure() {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(&kernel<K>), cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(smem_bytes<K>()));
}

// num_comm_sms + compute SMs CTAs, one per SM (the kernels are sized to fill an SM).
// With K::kClusterSize C > 1: clusters of C CTAs, compute_sms rounded down to a multiple of C (no comm SMs).
template <class K>
cudaError_t launch(const typename K::Globals& g, int compute_sms, cudaStream_t stream) {
  constexpr int C = ClusterSize<K>::value;
  if constexpr (C > 1) {
    static_assert(!K::kHasCommunicator && !K::kTaskCounter, "clusters: static tasks on compute SMs only");
    const int clusters_max = compute_sms / C, tasks = K::num_tasks(g);
    const int clusters = clusters_max < tasks ? clusters_max : tasks;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(unsigned(C * (clusters > 0 ? clusters : 1)));
    cfg.blockDim = dim3(unsigned(threads<K>()));
    cfg.dynamicSmemBytes = smem_bytes<K>();
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr, cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel<K>, g);
  } else {
    const int workers = compute_sms < K::num_tasks(g) ? compute_sms : K::num_tasks(g);
    kernel<K><<<g.num_comm_sms + (workers > 0 ? workers : 1), threads<K>(), smem_bytes<K>(), stream>>>(g);
    return cudaGetLastError();
  }
}

}  // namespace pk::lcsc
