#!/usr/bin/env bash
# Set up, build, and show what pk_jax gives on this machine in under two minutes: one row per op family
# (GEMM, collectives, fused GEMMs) against XLA, a table and a PNG. The full suites:
# python -m pk_jax.bench {collectives,gemm,tp_gemm,transfer,sync}.
source "$(dirname "$0")/setup_env.sh"
exec $PY -m pk_jax.bench demo "$@"
