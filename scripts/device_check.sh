#!/usr/bin/env bash
# One device call: build, run every GPU test, then the collectives benchmark. Logs go to $OUT.
# Usage (on a GPU machine): bash scripts/device_check.sh [bench args...]
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pk_jax_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/device.txt"
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
[ -n "${SKIP_TESTS:-}" ] || OUT=$OUT bash tests/gpu/run.sh -x -q ${TEST_K:+-k "$TEST_K"}
[ -n "${SKIP_BENCH:-}" ] || python3 -m pk_jax.bench collectives --out "$OUT/collectives.json" "$@" 2>&1 | tee "$OUT/bench.log"
