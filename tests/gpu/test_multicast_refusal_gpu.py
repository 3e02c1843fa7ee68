"""On a GPU machine, with the default environment (multicast not requested): the extension built with
the multimem kernels loads, configures nothing for them and refuses to launch them, and the transport
plan says peer_to_peer. Creates no multicast object and runs no multimem code."""

from __future__ import annotations

import os

import pytest

import pk_jax
from pk_jax import _ext

MIN_GPUS = 1

MULTICAST_VARS = ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                  "PK_JAX_ENABLE_MULTICAST")


@pytest.fixture
def not_requested(monkeypatch):
    for v in MULTICAST_VARS:
        monkeypatch.delenv(v, raising=False)


def test_multimem_refused_with_cuda_present(not_requested):
    allowed, reason = pk_jax.runtime.multicast_policy()
    assert not allowed and "not requested" in reason
    assert _ext.ext.multimem_launch_refused()
    choice, why = pk_jax.runtime.multicast_plan(2, 1 << 20, [True, True])
    assert choice == "peer_to_peer" and "not requested" in why
    print(f"PASS multicast refused on GPU host: {why}")


def test_opt_in_is_not_set_by_the_suite():
    # Guard for the hard rule: nothing in the test run may leave multicast requested.
    assert os.environ.get("PK_JAX_ENABLE_MULTICAST") != "1"
