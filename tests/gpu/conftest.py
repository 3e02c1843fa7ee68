"""GPU tests: marked `gpu`, skipped cleanly without >= 2 CUDA GPUs and the compiled extension."""

import jax
import pytest

import pk_jax


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    reason = None
    if not pk_jax.extension_available():
        reason = "pk_jax CUDA extension not built"
    elif len(_gpus()) < 2:
        reason = "needs >= 2 CUDA GPUs"
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
