#!/usr/bin/env bash
# One device call for the fused TP GEMMs: build, their GPU tests, then the tp_gemm benchmark with a
# fresh autotune cache. Logs and JSON go to $OUT.
# Usage (on a GPU machine): PK_JAX_COMMIT=<sha> bash scripts/device_tp.sh [bench args, e.g. --sizes 8192]
# The commit must come from the caller: the device's copy of .git can be stale, and the results name it.
# Env: SKIP_TESTS / SKIP_BENCH (skip a stage), TESTS (pytest paths; default the fused-op tests),
# TEST_K (pytest -k; default "not large"), PREBUILT (a folder holding the extension built for this tree
# elsewhere, e.g. on a dev machine with Python 3.12: it is copied into pk_jax/ and nothing is built),
# TEST_TIMEOUT / BENCH_TIMEOUT (seconds; default 240 / 330).
set -o pipefail
: "${PK_JAX_COMMIT:?set PK_JAX_COMMIT to the commit of this tree (the device copy of .git may be stale)}"
export PK_JAX_COMMIT PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pk_jax_out}; mkdir -p "$OUT"
if [ -n "${PREBUILT:-}" ]; then  # an extension built elsewhere for this tree (python3.12, sm_90a): no build here
  cp "$PREBUILT"/_pk_jax_ext*.so pk_jax/ || exit 1
else
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest ${TESTS:-tests/gpu/test_tp_gemm_gpu.py} -m gpu -q -rs -k "${TEST_K:-not large}" \
    2>&1 | tee "$OUT/tests.log" | tail -5
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  PK_JAX_CACHE_DIR="$OUT/cache" timeout -k 15 "${BENCH_TIMEOUT:-330}" python3 -m pk_jax.bench tp_gemm \
    --out "$OUT/tp_gemm.json" "$@" 2>&1 | tr '\r' '\n' | grep -v '^tp_gemm \[' | tee "$OUT/bench.log" | tail -16
fi
