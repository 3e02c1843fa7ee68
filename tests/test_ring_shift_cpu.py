"""The asynchronous ring shift on 8 virtual CPU devices (its lax.ppermute fallback): values, two shifts in
flight, the primitives in ring attention's jaxpr, the compiled order (start before the step's attention,
the next block's use after it), the "xla" transport switch, and the SMs the attention leaves free."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.context import ring_shift
from pk_jax.context.ring_shift import after_token, shift_done, shift_start


def mesh(g: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:g]), ("sp",))


def run_sharded(fn, g: int, *xs):
    f = jax.shard_map(fn, mesh=mesh(g), in_specs=P("sp"), out_specs=P("sp"))
    return [np.asarray(y) for y in jax.jit(f)(*xs)]


def member_blocks(g: int, shape=(3, 8), dtype=np.float32, seed=0):
    """(G * shape[0], shape[1]) array whose block r belongs to member r."""
    return np.random.default_rng(seed).standard_normal((g * shape[0], *shape[1:])).astype(dtype)


def rolled(x: np.ndarray, g: int) -> np.ndarray:
    """Member r's block moved to member r+1 (what the shift computes)."""
    return np.roll(x.reshape(g, -1, *x.shape[1:]), 1, axis=0).reshape(x.shape)


@pytest.mark.parametrize("g", [2, 4, 8])
def test_shift_moves_each_block_one_member_on(g):
    a, b = member_blocks(g), member_blocks(g, (3, 5), np.int32, seed=1)

    def f(a, b):
        ys, token = shift_start((a, b), ("sp",))
        return shift_done(ys, token, keep_alive=(a, b), after=a * 2)

    got = run_sharded(f, g, a, b)
    np.testing.assert_array_equal(got[0], rolled(a, g))
    np.testing.assert_array_equal(got[1], rolled(b, g))


def test_two_shifts_in_flight_and_work_between():
    g = 4
    a, b = member_blocks(g), member_blocks(g, seed=2)

    def f(a, b):
        ya, ta = shift_start((a,), ("sp",))
        yb, tb = shift_start((b,), ("sp",))
        work = after_token(a + b, ta, tb) * 3          # runs while both are in flight
        (ya,) = shift_done(ya, ta, keep_alive=a, after=work)
        (yb,) = shift_done(yb, tb, keep_alive=b, after=work)
        return ya, yb, work

    ya, yb, work = run_sharded(f, g, a, b)
    np.testing.assert_array_equal(ya, rolled(a, g))
    np.testing.assert_array_equal(yb, rolled(b, g))
    np.testing.assert_allclose(work, (a + b) * 3)


def test_group_of_one_is_identity_and_argument_count_is_checked():
    a = member_blocks(1)

    def f(a):
        ys, token = shift_start((a,), ("sp",))
        return shift_done(ys, token)

    np.testing.assert_array_equal(run_sharded(f, 1, a)[0], a)
    with pytest.raises(ValueError, match="1..4 arrays"):
        jax.make_jaxpr(jax.shard_map(lambda x: shift_start((x,) * 5, ("sp",))[0][0], mesh=mesh(2),
                                     in_specs=P("sp"), out_specs=P("sp")))(member_blocks(2))


def _ring(g: int, dtype=jnp.bfloat16, t: int = 64, h: int = 64):
    spec = jax.ShapeDtypeStruct((1, g * t, 4, h), dtype)
    fn = lambda q, k, v: pk_jax.ring_attention(q, k, v, "sp", causal=True)
    return jax.shard_map(fn, mesh=mesh(g), in_specs=P(None, "sp"), out_specs=P(None, "sp")), spec


@pytest.mark.parametrize("g", [2, 4])
def test_ring_attention_uses_the_shift_primitives(g, monkeypatch):
    monkeypatch.delenv("PK_JAX_RING_TRANSPORT", raising=False)
    monkeypatch.delenv("PK_JAX_RING_RESERVE_SMS", raising=False)
    f, spec = _ring(g)
    fwd = str(jax.make_jaxpr(f)(spec, spec, spec))
    assert fwd.count("pk_ring_shift_start") == g - 1  # the last step sends nothing
    assert fwd.count("pk_ring_shift_done") == g - 1
    assert "ppermute" not in fwd
    assert "engine=copy" in fwd and "reserve_sms=0" in fwd  # the default copy engines take no SM
    monkeypatch.setenv("PK_JAX_RING_SHIFT_ENGINE", "sm")
    f_sm, _ = _ring(g)  # traced afresh: the setting is read when traced
    assert "reserve_sms=8" in str(jax.make_jaxpr(f_sm)(spec, spec, spec))  # the shift kernel's SMs left free
    monkeypatch.delenv("PK_JAX_RING_SHIFT_ENGINE")
    grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2))
    bwd = str(jax.make_jaxpr(grad)(spec, spec, spec))
    # forward G-1, backward: G-1 K/V shifts and G-1 accumulator hops
    assert bwd.count("pk_ring_shift_start") == (g - 1) + 2 * (g - 1)


