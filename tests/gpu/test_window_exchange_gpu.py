"""The windowed all-to-all by copy engines (pk_exchange_start, pk_jax/context/window_exchange.py) on GPUs: the
tiled all-to-all's bits for bf16 and for a size that is not whole 16-byte rows, a head run with `into` kept
outside the windows, 40 exchanges in a row (the board's 16 slots reused), and Ulysses' head-chunked pipeline
on it against the float32 reference. Needs every member in this process (single-process jobs).

Run the first test alone with a short timeout before the others (host waits are bounded by PK_JAX_TIMEOUT_MS):
    PK_JAX_TIMEOUT_MS=5000 timeout 110 python -m pytest -x -q \
        "tests/gpu/test_window_exchange_gpu.py::test_window_alone_small"
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.context.ring_shift import shift_done
from pk_jax.context.window_exchange import Window, place_own, window_all_to_all_start
from .devices import gpus

MIN_GPUS = 2


def mesh(g: int) -> Mesh:
    return Mesh(np.array(gpus()[:g]), ("sp",))


def run(fn, g: int, x: np.ndarray):
    """fn inside shard_map over axis 1 of x, compiled; returns (result, the compiled HLO text)."""
    m = mesh(g)
    sharding = NamedSharding(m, P(None, "sp"))
    f = jax.jit(jax.shard_map(fn, mesh=m, in_specs=P(None, "sp"), out_specs=P(None, "sp")))
    out = f(jax.device_put(x, sharding))
    pk_jax.runtime.check()
    return np.asarray(out), f.lower(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)).compile().as_text()


def exchange(x, **kw):
    y, token = window_all_to_all_start(x, ("sp",), **kw)
    return shift_done((y,), token, keep_alive=x)[0]


def whole(g: int, b: int, t: int, h: int, d: int):
    """The tiled all-to-all, split heads (2), concat sequence (1), as windows."""
    return lambda x: exchange(x, src=Window(2, h // g, 0, h // g), dst=Window(1, t, 0, t),
                              out_shape=(b, g * t, h // g, d))


def tiled(x):
    return jax.lax.all_to_all(x, "sp", 2, 1, tiled=True)


def data(g: int, b: int, t: int, h: int, d: int, dtype, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((b, g * t, h, d)).astype(dtype)


@pytest.fixture(autouse=True)
def copy_engines(monkeypatch):
    monkeypatch.setenv("PK_JAX_RING_SHIFT_ENGINE", "copy")


def test_window_alone_small():
    """The first exchange: 2 GPUs, small bf16 blocks; the handler, not the ppermute fallback."""
    g, b, t, h, d = 2, 2, 8, 4, 64
    x = data(g, b, t, h, d, jnp.bfloat16)
    got, hlo = run(whole(g, b, t, h, d), g, x)
    want, _ = run(tiled, g, x)
    np.testing.assert_array_equal(got, want)
    assert 'custom_call_target="pk_exchange_start"' in hlo


@pytest.mark.parametrize("shape,dtype", [((2, 256, 16, 128), jnp.bfloat16), ((3, 40, 8, 3), jnp.float32),
                                         ((1, 512, 32, 64), jnp.float16)])
def test_window_equals_tiled_all_to_all(shape, dtype):
    """Every GPU: the tiled all-to-all's bits, including rows of 12 bytes (not whole 16-byte vectors)."""
    g = len(gpus())
    b, t, h, d = shape
    h *= g // 2 if g > 2 else 1
    x = data(g, b, t, h, d, dtype, seed=1)
    got, _ = run(whole(g, b, t, h, d), g, x)
    want, _ = run(tiled, g, x)
    np.testing.assert_array_equal(got, want)


