"""Loads the compiled extension (if it was built) and registers its XLA FFI targets."""

from __future__ import annotations

import warnings
from types import ModuleType

import jax

ext: ModuleType | None
try:
    from pk_jax import _pk_jax_ext as ext  # type: ignore[attr-defined]
    _missing_reason = ""
except ImportError as e:  # built without nvcc, or a source checkout that was never built
    ext = None
    _missing_reason = str(e)

if ext is not None:
    for _name, _capsule in ext.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
else:
    warnings.warn(
        "pk_jax: the CUDA extension is not installed (it is built only where nvcc is available), so "
        "every pk_jax op runs its jax.lax fallback. Reinstall on a machine with nvcc 12.8+ to get the "
        f"GPU kernels. ({_missing_reason})", stacklevel=2)


def available() -> bool:
    """True when the CUDA extension is importable."""
    return ext is not None
