"""The small path's all_reduce choice under an environment variable, for the CPU tests of its rules."""

from __future__ import annotations

from pk_jax import _small_path


def assert_choice(monkeypatch, var: str, mode: str | None, nbytes: int, g: int, want: str | None) -> None:
    """all_reduce_choice for auto and "small" with `var` set to `mode` (None: unset) gives `want` (None: no small
    path for auto)."""
    if mode is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, mode)
    assert _small_path.all_reduce_choice(nbytes, g, auto=True) == want
    if want is not None:
        assert _small_path.all_reduce_choice(nbytes, g, auto=False) == want
