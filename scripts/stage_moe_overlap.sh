#!/usr/bin/env bash
# Device stage of DispatchMatmul (dispatch + first grouped GEMM fused, pk_jax/moe/overlap.py): on a >= 2-GPU
# machine, in the repo root, with the prebuilt extension in pk_jax/ (or PREBUILT=<dir> holding it). Logs to $OUT
# (7 files: 4 logs, one bench JSON per SMS_SWEEP value, at most 3 values); at most ~7 min:
#   first      the first overlap GPU test alone, waits bounded at 3 s (PK_JAX_TIMEOUT_MS), under `timeout 90`:
#              a hang or a failure costs only that, and stops the stage
#   overlap    the other overlap GPU tests (routings, top-k 1..8, comm-SM counts, the issue's shape, moe_mlp)
#   moetests   the existing MoE GPU tests (test_moe_gpu.py, test_moe_fused_gpu.py): the shared code still holds
#   bench      python -m pk_jax.bench moe --op dispatch_gemm per comm-SM count of SMS_SWEEP (default "16"; e.g.
#              SMS_SWEEP="8 16 24"): fused vs the grouped GEMM alone vs dispatch then GEMM, same run; the first
#              value runs uniform and skewed, the others uniform only
# Usage: OUT=/tmp/out SMS_SWEEP="8 16 24" bash scripts/stage_moe_overlap.sh
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pk_jax_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${PREBUILT:-}" ]; then cp "$PREBUILT"/_pk_jax_ext*.so pk_jax/ || exit 1; fi
DEADLINE=${DEADLINE:-420}  # seconds for the whole stage

source scripts/stage_step.sh

T=tests/gpu/test_moe_overlap_gpu.py
if ! step first 90 env PK_JAX_TIMEOUT_MS=3000 python3 -m pytest -x -q -rs "$T::test_overlap_first"; then
  echo "=== the first overlap test failed or hung: the rest of the stage is skipped ==="
  exit 1
fi
step overlap 150 python3 -m pytest -q -rs "$T" --deselect "$T::test_overlap_first"
step moetests 120 python3 -m pytest -x -q -rs tests/gpu/test_moe_gpu.py tests/gpu/test_moe_fused_gpu.py
first=1
for sms in ${SMS_SWEEP:-16}; do
  cases=(); [ -z "$first" ] && cases=(--cases uniform_fwd)
  echo "--- PK_JAX_MOE_OVERLAP_SMS=$sms ---" >> "$OUT/bench.all"
  step "bench-sms$sms" 120 env PK_JAX_MOE_OVERLAP_SMS="$sms" python3 -m pk_jax.bench moe --op dispatch_gemm \
    "${cases[@]}" --out "$OUT/moe-overlap-sms$sms.json"
  cat "$OUT/bench-sms$sms.log" >> "$OUT/bench.all" && rm -f "$OUT/bench-sms$sms.log"
  first=
done
mv "$OUT/bench.all" "$OUT/bench.log" 2>/dev/null
exit 0