def test_window_head_run_into_keeps_the_rest():
    """A source offset (the second run of 2 of every member's heads) landing after t rows of `into` (sevens)."""
    g = len(gpus())
    b, t, h, d = 2, 16, 4 * g, 32
    x = data(g, b, t, h, d, jnp.float32, seed=2)
    part = lambda x: exchange(x, src=Window(2, h // g, 2, 2), dst=Window(1, t, t, t),
                              into=jnp.full((b, (g + 1) * t, 2, d), 7.0, jnp.float32))
    got, _ = run(part, g, x)
    want, _ = run(tiled, g, x)
    got = got.reshape(b, g, (g + 1) * t, 2, d)
    np.testing.assert_array_equal(got[:, :, t:], want.reshape(b, g, g * t, h // g, d)[..., 2:4, :])
    assert (got[:, :, :t] == 7.0).all()


def test_window_own_block_left_to_xla():
    """own=False: the side stream copies only the peer blocks (the own window keeps `into`'s sevens), and
    place_own on XLA's stream completes the tiled all-to-all's bits."""
    g = len(gpus())
    b, t, h, d = 2, 16, 4 * g, 32
    x = data(g, b, t, h, d, jnp.float32, seed=4)
    src, dst = Window(2, h // g, 0, h // g), Window(1, t, 0, t)
    skip = lambda x: exchange(x, src=src, dst=dst, into=jnp.full((b, g * t, h // g, d), 7.0, jnp.float32), own=False)
    got, _ = run(skip, g, x)
    want, _ = run(tiled, g, x)
    got, want = got.reshape(b, g, g * t, h // g, d), want.reshape(b, g, g * t, h // g, d)
    for r in range(g):
        mine = slice(r * t, (r + 1) * t)
        assert (got[:, r, mine] == 7.0).all()
        np.testing.assert_array_equal(np.delete(got[:, r], np.arange(r * t, (r + 1) * t), axis=1),
                                      np.delete(want[:, r], np.arange(r * t, (r + 1) * t), axis=1))
    placed, _ = run(lambda x: place_own(x, skip(x), ("sp",), src, dst), g, x)
    np.testing.assert_array_equal(placed, want.reshape(placed.shape))


def test_window_forty_in_a_row():
    """40 dependent exchanges in one program (the board's slots and events reused): sequence blocks to sequence
    blocks (split and concat axis 1, shape kept), against jax.lax.all_to_all chained the same way."""
    g = len(gpus())
    b, t, h, d = 1, 8, 4, 64  # local (B, G t, h, D): block j of t rows goes to member j
    x = data(g, b, g * t, h, d, jnp.float32, seed=3)
    ours = lambda x: exchange(x, src=Window(1, t, 0, t), dst=Window(1, t, 0, t), out_shape=(b, g * t, h, d))
    lax_a2a = lambda x: jax.lax.all_to_all(x, "sp", 1, 1, tiled=True)

    def chain(f):
        def body(x):
            for i in range(40):
                x = f(x) * 1.5 + i  # dependent, and no two steps alike
            return x
        return body

    got, _ = run(chain(ours), g, x)
    want, _ = run(chain(lax_a2a), g, x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunks,own,half", [("1", "xla", "0"), ("4", "xla", "0"), ("4", "copy", "0"),
                                             ("2", "xla", "1")])
@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_windowed_matches_reference(monkeypatch, chunks, own, half, causal):
    """Ulysses with PK_JAX_ULYSSES_A2A=async over copy engines: every exchange windowed (no chunk slices or
    assembly), each own block placed by XLA or copied on the side stream (PK_JAX_WINDOW_OWN), equal chunks or
    half-width first and last ones (PK_JAX_ULYSSES_HALF_ENDS), forward and gradients vs the float32 reference on
    every GPU."""
    from .test_context_gpu import TOL, assert_close, random_qkv, reference, sharded

    monkeypatch.setenv("PK_JAX_ULYSSES_CHUNKS", chunks)
    monkeypatch.setenv("PK_JAX_WINDOW_OWN", own)
    monkeypatch.setenv("PK_JAX_ULYSSES_HALF_ENDS", half)
    monkeypatch.setenv("PK_JAX_ULYSSES_A2A", "async")
    g = len(gpus())
    heads = 8 * g
    q, k, v, d_out = random_qkv(g * 7 + causal, 2, g * 256, heads, heads // 2, 64)
    attn = lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp", causal=causal)
    spec = jax.ShapeDtypeStruct((2, g * 256, heads, 64), jnp.bfloat16, sharding=NamedSharding(mesh(g), P(None, "sp")))
    kv_spec = jax.ShapeDtypeStruct((2, g * 256, heads // 2, 64), jnp.bfloat16,
                                   sharding=NamedSharding(mesh(g), P(None, "sp")))
    f = jax.jit(jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp")))
    hlo = f.lower(spec, kv_spec, kv_spec).compile().as_text()
    assert "pk_exchange_start" in hlo and "pk_ring_shift_start" not in hlo
    got = sharded(attn, g, "contiguous", jnp.bfloat16, q, k, v, d_out)
    assert_close(got, reference(q, k, v, d_out, causal), TOL[jnp.bfloat16], f"ulysses windowed {chunks} G={g}")


@pytest.mark.parametrize("barrier", ["none", "chunks"])
@pytest.mark.parametrize("mode", ["auto", "async"])
def test_ulysses_windowed_cudnn_gradients(monkeypatch, mode, barrier):
    """The windowed pipeline with cuDNN's attention between (what `auto` runs at G 2; `async` over copy engines at
    every G), with and without the backward's barrier (PK_JAX_ULYSSES_BWD_BARRIER), forward and gradients vs the
    float32 reference (a barrier over the VJPs' residuals made XLA segfault compiling this, 2x H200 2026-11-26)."""
    from .test_context_gpu import TOL, assert_close, random_qkv, reference, sharded

    monkeypatch.setenv("PK_JAX_ULYSSES_A2A", mode)
    monkeypatch.setenv("PK_JAX_ULYSSES_BWD_BARRIER", barrier)
    g = 2 if mode == "auto" else len(gpus())
    heads = 4 * g
    q, k, v, d_out = random_qkv(g + 61, 2, g * 256, heads, heads, 128)
    attn = lambda a, b, c: pk_jax.ulysses_attention(a, b, c, "sp", implementation="cudnn")
    spec = jax.ShapeDtypeStruct(q.shape, jnp.bfloat16, sharding=NamedSharding(mesh(g), P(None, "sp")))
    loss = lambda a, b, c: jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))(
        a, b, c).astype(jnp.float32).sum()
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile().as_text()
    assert 'custom_call_target="pk_exchange_start"' in hlo
    got = sharded(attn, g, "contiguous", jnp.bfloat16, q, k, v, d_out)
    assert_close(got, reference(q, k, v, d_out, False), TOL[jnp.bfloat16], f"ulysses windowed cuDNN {mode} G={g}")


def _four_chunks_of_ours(monkeypatch):
    """Windowed Ulysses in 4 head chunks with our attention kernels: (G, chunks, the q/k/v spec, the call)."""
    monkeypatch.setenv("PK_JAX_ULYSSES_CHUNKS", "4")
    monkeypatch.setenv("PK_JAX_ULYSSES_A2A", "async")
    monkeypatch.setenv("PK_JAX_ULYSSES_LOCAL", "pk")
    g = len(gpus())
    spec = jax.ShapeDtypeStruct((2, g * 256, 8 * g, 64), jnp.bfloat16, sharding=NamedSharding(mesh(g), P(None, "sp")))
    return g, 4, spec, lambda a, b, c_: pk_jax.ulysses_attention(a, b, c_, "sp")


def test_ulysses_windowed_compiled_order(monkeypatch):
    """The overlap survives XLA's scheduling (forward, 4 chunks, our attention kernel): before chunk k's attention,
    exactly the waits for chunks 0..k's inputs and chunks 0..k-2's outputs have run, and chunk k+1's input
    exchanges have started, so they move under it."""
    g, c, spec, attn = _four_chunks_of_ours(monkeypatch)
    f = jax.jit(jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp")))
    hlo = f.lower(spec, spec, spec).compile().as_text()
    kinds = []
    for ln in hlo[hlo.index("ENTRY"):].splitlines():
        for target, kind in (("pk_exchange_start", "S"), ("pk_ring_shift_done", "D"), ("pk_attention", "A")):
            if f'custom_call_target="{target}"' in ln:
                kinds.append(kind)
    print("compiled order:", "".join(kinds))
    attn_at = [i for i, k in enumerate(kinds) if k == "A"]
    assert len(attn_at) == c and kinds.count("S") == 4 * c and kinds.count("D") == 4 * c, kinds
    for k, at in enumerate(attn_at):
        before = kinds[:at]
        assert before.count("D") == 3 * (k + 1) + max(0, k - 1), (k, "".join(kinds))
        assert before.count("S") >= 3 * min(k + 2, c) + k, (k, "".join(kinds))


def test_ulysses_prefill_placed_under_the_first_exchange(monkeypatch):
    """PK_JAX_ULYSSES_PREFILL (default 4; 3 of 4 chunks here): in the compiled forward, every placement of an own
    block into a pk_uninitialized buffer runs after chunk 0's three exchange starts and before its first wait, so it
    fills time XLA's stream spends waiting and leaves the stream between the attention kernels."""
    import re

    g, c, spec, attn = _four_chunks_of_ours(monkeypatch)
    f = jax.jit(jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp")))
    lines = f.lower(spec, spec, spec).compile().as_text()
    lines = lines[lines.index("ENTRY"):].splitlines()
    at = lambda target: [i for i, ln in enumerate(lines) if f'custom_call_target="{target}"' in ln]
    buffers = [lines[i].split("=")[0].strip() for i in at("pk_uninitialized")]
    assert len(buffers) == 3 * (c - 1), buffers
    users = [i for i, ln in enumerate(lines) for b in buffers
             if re.search(re.escape(b) + r"\b", ln.split("=", 1)[-1]) and not ln.strip().startswith(b + " ")]
    starts, dones = at("pk_exchange_start"), at("pk_ring_shift_done")
    print("placements at", users, "starts", starts[:3], "first wait", dones[0])
    assert len(users) >= len(buffers) and all(starts[2] < i < dones[0] for i in users), (users, starts[:3], dones[0])


def test_ulysses_windowed_backward_after_every_forward_chunk(monkeypatch):
    """fwd+bwd (4 chunks, our attention kernels) with PK_JAX_ULYSSES_BWD_BARRIER=chunks: every chunk's forward
    attention runs before the first backward kernel in the compiled order, so the backward's exchanges do not
    queue behind deferred forward ones (without a barrier XLA deferred chunks 1.. into the backward, 2x H100: most
    copies ran exposed; a barrier over the whole output compiled to ABABABAB at G 4)."""
    monkeypatch.setenv("PK_JAX_ULYSSES_BWD_BARRIER", "chunks")
    g, c, spec, attn = _four_chunks_of_ours(monkeypatch)
    loss = lambda q, k, v: jax.shard_map(attn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp"))(
        q, k, v).astype(jnp.float32).sum()
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile().as_text()
    kinds = [("B" if 'custom_call_target="pk_attention_bwd' in ln else "A")
             for ln in hlo[hlo.index("ENTRY"):].splitlines() if 'custom_call_target="pk_attention' in ln]
    print("compiled order:", "".join(kinds))
    assert kinds.count("A") == c and kinds.count("B") == c, kinds
    assert "".join(kinds) == "A" * c + "B" * c, "".join(kinds)


def test_ulysses_default_on_a_sub_axis(monkeypatch):
    """4+ GPUs: Ulysses at defaults over the size-2 "sp" axis of a (G/2, 2) mesh (sequence over "sp", batch over
    "dp"): the automatic windowed pipeline runs on each pair's own copy-engine board, forward and gradients vs
    the float32 reference."""
    from .test_context_gpu import TOL, assert_close, random_qkv, reference

    monkeypatch.delenv("PK_JAX_RING_SHIFT_ENGINE")  # defaults: the ring's engine plays no part
    n = len(gpus()) // 2 * 2
    if n < 4:
        pytest.skip("needs 4 GPUs (two pairs)")
    m = Mesh(np.array(gpus()[:n]).reshape(n // 2, 2), ("dp", "sp"))
    b, heads = n // 2, 16
    q, k, v, d_out = random_qkv(41, b, 2 * 256, heads, heads // 2, 64)
    spec = P("dp", "sp")
    f = jax.shard_map(lambda a, b_, c: pk_jax.ulysses_attention(a, b_, c, "sp"), mesh=m, in_specs=spec,
                      out_specs=spec)

    @jax.jit
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(d_out))

    put = lambda x: jax.device_put(x.astype(jnp.bfloat16), NamedSharding(m, spec))
    hlo = run.lower(*(put(x) for x in (q, k, v, d_out))).compile().as_text()
    assert 'custom_call_target="pk_exchange_start"' in hlo
    got = [np.asarray(x.astype(jnp.float32)) for x in run(*(put(x) for x in (q, k, v, d_out)))]
    assert_close(got, reference(q, k, v, d_out, False), TOL[jnp.bfloat16], f"ulysses on sp of a ({n // 2}, 2) mesh")
