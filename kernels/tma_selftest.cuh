// Host entry of the TMA peer self-test (tma_selftest.cu). Returns "" on success, else what failed.
#pragma once
#include <cstddef>
#include <string>

namespace pk {
std::string tma_peer_selftest(int me, int peer, size_t chunks);
}
