#!/usr/bin/env bash
# Set up, build, and run the tests (GPU tests run when >= 2 GPUs are present, else they skip).
source "$(dirname "$0")/setup_env.sh"
exec $PY -m pytest tests -q -rs "$@"
