"""Settings read from environment variables (at trace time): integers and named choices, one parser each with one
error message shape."""

from __future__ import annotations

import os


def int_setting(var: str, default: int, *, minimum: int, owner: str, what: str) -> int:
    """$var as an int >= minimum, `default` when unset or empty. ValueError naming the variable, the value and what
    it counts otherwise (e.g. owner "pk_jax.ring_attention", what "a count of CTAs")."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{owner}: ${var}={raw!r}; use {what} >= {minimum} (default {default})")
    return value


def choice_setting(var: str, default: str, choices: tuple[str, ...], *, owner: str) -> str:
    """$var, one of `choices`; `default` when unset or empty. ValueError naming the variable, the value and the
    choices otherwise."""
    value = os.environ.get(var, "").strip() or default
    if value not in choices:
        raise ValueError(f"{owner}: ${var}={value!r}; use one of {choices} (default {default!r})")
    return value
