"""A Llama-style transformer layer with tensor and sequence parallelism (Megatron-SP), written once and
run with either pk_jax's fused ops or the plain XLA composition (jnp.dot + jax.lax collectives).

Per member of a group of G over mesh axis `axis`, x is (T/G, d), sequence-sharded:

  h = rms_norm(x)                       (T/G, d)
  qkv = AG(h) @ wqkv                    (T, (H/G + 2 KV/G) hd)    all_gather_matmul
  a = causal attention on local heads   (T, H/G hd)               jax.nn.dot_product_attention (XLA)
  x = x + RS(a @ wo)                    (T/G, d)                  matmul_reduce_scatter
  h = rms_norm(x)
  x = x + mlp_block(h)                  gelu: RS(gelu(AG(h) w1) w2); swiglu: RS(silu(AG(h) wg) * AG(h) wu w2)

No rotary embedding (elementwise; it does not change the GEMMs or their communication). Attention runs
one KV head (with its group of query heads) at a time under jax.checkpoint, so its float32 T x T
logits exist for one KV head at once and are recomputed in the backward pass instead of stored: at
Llama-3-70B widths and T = 16384 the logits of all 64 heads take 69 GB, and the softmax and its
gradient as much again. Both implementations share this attention; only the GEMMs differ.

Global parameter layout: a shard's columns (rows for wo, w2) are contiguous, so wqkv (d, G cols) holds
per shard [q heads | k heads | v heads] and w13 (swiglu) per shard [gate | up]; `reference_layer`
undoes that for the un-sharded float32 reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pk_jax


@dataclasses.dataclass(frozen=True)
class LayerShape:
    name: str
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int = 128
    mlp: str = "gelu"  # "gelu" (w1, w2) or "swiglu" (w13 = [gate | up], w2)

    def local(self, group: int) -> tuple[int, int, int]:
        """(query heads, KV heads, d_ff columns) per member of a group of `group`."""
        for what, n in (("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads), ("d_ff", self.d_ff)):
            if n % group:
                raise ValueError(f"{self.name}: {what}={n} is not divisible by the group size {group}; "
                                 f"pick --group among the divisors of {self.n_kv_heads} KV heads")
        return self.n_heads // group, self.n_kv_heads // group, self.d_ff // group


LLAMA3_8B = LayerShape("llama3-8b", 4096, 14336, 32, 8)
LLAMA3_70B = LayerShape("llama3-70b", 8192, 28672, 64, 8)
WIDTHS = {s.name: s for s in (LLAMA3_8B, LLAMA3_70B)}


@dataclasses.dataclass(frozen=True)
class Ops:
    """The layer's communicating steps over `axis`: AG(x) @ w, RS(h @ w), and the cast of a replicated
    parameter (the norm scales) to varying, whose gradient is the sum over the members."""
    name: str
    ag_matmul: Callable[[jax.Array, jax.Array, str], jax.Array]
    matmul_rs: Callable[[jax.Array, jax.Array, str], jax.Array]
    to_varying: Callable[[jax.Array, str], jax.Array]


PK_OPS = Ops("pk_jax", pk_jax.all_gather_matmul, pk_jax.matmul_reduce_scatter,
             lambda w, axis: pk_jax.pcast(w, axis, to="varying"))
XLA_OPS = Ops("xla", lambda x, w, axis: jnp.dot(jax.lax.all_gather(x, axis, tiled=True), w),
              lambda h, w, axis: jax.lax.psum_scatter(jnp.dot(h, w), axis, scatter_dimension=0, tiled=True),
              lambda w, axis: jax.lax.pcast(w, axis, to="varying"))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-5) -> jax.Array:
    """x (..., d) normalized in float32, times scale (d,), in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def mlp_block(p: dict, h: jax.Array, ops: Ops, axis: str, shape: LayerShape) -> jax.Array:
    """h (T/G, d) -> (T/G, d): p["w1"] (d, f/G) and p["w2"] (f/G, d); swiglu: p["w13"] (d, 2 f/G)."""
    if shape.mlp == "gelu":
        return ops.matmul_rs(jax.nn.gelu(ops.ag_matmul(h, p["w1"], axis)), p["w2"], axis)
    gate, up = jnp.split(ops.ag_matmul(h, p["w13"], axis), 2, axis=1)
    return ops.matmul_rs(jax.nn.silu(gate) * up, p["w2"], axis)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """q (T, Hq, hd), k and v (T, Hkv, hd) -> (T, Hq, hd); one KV head group at a time, recomputed in
    the backward pass (see the module docstring)."""
    t, hq, hd = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    qs = q.reshape(t, hkv, rep, hd).transpose(1, 0, 2, 3)[:, None]  # (Hkv, 1, T, rep, hd)
    ks = k.transpose(1, 0, 2)[:, None, :, None]                       # (Hkv, 1, T, 1, hd)
    vs = v.transpose(1, 0, 2)[:, None, :, None]
    one = jax.checkpoint(lambda qkv: jax.nn.dot_product_attention(*qkv, is_causal=True, implementation=None))
    out = jax.lax.map(one, (qs, ks, vs))                                # (Hkv, 1, T, rep, hd)
    return out[:, 0].transpose(1, 0, 2, 3).reshape(t, hq, hd)


