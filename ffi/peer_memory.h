// Device memory shared between the processes of one host (multi-process jobs): a region is one
// whole allocation (XLA's allocator region, our control block, the staging heap), exported once as a
// legacy CUDA IPC handle (64 bytes: it fits in jax.distributed's key-value store, no sockets) and
// mapped once by every peer process. XLA's region may instead be virtual-memory (cuMemCreate) memory
// that legacy IPC refuses; it is then shared by POSIX fd (ffi/vmm_share.h): a descriptor through the
// key-value store, one fd per chunk over the job's Unix sockets. Kernels then translate published addresses per region
// (pk/group.cuh AddressMap), so no call needs a host exchange.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace pk {

struct ExportedRegion {
  uint64_t begin = 0, size = 0;  // the whole allocation holding the pointer (POSIX fd: the run of chunks)
  std::string handle;            // cudaIpcMemHandle_t bytes, or (fds not empty) a vmm descriptor; empty
                                 // when the allocation cannot be shared
  std::vector<int> fds;          // POSIX fd sharing: one per chunk, owned by the caller
  std::string sharing;           // "cuda_ipc" or "posix_fd" when shared
  std::string why_not;           // set when handle is empty
};

// The allocation that holds `ptr` (on the current device) and its IPC handle.
ExportedRegion export_region(const void* ptr);
// XLA's region around `ptr`: legacy IPC, else (a VMM allocation created with POSIX-fd handles) the run of
// chunks around it within `max_bytes` (0: the probe's chunk only) exported by fd, unless `by_fd` is false.
// `why_not` names both refusals when neither works.
ExportedRegion export_xla_region(const void* ptr, uint64_t max_bytes, bool by_fd);
// Maps a peer process's region on the current device (peer access enabled on demand). Throws
// std::runtime_error naming the failure (e.g. no P2P path between the GPUs).
void* open_region(const std::string& handle);

}  // namespace pk
