#!/usr/bin/env bash
# Set up, build, and run the collectives benchmark: all GPUs when present, else 8 virtual CPU devices.
source "$(dirname "$0")/setup_env.sh"
exec $PY -m pk_jax.bench collectives "$@"
