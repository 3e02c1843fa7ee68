#!/usr/bin/env bash
# One device call for the GEMM: build, GPU matmul tests, the gemm benchmark, and the kernel's SASS
# summary (HGMMA count, registers). Logs to $OUT. Usage: bash scripts/device_gemm.sh [bench args]
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pk_jax_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
so=$(python3 -c "import pk_jax._pk_jax_ext as e; print(e.__file__)")
if command -v cuobjdump > /dev/null; then
  cuobjdump -sass "$so" > "$OUT/sass.txt" 2>&1
  python3 scripts/sass_summary.py "$OUT/sass.txt" | tee "$OUT/sass-summary.txt"
fi
[ -n "${SKIP_TESTS:-}" ] || OUT=$OUT timeout "${TEST_TIMEOUT:-300}" bash tests/gpu/run.sh -x -q ${TEST_K:+-k "$TEST_K"}
[ -n "${SKIP_BENCH:-}" ] || timeout -k 15 "${BENCH_TIMEOUT:-400}" python3 -m pk_jax.bench gemm --out "$OUT/gemm.json" "$@" 2>&1 | tee "$OUT/gemm.log"