def layer(p: dict, x: jax.Array, ops: Ops, axis: str, shape: LayerShape, group: int) -> jax.Array:
    """One member's part of the layer: x (T/G, d) -> (T/G, d). Call inside jax.shard_map."""
    hq, hkv, _ = shape.local(group)
    hd = shape.head_dim
    qkv = ops.ag_matmul(rms_norm(x, ops.to_varying(p["norm1"], axis)), p["wqkv"], axis)  # (T, (hq + 2 hkv) hd)
    t = qkv.shape[0]
    q, k, v = jnp.split(qkv, [hq * hd, (hq + hkv) * hd], axis=1)
    a = causal_attention(q.reshape(t, hq, hd), k.reshape(t, hkv, hd), v.reshape(t, hkv, hd))
    x = x + ops.matmul_rs(a.reshape(t, hq * hd), p["wo"], axis)
    return x + mlp_block(p, rms_norm(x, ops.to_varying(p["norm2"], axis)), ops, axis, shape)


def param_specs(shape: LayerShape, axis: str, mlp_only: bool = False) -> dict:
    """PartitionSpecs of the global parameters: column-parallel (None, axis), row-parallel (axis, None)."""
    mlp = {"w1": P(None, axis)} if shape.mlp == "gelu" else {"w13": P(None, axis)}
    mlp["w2"] = P(axis, None)
    if mlp_only:
        return mlp
    return {"norm1": P(), "wqkv": P(None, axis), "wo": P(axis, None), "norm2": P(), **mlp}


def param_shapes(shape: LayerShape, mlp_only: bool = False) -> dict:
    """Global parameter shapes (layouts in the module docstring)."""
    d, f, hd = shape.d_model, shape.d_ff, shape.head_dim
    mlp = {"w1": (d, f)} if shape.mlp == "gelu" else {"w13": (d, 2 * f)}
    mlp["w2"] = (f, d)
    if mlp_only:
        return mlp
    return {"norm1": (d,), "wqkv": (d, (shape.n_heads + 2 * shape.n_kv_heads) * hd),
            "wo": (shape.n_heads * hd, d), "norm2": (d,), **mlp}


def init_params(key: jax.Array, shape: LayerShape, dtype, mlp_only: bool = False, shardings: dict | None = None) -> dict:
    """Random parameters (fan-in scaled normal; norm scales near 1), placed by `shardings` if given."""
    out = {}
    for i, (name, s) in enumerate(sorted(param_shapes(shape, mlp_only).items())):
        def make(k, s=s, norm=name.startswith("norm")):
            z = jax.random.normal(k, s, jnp.float32)
            return (1.0 + 0.1 * z if norm else z / (s[0] ** 0.5)).astype(dtype)
        sh = None if shardings is None else shardings[name]
        out[name] = jax.jit(make, out_shardings=sh)(jax.random.fold_in(key, i))
    return out


