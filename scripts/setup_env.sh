#!/usr/bin/env bash
# Sourced by scripts/demo.sh and scripts/test.sh: picks a Python 3.12+ with jax, installs pk_jax
# (building the CUDA extension when nvcc is found), and exports PY.
set -e
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="$PATH:/usr/local/bin:/usr/local/cuda/bin"

has_deps() { "$1" -c 'import sys, jax, nanobind, scikit_build_core, pytest, flax; assert sys.version_info >= (3, 12)' 2>/dev/null; }

if [ -n "${PK_JAX_PYTHON:-}" ]; then
  PY=$PK_JAX_PYTHON
elif has_deps python3; then
  PY=python3                       # e.g. the GPU machines: everything is preinstalled, no network
elif [ -x .venv/bin/python ] && has_deps .venv/bin/python; then
  PY=.venv/bin/python
else
  base=""
  for c in /root/.pyenv/versions/3.12*/bin/python3.12 "$(command -v python3.12)" "$(command -v python3.13)"; do
    if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then base=$c; break; fi
  done
  [ -n "$base" ] || { echo "pk_jax: needs Python >= 3.12 (jax 0.11)"; exit 1; }
  "$base" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "jax==0.11.2" nanobind scikit-build-core pytest pytest-xdist numpy matplotlib flax
  PY=.venv/bin/python
fi
echo "pk_jax: using $($PY -c 'import sys; print(sys.executable)')"
build_opts=()
if [ -n "${CI:-}" ] && ! nvidia-smi -L >/dev/null 2>&1; then  # CI without a GPU: no kernel runs, so PTX only
  build_opts=(--config-settings=cmake.define.PK_JAX_PTX_ONLY=ON)
fi
$PY -m pip install -q --no-build-isolation --no-deps "${build_opts[@]}" -e . > /tmp/pk_jax_build.log 2>&1 \
  || { cat /tmp/pk_jax_build.log; exit 1; }
$PY -c 'import pk_jax; print("pk_jax: CUDA extension", "built" if pk_jax.extension_available() else "NOT built (jax.lax fallback)")' 2>&1 | grep -v Warning
export PY