def test_xla_transport_keeps_the_ppermute_ring(monkeypatch):
    monkeypatch.setenv("PK_JAX_RING_TRANSPORT", "xla")
    monkeypatch.delenv("PK_JAX_RING_RESERVE_SMS", raising=False)
    f, spec = _ring(2)
    jaxpr = str(jax.make_jaxpr(f)(spec, spec, spec))
    assert "pk_ring_shift" not in jaxpr and "ppermute" in jaxpr and "reserve_sms=0" in jaxpr


def test_bad_settings_are_named(monkeypatch):
    f, spec = _ring(2)
    monkeypatch.setenv("PK_JAX_RING_TRANSPORT", "nccl")
    with pytest.raises(ValueError, match="PK_JAX_RING_TRANSPORT"):
        jax.make_jaxpr(f)(spec, spec, spec)
    monkeypatch.setenv("PK_JAX_RING_TRANSPORT", "pk")
    monkeypatch.setenv("PK_JAX_RING_SHIFT_CTAS", "0")
    with pytest.raises(ValueError, match="PK_JAX_RING_SHIFT_CTAS"):
        jax.make_jaxpr(f)(spec, spec, spec)
    monkeypatch.setenv("PK_JAX_RING_SHIFT_CTAS", "8")
    monkeypatch.setenv("PK_JAX_RING_SHIFT_UNROLL", "6")
    with pytest.raises(ValueError, match="PK_JAX_RING_SHIFT_UNROLL"):
        jax.make_jaxpr(f)(spec, spec, spec)


def test_compiled_order_overlaps_the_transfer_with_the_step(monkeypatch):
    """In the compiled CPU program (G = 2, float32: the XLA block path), the shift (its collective-permute
    fallback) comes before step 0's first score product, and step 1's products read the shifted block after
    step 0's merge: XLA kept start before the attention and done after it."""
    monkeypatch.delenv("PK_JAX_RING_TRANSPORT", raising=False)
    f, spec = _ring(2, jnp.float32, t=32, h=16)
    hlo = jax.jit(f).lower(spec, spec, spec).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    lines = [ln.strip() for ln in entry.splitlines()]
    permutes = [i for i, ln in enumerate(lines) if "collective-permute(" in ln]
    assert len(permutes) == 2, "one shift of (k, v) at G = 2"
    names = [re.match(r"%?([\w.\-]+) =", lines[i]).group(1) for i in permutes]
    uses = lambda ln: "=" in ln and any(re.search(rf"%{re.escape(n)}\b", ln.split("=", 1)[1]) for n in names)
    first_use = min(i for i, ln in enumerate(lines) if uses(ln))
    compute = [i for i, ln in enumerate(lines) if "fusion(" in ln and i < first_use and i > max(permutes)]
    assert max(permutes) < first_use, "the shifted block is read after the shift"
    assert compute, "step 0's work sits between the shift's start and the first read of its result"


def test_ring_shift_env_defaults(monkeypatch):
    monkeypatch.delenv("PK_JAX_RING_TRANSPORT", raising=False)
    monkeypatch.delenv("PK_JAX_RING_SHIFT_CTAS", raising=False)
    assert ring_shift.transport() == "pk" and ring_shift.shift_ctas() == 8
    monkeypatch.setenv("PK_JAX_RING_SHIFT_CTAS", "16")
    assert ring_shift.shift_ctas() == 16
    monkeypatch.delenv("PK_JAX_RING_SHIFT_UNROLL", raising=False)
    assert ring_shift.shift_unroll() == 4
    monkeypatch.setenv("PK_JAX_RING_SHIFT_UNROLL", "16")
    assert ring_shift.shift_unroll() == 16
    f, spec = _ring(2)
    assert "unroll=16" in str(jax.make_jaxpr(f)(spec, spec, spec)), "the setting reaches the shift primitive"


def test_shift_engine_setting(monkeypatch):
    """PK_JAX_RING_SHIFT_ENGINE: "copy" by default, which reaches the primitive and frees the SMs the ring's
    attention would leave to the shift kernel (multi-process jobs keep the kernel and its SMs); "sm" reserves them;
    anything else is refused by name."""
    import pk_jax.distributed
    from pk_jax.context import ring

    for var in ("PK_JAX_RING_SHIFT_ENGINE", "PK_JAX_RING_TRANSPORT", "PK_JAX_RING_RESERVE_SMS", "PK_JAX_RING_SHIFT_CTAS"):
        monkeypatch.delenv(var, raising=False)
    assert ring_shift.shift_engine() == "copy" and ring_shift.shift_sms() == 0 and ring.reserve_sms() == 0
    monkeypatch.setenv("PK_JAX_RING_SHIFT_ENGINE", "sm")
    assert ring.reserve_sms() == 8
    monkeypatch.setenv("PK_JAX_RING_SHIFT_ENGINE", "copy")
    with monkeypatch.context() as m:
        m.setattr(pk_jax.distributed, "is_multiprocess", lambda: True)
        assert ring_shift.shift_sms() == 8, "multi-process jobs run the kernel whatever the setting: SMs reserved"
    f, spec = _ring(2)
    assert "engine=copy" in str(jax.make_jaxpr(f)(spec, spec, spec)), "the setting reaches the shift primitive"
    monkeypatch.setenv("PK_JAX_RING_SHIFT_ENGINE", "dma")
    with pytest.raises(ValueError, match="PK_JAX_RING_SHIFT_ENGINE"):
        ring_shift.shift_engine()
