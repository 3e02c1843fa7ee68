#!/usr/bin/env bash
# Runs every GPU test on this machine in one go (build first: pip install --no-build-isolation -e .).
# Usage: bash tests/gpu/run.sh [extra pytest args]; logs to ${OUT:-.}/gpu-tests.log
set -o pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
python3 -m pytest tests/gpu -m gpu -v -rs --durations=15 "$@" 2>&1 | tee "${OUT:-.}/gpu-tests.log"
