"""Test set-up: 8 virtual CPU devices when there is no GPU (set before jax initializes), and the
small-message path off unless a test turns it on: most tests check the bulk and fused kernels at sizes
that `auto` would send down the small path (tests/test_small_path_cpu.py and the multirank check_small
step cover that path and auto's rule)."""

import os

import pytest

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


@pytest.fixture(autouse=True)
def _small_path_off_by_default(monkeypatch):
    if "PK_JAX_SMALL_PATH" not in os.environ:
        monkeypatch.setenv("PK_JAX_SMALL_PATH", "0")
