"""Collectives shaped like jax.lax, run by device-initiated kernels on GPUs.

Call them inside `jax.shard_map` (any mesh axis, or a tuple of axes, of a 1-D or n-D mesh). On CUDA
they move data directly between the group's XLA buffers over NVLink; on CPU, or where the GPU path
cannot serve the call, they run the jax.lax op with the same semantics.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _layout
from pk_jax._primitive import CollectiveSpec, bind
from pk_jax.sharding import group_size, normalize_axis_name
from pk_jax.sharding.mesh_groups import AxisName

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# all_reduce switches from one-shot (every rank sums everything: fewest handshakes) to two-shot
# (reduce-scatter then all-gather: 2(G-1)/G of the bytes per GPU) above this many bytes per GPU.
TWO_SHOT_MIN_BYTES = 1 << 20


def _check_array(fn: str, x) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"pk_jax.{fn}: x has dtype {x.dtype}; supported dtypes are {names}. "
                        f"Cast x first, e.g. x.astype(jnp.bfloat16).")
    return x


def _check_axis(fn: str, arg: str, value: int, ndim: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"pk_jax.{fn}: {arg} must be an int, got {value!r}")
    if not -ndim <= value < ndim:
        raise ValueError(f"pk_jax.{fn}: {arg}={value} is out of range for an array of rank {ndim} "
                         f"(valid: {-ndim}..{ndim - 1})")
    return int(value) % ndim


Transport = Literal["auto", "push", "pull"]
# Which way copies cross NVLink: "push" (remote stores into the receivers' outputs) or "pull"
# (remote loads from the senders' inputs). "auto" picks DEFAULT_TRANSPORT (measured: see README).
DEFAULT_TRANSPORT = "push"


def _transport_variant(fn: str, transport: str) -> int:
    if transport not in ("auto", "push", "pull"):
        raise ValueError(f"pk_jax.{fn}: transport={transport!r}; use 'auto', 'push' or 'pull'")
    return int((DEFAULT_TRANSPORT if transport == "auto" else transport) == "pull")


def _check_split(fn: str, arg: str, value: int, x: jax.Array, g: int, tiled: bool) -> int:
    """The dimension cut into G blocks: divisible by G (tiled) or equal to G (not tiled)."""
    if x.ndim == 0:
        raise ValueError(f"pk_jax.{fn}: x must have rank >= 1")
    dim = _check_axis(fn, arg, value, x.ndim)
    n = x.shape[dim]
    if tiled and n % g:
        raise ValueError(f"pk_jax.{fn}: x.shape[{dim}]={n} ({arg}) is not divisible by the group size {g}; "
                         f"pad it to a multiple of {g}.")
    if not tiled and n != g:
        raise ValueError(f"pk_jax.{fn}: with tiled=False, x.shape[{dim}]={n} ({arg}) must equal the group "
                         f"size {g}; use tiled=True to split it into blocks.")
    return dim


def all_gather(x: jax.Array, axis_name: AxisName, *, axis: int = 0, tiled: bool = False,
               transport: Transport = "auto") -> jax.Array:
    """Gathers x from every member of the group, like `jax.lax.all_gather`.

    Args:
      x: this device's block, any shape `s` (bf16, fp16 or fp32).
      axis_name: mesh axis name, or tuple of names (major first), of the group.
      axis: where the blocks go. Any axis, including the last, without transposes.
      tiled: False stacks the G blocks in a new axis at `axis` (shape s[:axis] + (G,) + s[axis:]);
        True concatenates them along `axis` (shape s with s[axis] * G).
      transport: "push", "pull" or "auto" (see DEFAULT_TRANSPORT); results are identical.

    Returns:
      The gathered array, identical on every member.
    """
    x = _check_array("all_gather", x)
    g = group_size(axis_name)
    if x.ndim == 0 and tiled:
        raise ValueError("pk_jax.all_gather: tiled=True needs x of rank >= 1 (x is a scalar)")
    axis = _check_axis("all_gather", "axis", axis, x.ndim if tiled else x.ndim + 1)
    variant = _transport_variant("all_gather", transport)
    out, box = _layout.all_gather_box(x.shape, axis, tiled, g, x.dtype.itemsize)
    return _run("all_gather", x, axis_name, out, box, variant, (("axis", axis), ("tiled", tiled)))


def reduce_scatter(x: jax.Array, axis_name: AxisName, *, scatter_dimension: int = 0,
                   tiled: bool = False) -> jax.Array:
    """Sums x over the group and keeps this member's block, like `jax.lax.psum_scatter`.

    Args:
      x: this device's full-size contribution, shape `s`.
      axis_name: mesh axis name or tuple of names of the group (size G).
      scatter_dimension: the dimension that is split into G blocks; any, including the last.
      tiled: True: s[scatter_dimension] must be divisible by G and shrinks by G. False: it must
        equal G and is removed.

    Returns:
      Block `rank` of the sum. Sums run in float32 in rank order, so every member's block is
      computed with the same rounding.
    """
    x = _check_array("reduce_scatter", x)
    g = group_size(axis_name)
    dim = _check_split("reduce_scatter", "scatter_dimension", scatter_dimension, x, g, tiled)
    out, box = _layout.reduce_scatter_box(x.shape, dim, tiled, g, x.dtype.itemsize)
    return _run("reduce_scatter", x, axis_name, out, box, 0,
                (("scatter_dimension", dim), ("tiled", tiled)))


def all_reduce(x: jax.Array, axis_name: AxisName, *,
               algorithm: Literal["auto", "one_shot", "two_shot"] = "auto") -> jax.Array:
    """Sums x over the group, like `jax.lax.psum`.

    Args:
      x: any shape.
      axis_name: mesh axis name or tuple of names of the group (size G).
      algorithm: "one_shot" (every member reads all G inputs: lowest latency), "two_shot" (each
        member reduces 1/G and broadcasts it: least traffic), or "auto" (two-shot from
        TWO_SHOT_MIN_BYTES up, when the array splits into G whole 16-byte chunks).

    Returns:
      The sum, bitwise identical on every member (float32 accumulation in rank order).
    """
    x = _check_array("all_reduce", x)
    g = group_size(axis_name)
    if algorithm not in ("auto", "one_shot", "two_shot"):
        raise ValueError(f"pk_jax.all_reduce: algorithm={algorithm!r}; use 'auto', 'one_shot' or 'two_shot'")
    out, two = _layout.all_reduce_box(x.shape, g, x.dtype.itemsize, two_shot=True)
    use_two = algorithm == "two_shot" or (
        algorithm == "auto" and x.size * x.dtype.itemsize >= TWO_SHOT_MIN_BYTES
        and two is not None and two.vec_bytes == 16)
    if use_two and two is None:
        raise ValueError(f"pk_jax.all_reduce: algorithm='two_shot' needs x.size ({x.size}) divisible by the "
                         f"group size {g}; use 'auto' or 'one_shot'.")
    box = two if use_two else _layout.all_reduce_box(x.shape, g, x.dtype.itemsize, two_shot=False)[1]
    return _run("all_reduce", x, axis_name, out, box, int(use_two), ())


def all_to_all(x: jax.Array, axis_name: AxisName, split_axis: int, concat_axis: int, *,
               tiled: bool = False, transport: Transport = "auto") -> jax.Array:
    """Sends block p of x along `split_axis` to member p, like `jax.lax.all_to_all`.

    Args:
      x: this device's array, shape `s`.
      axis_name: mesh axis name or tuple of names of the group (size G).
      split_axis: dimension cut into G blocks (block p goes to member p).
      concat_axis: dimension along which received blocks are placed in sender order.
      tiled: True: s[split_axis] must be divisible by G; the output has s[split_axis] / G and
        s[concat_axis] * G. False: s[split_axis] must equal G; the output drops split_axis and
        has a new axis of size G at concat_axis.
      transport: "push", "pull" or "auto" (see DEFAULT_TRANSPORT); results are identical.

    Returns:
      The exchanged array, e.g. (B, S/G, H, D) -> (B, S, H/G, D) with split_axis=2, concat_axis=1,
      tiled=True: sequence gathered, heads scattered, with no transposes.
    """
    x = _check_array("all_to_all", x)
    g = group_size(axis_name)
    split = _check_split("all_to_all", "split_axis", split_axis, x, g, tiled)
    concat = _check_axis("all_to_all", "concat_axis", concat_axis, x.ndim)
    variant = _transport_variant("all_to_all", transport)
    out, box = _layout.all_to_all_box(x.shape, split, concat, tiled, g, x.dtype.itemsize)
    return _run("all_to_all", x, axis_name, out, box, variant,
                (("split_axis", split), ("concat_axis", concat), ("tiled", tiled)))


def _run(op: str, x: jax.Array, axis_name: AxisName, out_shape, box, variant: int, lax_kwargs) -> jax.Array:
    if math.prod(out_shape) == 0 or group_size(axis_name) < 2:
        box = None  # nothing to move between GPUs: jax.lax handles it locally
    spec = CollectiveSpec(op, normalize_axis_name(axis_name), tuple(out_shape), box, variant, tuple(lax_kwargs))
    return bind(x, spec)
