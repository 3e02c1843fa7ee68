"""Integer settings read from environment variables (at trace time), one parser with one error message shape."""

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
