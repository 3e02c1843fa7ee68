// Device memory shared between the processes of one host (multi-process jobs): a region is one
// whole allocation (XLA's allocator region, our control block, the staging heap), exported once as a
// legacy CUDA IPC handle (64 bytes: it fits in jax.distributed's key-value store, no sockets) and
// mapped once by every peer process. Kernels then translate published addresses per region
// (pk/group.cuh AddressMap), so no call needs a host exchange.
#pragma once
#include <cstdint>
#include <string>

namespace pk {

struct ExportedRegion {
  uint64_t begin = 0, size = 0;  // the whole allocation holding the pointer
  std::string handle;            // cudaIpcMemHandle_t bytes; empty when the allocation cannot be shared
  std::string why_not;           // set when handle is empty
};

// The allocation that holds `ptr` (on the current device) and its IPC handle.
ExportedRegion export_region(const void* ptr);
// Maps a peer process's region on the current device (peer access enabled on demand). Throws
// std::runtime_error naming the failure (e.g. no P2P path between the GPUs).
void* open_region(const std::string& handle);

}  // namespace pk