def reference_layer(p: dict, x: jax.Array, shape: LayerShape, group: int, mlp_only: bool = False) -> jax.Array:
    """The same layer un-sharded in float32 on the global arrays (plain jnp): x (T, d) -> (T, d)."""
    p = {k: v.astype(jnp.float32) for k, v in p.items()}
    x = x.astype(jnp.float32)
    d, hd = shape.d_model, shape.head_dim
    hq, hkv, f_l = shape.local(group)

    def mlp(h):
        if shape.mlp == "gelu":
            return jax.nn.gelu(h @ p["w1"]) @ p["w2"]
        w = p["w13"].reshape(d, group, 2, f_l)  # per shard [gate | up]
        gate, up = w[:, :, 0].reshape(d, -1), w[:, :, 1].reshape(d, -1)
        return (jax.nn.silu(h @ gate) * (h @ up)) @ p["w2"]

    if mlp_only:
        return mlp(x)
    w = p["wqkv"].reshape(d, group, (hq + 2 * hkv) * hd)  # per shard [q | k | v]
    wq = w[:, :, :hq * hd].reshape(d, -1)
    wk = w[:, :, hq * hd:(hq + hkv) * hd].reshape(d, -1)
    wv = w[:, :, (hq + hkv) * hd:].reshape(d, -1)
    h = rms_norm(x, p["norm1"])
    t = x.shape[0]
    q = (h @ wq).reshape(1, t, shape.n_heads, hd)
    k = (h @ wk).reshape(1, t, shape.n_kv_heads, hd)
    v = (h @ wv).reshape(1, t, shape.n_kv_heads, hd)
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(t, -1)
    x = x + a @ p["wo"]
    return x + mlp(rms_norm(x, p["norm2"]))


def sharded(shape: LayerShape, ops: Ops, mesh, axis: str, mlp_only: bool = False, check_vma: bool = True):
    """The layer (or only its MLP block) on the global arrays: f(params, x (T, d)) -> (T, d)."""
    group = mesh.shape[axis]
    if mlp_only:
        body = lambda p, x: mlp_block(p, x, ops, axis, shape)
    else:
        body = lambda p, x: layer(p, x, ops, axis, shape, group)
    return jax.shard_map(body, mesh=mesh, in_specs=(param_specs(shape, axis, mlp_only), P(axis)),
                         out_specs=P(axis), check_vma=check_vma)


def gemm_flops(shape: LayerShape, tokens: int, mlp_only: bool = False, backward: bool = False) -> float:
    """FLOPs of every GEMM of one step over the whole group (divide by G per GPU). Forward: QKV
    2 T d (H + 2 KV) hd, attention 4 T^2 H hd / 2 (QK^T and PV, causal: half the square), output
    2 T H hd d, MLP 2 T d f x 2 (gelu) or x 3 (swiglu). The backward pass is twice the forward (each
    GEMM has two gradient GEMMs; attention's four: dV, dP, dQ, dK). No recomputation counted."""
    t, d, f, hd = tokens, shape.d_model, shape.d_ff, shape.head_dim
    mlp = 2.0 * t * d * f * (2 if shape.mlp == "gelu" else 3)
    fwd = mlp
    if not mlp_only:
        fwd += 2.0 * t * d * (shape.n_heads + 2 * shape.n_kv_heads) * hd  # QKV projection
        fwd += 4.0 * t * t * shape.n_heads * hd / 2                       # causal attention
        fwd += 2.0 * t * shape.n_heads * hd * d                           # output projection
    return fwd * (3 if backward else 1)
