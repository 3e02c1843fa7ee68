"""Collectives shaped like jax.lax, run by device-initiated kernels on GPUs.

Call them inside `jax.shard_map` (any mesh axis, or a tuple of axes, of a 1-D or n-D mesh). On CUDA
they move data directly between the group's XLA buffers over NVLink; on CPU, or where the GPU path
cannot serve the call, they run the jax.lax op with the same semantics.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config, core
from jax._src.lax.parallel import insert_collective_pvary

from pk_jax import _layout, _small_path, runtime
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


Algorithm = Literal["auto", "small", "bulk"]


def _small_path_requested(fn: str, algorithm: str, fits: bool, why_not: str) -> bool:
    """all_gather / reduce_scatter: whether to take the small-message path (see pk_jax._small_path)."""
    if algorithm not in ("auto", "small", "bulk"):
        raise ValueError(f"pk_jax.{fn}: algorithm={algorithm!r}; use 'auto', 'small' or 'bulk'")
    if algorithm == "small" and not fits:
        raise ValueError(f"pk_jax.{fn}: algorithm='small' cannot serve this call: {why_not}; "
                         f"use algorithm='auto' or 'bulk'.")
    return fits and (algorithm == "small" or (algorithm == "auto" and _small_path.auto_enabled()))


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
               transport: Transport = "auto", algorithm: Algorithm = "auto") -> jax.Array:
    """Gathers x from every member of the group, like `jax.lax.all_gather`.

    Args:
      x: this device's block, any shape `s` (bf16, fp16 or fp32).
      axis_name: mesh axis name, or tuple of names (major first), of the group.
      axis: where the blocks go. Any axis, including the last, without transposes.
      tiled: False stacks the G blocks in a new axis at `axis` (shape s[:axis] + (G,) + s[axis:]);
        True concatenates them along `axis` (shape s with s[axis] * G).
      transport: "push", "pull" or "auto" (see DEFAULT_TRANSPORT); results are identical.
      algorithm: "small" (LL lines into the peers' control blocks: one trip, no handshakes; x at
        most _small_path.SMALL_MAX_BYTES and the blocks contiguous, i.e. all dims before `axis` of
        size 1), "bulk" (the copy kernel), or "auto" (small while (G-1) x x's bytes <=
        _small_path.AUTO_SEND_BYTES, unless PK_JAX_SMALL_PATH=0). Results are identical.

    Returns:
      The gathered array, identical on every member.
    """
    x = _check_array("all_gather", x)
    g = group_size(axis_name)
    if x.ndim == 0 and tiled:
        raise ValueError("pk_jax.all_gather: tiled=True needs x of rank >= 1 (x is a scalar)")
    axis = _check_axis("all_gather", "axis", axis, x.ndim if tiled else x.ndim + 1)
    variant = _transport_variant("all_gather", transport)
    nbytes = x.size * x.dtype.itemsize
    contiguous = _small_path.blocks_contiguous(x.shape, axis)
    fits = contiguous and _small_path.copy_fits(nbytes, g, auto=algorithm == "auto")
    why = (f"the blocks along axis {axis} are not contiguous (dims before it are not all 1)" if not contiguous
           else f"x has {nbytes} bytes (small path: 1..{_small_path.SMALL_MAX_BYTES})")
    if _small_path_requested("all_gather", algorithm, fits, why):
        variant = _small_path.VARIANT_SMALL
    out, box = _layout.all_gather_box(x.shape, axis, tiled, g, x.dtype.itemsize)
    return _run("all_gather", x, axis_name, out, box, variant, (("axis", axis), ("tiled", tiled)))


def reduce_scatter(x: jax.Array, axis_name: AxisName, *, scatter_dimension: int = 0,
                   tiled: bool = False, algorithm: Algorithm = "auto") -> jax.Array:
    """Sums x over the group and keeps this member's block, like `jax.lax.psum_scatter`.

    Args:
      x: this device's full-size contribution, shape `s`.
      axis_name: mesh axis name or tuple of names of the group (size G).
      scatter_dimension: the dimension that is split into G blocks; any, including the last.
      tiled: True: s[scatter_dimension] must be divisible by G and shrinks by G. False: it must
        equal G and is removed.
      algorithm: "small" (LL lines: one trip, no handshakes; a block of at most
        _small_path.SMALL_MAX_BYTES, contiguous: all dims before scatter_dimension of size 1),
        "bulk" (the pull-reduce kernel), or "auto" (small while (G-1) x the block's bytes <=
        _small_path.AUTO_SEND_BYTES, unless PK_JAX_SMALL_PATH=0). Both sum in float32 in
        rank order: identical bits.

    Returns:
      Block `rank` of the sum. Sums run in float32 in rank order, so every member's block is
      computed with the same rounding.
    """
    x = _check_array("reduce_scatter", x)
    g = group_size(axis_name)
    dim = _check_split("reduce_scatter", "scatter_dimension", scatter_dimension, x, g, tiled)
    out, box = _layout.reduce_scatter_box(x.shape, dim, tiled, g, x.dtype.itemsize)
    block_bytes = x.size * x.dtype.itemsize // g
    contiguous = _small_path.blocks_contiguous(x.shape, dim)
    fits = contiguous and _small_path.copy_fits(block_bytes, g, auto=algorithm == "auto")
    why = (f"the blocks along scatter_dimension {dim} are not contiguous (dims before it are not all 1)"
           if not contiguous else f"a block has {block_bytes} bytes (small path: 1..{_small_path.SMALL_MAX_BYTES})")
    variant = _small_path.VARIANT_SMALL if _small_path_requested("reduce_scatter", algorithm, fits, why) else 0
    return _run("reduce_scatter", x, axis_name, out, box, variant,
                (("scatter_dimension", dim), ("tiled", tiled)))


AllReduceAlgorithm = Literal["auto", "one_shot", "two_shot", "small", "small_one_shot", "small_two_shot",
                             "small_chunked", "small_pipelined", "small_ll128"]


def all_reduce(x: jax.Array, axis_name: AxisName, *, algorithm: AllReduceAlgorithm = "auto") -> jax.Array:
    """Sums x over the group, like `jax.lax.psum`.

    Args:
      x: any shape.
      axis_name: mesh axis name or tuple of names of the group (size G).
      algorithm: the bulk kernels "one_shot" (every member reads all G inputs) and "two_shot" (each
        member reduces 1/G and broadcasts it: least traffic); the small-message path (straight into the
        peers' control blocks, no handshakes): "small_one_shot" / "small_two_shot" (LL lines, x at most
        _small_path.SMALL_MAX_BYTES; two-shot: x's 4-byte words divisible by G), "small_chunked" (plain
        stores + one flag per chunk, x at most _small_path.CHUNKED_MAX_BYTES), "small_pipelined" (the
        same areas with the pushes, one signal warp's fences + flags and the sums pipelined in rounds:
        one-shot at G = 2, reduce-scatter + all-gather from G = 3; x at most CHUNKED_MAX_BYTES; knobs
        PK_JAX_AR_PIPELINED_*, pk_jax/_pipelined_schedule.py), "small_ll128" (128-byte LL lines:
        120 payload bytes + a flag each, no fence; one trip, or two from G = 3 and 256 KiB (reduce-scatter +
        all-gather of lines); x at most CHUNKED_MAX_BYTES, 8-byte aligned
        buffers; it relies on NVLink delivering a warp's 128-byte line whole, as NCCL's LL128 does: on PCIe-only
        peers set PK_JAX_AR_LL128=0) or "small" (picks one of those by size and
        G: _small_path.all_reduce_choice, which takes "small_ll128" up to _small_path.ll128_auto_max_bytes
        and "small_pipelined" from
        _small_path.PIPELINED_MIN_BYTES from G = 3, per PK_JAX_AR_PIPELINED); or "auto": the small path where
        _small_path.all_reduce_choice takes it (unless PK_JAX_SMALL_PATH=0), else two-shot from
        TWO_SHOT_MIN_BYTES up when the array splits into G whole 16-byte chunks, else one-shot.

    Returns:
      The sum, bitwise identical on every member and across algorithms (float32 accumulation in
      rank order).
    """
    x = _check_array("all_reduce", x)
    g = group_size(axis_name)
    choices = ("auto", "one_shot", "two_shot", "small", "small_one_shot", "small_two_shot", "small_chunked",
               "small_pipelined", "small_ll128")
    if algorithm not in choices:
        raise ValueError(f"pk_jax.all_reduce: algorithm={algorithm!r}; use one of {', '.join(map(repr, choices))}")
    nbytes = x.size * x.dtype.itemsize
    if algorithm == "small" or (algorithm == "auto" and _small_path.auto_enabled()):
        small = _small_path.all_reduce_choice(nbytes, g, auto=algorithm == "auto")
        if small is None and algorithm == "small":
            raise ValueError(f"pk_jax.all_reduce: algorithm='small' serves 1..{_small_path.CHUNKED_MAX_BYTES} "
                             f"bytes; x has {nbytes}. Use 'auto'.")
        algorithm = small or algorithm
    if algorithm.startswith("small_"):
        _check_small_all_reduce(algorithm, nbytes, g)
        variant = _small_path.ALL_REDUCE_VARIANTS[algorithm]
        out, box = _layout.all_reduce_box(x.shape, g, x.dtype.itemsize, two_shot=False)
        return _run("all_reduce", x, axis_name, out, box, variant, ())
    out, two = _layout.all_reduce_box(x.shape, g, x.dtype.itemsize, two_shot=True)
    use_two = algorithm == "two_shot" or (
        algorithm == "auto" and nbytes >= TWO_SHOT_MIN_BYTES and two is not None and two.vec_bytes == 16)
    if use_two and two is None:
        raise ValueError(f"pk_jax.all_reduce: algorithm='two_shot' needs x.size ({x.size}) divisible by the "
                         f"group size {g}; use 'auto' or 'one_shot'.")
    box = two if use_two else _layout.all_reduce_box(x.shape, g, x.dtype.itemsize, two_shot=False)[1]
    return _run("all_reduce", x, axis_name, out, box, int(use_two), ())


def _check_small_all_reduce(algorithm: str, nbytes: int, g: int) -> None:
    cap = _small_path.max_bytes(algorithm)
    if not 0 < nbytes <= cap:
        raise ValueError(f"pk_jax.all_reduce: algorithm={algorithm!r} serves 1..{cap} bytes; x has {nbytes}. "
                         f"Use 'auto'.")
    if algorithm == "small_two_shot" and _small_path.words(nbytes) % g:
        raise ValueError(f"pk_jax.all_reduce: algorithm='small_two_shot' needs x's {_small_path.words(nbytes)} "
                         f"4-byte words divisible by the group size {g}; use 'small_one_shot' or 'small'.")


def gradient_sum(x: jax.Array, axes: tuple, caller: str) -> jax.Array:
    """psum of a cotangent over `axes` inside a custom VJP (the sum over the members of an operand that
    was implicitly broadcast), through all_reduce: ranks sharing a GPU cannot run XLA's collectives.
    A dtype the kernels do not move takes jax.lax.psum, which lax_fallback_allowed refuses (naming
    `caller` and the reason) where ranks share a GPU."""
    if not axes:
        return x
    if x.dtype in SUPPORTED_DTYPES:
        return all_reduce(x, axes)
    runtime.lax_fallback_allowed(caller, f"its {x.dtype} gradient's sum over {axes}: pk_jax.all_reduce moves "
                                 f"{', '.join(d.name for d in SUPPORTED_DTYPES)}")
    return jax.lax.psum(x, axes)


def pcast(x: jax.Array, axis_name: AxisName, *, to: str) -> jax.Array:
    """`jax.lax.pcast(x, axis_name, to="varying")`: x, invariant over `axis_name` inside shard_map, typed
    as varying over it (no data moves), so that it can meet varying values. Its transpose, the gradient
    of a replicated parameter (e.g. a norm scale every member uses), is the sum over the members:
    pk_jax.all_reduce here, where jax's (implicit or explicit) cast transposes to jax.lax.psum, which ranks
    sharing a GPU cannot run. Only to="varying"; other casts move nothing worth a kernel: use jax.lax.pcast."""
    if to != "varying":
        raise ValueError(f"pk_jax.pcast: to={to!r}; only 'varying' (use jax.lax.pcast for other casts)")
    return _to_varying(x, normalize_axis_name(axis_name))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _to_varying(x: jax.Array, axes: tuple) -> jax.Array:
    return insert_collective_pvary(axes, x)


def _to_varying_fwd(x, axes):
    return _to_varying(x, axes), None


def _to_varying_bwd(axes, _, ct):
    # Only the axes the cotangent varies over (none when shard_map does not check vma: then jax's own
    # cast transposes to nothing either).
    varying = core.typeof(ct).mat.varying if config._check_vma.value else ()
    return (gradient_sum(ct, tuple(a for a in axes if a in varying), "pk_jax.pcast"),)


_to_varying.defvjp(_to_varying_fwd, _to_varying_bwd)


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
