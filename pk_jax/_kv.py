"""The jax.distributed key-value store, in one place (it lives in a private jax module).

pk_jax.initialize() exchanges a few hundred bytes per GPU through it at start-up (IPC handles and
addresses); no extra ports or MPI. (Only memory shared by POSIX fd needs more: its fds go over Unix sockets
in a private per-job directory whose path travels through this store; see pk_jax/distributed.py.)
"""

from __future__ import annotations

import binascii

from jax._src import distributed


def available() -> bool:
    """True once jax.distributed.initialize() has run in this process."""
    return distributed.global_state.client is not None


def _client():
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("pk_jax: jax.distributed is not initialized: call jax.distributed.initialize() first")
    return client


def put(key: str, value: str) -> None:
    _client().key_value_set(key, value)


def get(key: str, timeout_s: float) -> str:
    """Blocks until `key` is set by some process, or raises after `timeout_s` naming the key."""
    try:
        return _client().blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - jaxlib raises its own error types
        raise TimeoutError(f"pk_jax: no value for {key!r} within {timeout_s:.0f} s (did every process call "
                           f"pk_jax.initialize()?): {e}") from None


def put_bytes(key: str, value: bytes) -> None:
    put(key, binascii.hexlify(value).decode())


def get_bytes(key: str, timeout_s: float) -> bytes:
    return binascii.unhexlify(get(key, timeout_s))
