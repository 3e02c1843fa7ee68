"""GPU tests: marked `gpu`, skipped cleanly without the compiled extension or enough CUDA GPUs
(a test module sets MIN_GPUS; default 2)."""

import pytest

import pk_jax

from .devices import gpus


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    have = len(gpus())
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            need = getattr(item.module, "MIN_GPUS", 2)
            if not pk_jax.extension_available():
                item.add_marker(pytest.mark.skip(reason="pk_jax CUDA extension not built"))
            elif have < need:
                item.add_marker(pytest.mark.skip(reason=f"needs >= {need} CUDA GPUs"))
