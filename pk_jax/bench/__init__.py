"""Benchmark suites: `python -m pk_jax.bench <suite>` (see --help)."""
