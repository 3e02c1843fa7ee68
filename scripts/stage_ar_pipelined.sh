#!/usr/bin/env bash
# Device stage for the pipelined all_reduce (algorithm="small_pipelined", issue 25). Runs in the repo root
# of a machine with >= 2 GPUs, the built extension already in pk_jax/ (no build here); logs to $OUT.
# Whole stage <= 7 min: every step's limit shrinks to what is left of DEADLINE (default 420 s).
#   1 first   the first GPU test alone, waits bounded at 3 s, under `timeout 90` (a protocol hang costs
#             only this; the later steps are skipped when it fails)
#   2 tests   the other small_pipelined GPU tests (sizes, bits vs small_chunked, chains, two-shot and odd
#             knobs in fresh processes, 1,000 command-buffer replays)
#   3 floor   latency slopes (chains of 16/64/256, scripts/latency_floor.py): small_chunked vs
#             small_pipelined vs auto vs psum at 4 KiB .. 8 MiB
#   4 sweep   only if PIPE_SWEEP is set: "ROUNDS:LAG[:MIN_CHUNK] ..." (e.g. "4:1 8:1 8:2 2:1 4:2:8192"),
#             small_pipelined's slopes at 512 KiB, 1 MiB and 8 MiB under each (one log: pipelined-sweep.log)
#   5 small   the existing small-path GPU tests' all_reduce rows, interleaving and replays, in the time left
# Usage: OUT=/tmp/out PIPE_SWEEP="4:1 8:1" bash scripts/stage_ar_pipelined.sh
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/pk_jax_out}; mkdir -p "$OUT"
DEADLINE=${DEADLINE:-420}
day=$(date +%F)
ls pk_jax/_pk_jax_ext*.so > /dev/null || { echo "no built extension in pk_jax/"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | head -2

source scripts/stage_step.sh

T=tests/gpu/test_small_pipelined_gpu.py
step pipelined-first 90 env PK_JAX_TIMEOUT_MS=3000 python3 -m pytest "$T::test_first_pipelined_call" -x -q -rs \
  || { echo "first test failed or hung: later steps skipped"; exit 1; }
step pipelined-tests 170 env PK_JAX_TIMEOUT_MS=10000 python3 -m pytest "$T" -x -q -rs --durations=8 \
  --deselect "$T::test_first_pipelined_call"
step pipelined-floor 110 python3 scripts/latency_floor.py --tag pipelined --reps 10 \
  --ops pk_small_chunked pk_small_pipelined pk_auto psum \
  --bytes 4096 16384 65536 131072 262144 524288 1048576 2097152 8388608 --out "$OUT/$day-floor-pipelined.json"
for cfg in ${PIPE_SWEEP:-}; do  # one log for the whole sweep (few files come back from a device call)
  IFS=: read -r rounds lag chunk <<< "$cfg"
  left=$((DEADLINE - SECONDS)); [ "$left" -lt 40 ] && { echo "sweep $cfg: skipped, ${left}s left"; continue; }
  echo "=== sweep rounds $rounds lag $lag min_chunk ${chunk:-default} ===" | tee -a "$OUT/pipelined-sweep.log"
  timeout 45 env PK_JAX_AR_PIPELINED_ROUNDS="$rounds" PK_JAX_AR_PIPELINED_LAG="$lag" \
    ${chunk:+PK_JAX_AR_PIPELINED_MIN_CHUNK=$chunk} python3 scripts/latency_floor.py --tag "r${rounds}l${lag}${chunk:+c$chunk}" \
    --reps 10 --ops pk_small_pipelined --bytes 524288 1048576 8388608 2>&1 | grep -v "^WARNING" | tee -a "$OUT/pipelined-sweep.log"
done
step small-tests 120 env PK_JAX_TIMEOUT_MS=10000 python3 -m pytest tests/gpu/test_small_collectives_gpu.py -x -q -rs \
  -k "test_all_reduce_sizes or interleave or replays or same_bits"
echo "stage_ar_pipelined: done after ${SECONDS}s"
