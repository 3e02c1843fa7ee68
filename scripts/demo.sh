#!/usr/bin/env bash
# Set up, build, and run the main benchmarks: the collectives, then the fused TP GEMMs (all GPUs when
# present, else 8 virtual CPU devices with small sizes).
source "$(dirname "$0")/setup_env.sh"
$PY -m pk_jax.bench collectives "$@" || exit $?
exec $PY -m pk_jax.bench tp_gemm "$@"
