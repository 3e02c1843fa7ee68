"""Which programs a bench suite took from compile_ahead.CompileAhead (tests of the context and attention suites)."""

from __future__ import annotations

from pk_jax.bench import compile_ahead


def record_taken(monkeypatch) -> list:
    """A list that fills with the key of every compile a suite takes from CompileAhead.get (None results left out)."""
    taken = []
    real_get = compile_ahead.CompileAhead.get

    def get(self, key):
        future = real_get(self, key)
        if future is not None:
            taken.append(key)
        return future
    monkeypatch.setattr(compile_ahead.CompileAhead, "get", get)
    return taken
