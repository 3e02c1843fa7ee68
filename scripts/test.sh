#!/usr/bin/env bash
# Set up, build, and run the tests (GPU tests run when >= 2 GPUs are present, else they skip).
# Without a GPU the CPU tests run on PK_JAX_TEST_WORKERS processes (default 2, pytest-xdist when installed) and
# XLA:CPU compiles without LLVM optimization: the tests' programs are tiny, compiling is most of their time
# (context tests 98 -> 57 s).
source "$(dirname "$0")/setup_env.sh"
workers=()
if ! nvidia-smi -L >/dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
  if $PY -c "import xdist" 2>/dev/null; then workers=(-n "${PK_JAX_TEST_WORKERS:-2}"); fi
fi
exec $PY -m pytest tests -q -rs "${workers[@]}" "$@"
