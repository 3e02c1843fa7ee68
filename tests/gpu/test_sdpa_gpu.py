"""The default library attention is cuDNN's on a GPU (pk_jax.sdpa; jax 0.11.2's own default is XLA's unfused
composition): pk_jax.attention's fallback and ulysses_attention (one member) lower to the cuDNN custom call and
match a float32 reference, forward and gradients; float32 inputs, which cuDNN refuses, run XLA's attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import pk_jax

from .attention_reference import attention_f32
from .devices import gpus

MIN_GPUS = 1


def _calls(name: str):
    if name == "attention":
        return lambda q, k, v: pk_jax.attention(q, k, v, causal=True)
    mesh = Mesh(np.array(gpus()[:1]), ("sp",))
    return jax.shard_map(lambda q, k, v: pk_jax.ulysses_attention(q, k, v, "sp", causal=True), mesh=mesh,
                         in_specs=P(None, "sp"), out_specs=P(None, "sp"))


@pytest.mark.parametrize("name", ["attention", "ulysses"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_default_attention_is_cudnn(name, dtype):
    keys = jax.random.split(jax.random.key(11), 4)
    q, k, v, d_out = (jax.random.normal(key, (2, 320, 8, 128), jnp.float32) for key in keys)
    k, v = k[:, :, :2], v[:, :, :2]  # GQA 4:1
    fn = _calls(name)
    loss = lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * d_out).sum()
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    args = [x.astype(dtype) for x in (q, k, v)]
    hlo = step.lower(*args).compile().as_text()
    assert ("__cudnn$fmha" in hlo) == (dtype == jnp.bfloat16), f"{name} {dtype.__name__}: cuDNN call present?"
    value, grads = step(*args)

    def ref_loss(q, k, v):
        out, _ = attention_f32(q, k, v, scale=1 / np.sqrt(128), causal=True, xp=jnp)
        return (out * d_out).sum()

    with jax.default_matmul_precision("highest"):
        want_value, want = jax.value_and_grad(ref_loss, argnums=(0, 1, 2))(*[x.astype(jnp.float32) for x in args])
    assert abs(float(value) - float(want_value)) < 2e-2 * float(jnp.abs(d_out).sum()) / np.sqrt(d_out.size)
    for label, a, b in zip(("dq", "dk", "dv"), grads, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert np.isfinite(a).all() and err < 2e-2, f"{name} {dtype.__name__} {label}: rel err {err:.2e}"
