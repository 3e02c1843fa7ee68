"""Loads the compiled extension (if it was built) and registers its XLA FFI targets."""

from __future__ import annotations

import importlib.util
import warnings
from types import ModuleType

import jax

ext: ModuleType | None
if importlib.util.find_spec("pk_jax._pk_jax_ext") is None:  # installed where nvcc was absent
    ext, _missing_reason = None, "it was not built"
else:
    try:
        from pk_jax import _pk_jax_ext as ext  # type: ignore[attr-defined]
        _missing_reason = ""
    except ImportError as e:  # built, but cannot load here (e.g. no CUDA driver libraries)
        ext, _missing_reason = None, f"it failed to load: {e}"

if ext is not None:
    for _name, _capsule in ext.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
else:
    warnings.warn(
        f"pk_jax: the CUDA extension is unavailable ({_missing_reason}), so every pk_jax op runs its "
        "jax.lax fallback. It is built at install time where nvcc (CUDA 12.8+) is found.", stacklevel=2)


def available() -> bool:
    """True when the CUDA extension is importable."""
    return ext is not None
