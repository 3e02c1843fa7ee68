// Integer knobs read from the environment (host only): a value, clamped to [lo, hi], or `fallback` when
// the variable is unset or empty. Callers read them once per process (a function-local static): no
// per-call host state, so launches stay the same inside command buffers.
#pragma once
#include <cstdint>
#include <cstdlib>

namespace pk {

inline int64_t env_or(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  const long long x = std::atoll(v);
  return x < lo ? lo : (x > hi ? hi : x);
}

}  // namespace pk
