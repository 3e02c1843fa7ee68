"""grouped_matmul: one matmul per expert over contiguous ragged groups of rows, like jax.lax.ragged_dot.

On CUDA GPUs (extension built) the forward and both backward GEMMs run pk_jax's Hopper grouped GEMM
(kernels/grouped_gemm_kernel.cuh: group_sizes read on the device, every CTA schedules its own (group, row
tile, n tile) tasks; dx reads w transposed in place; dw[e] = x_e^T dy_e is a ragged-K GEMM). It takes
bfloat16/float16 x and w of one dtype, k and n multiples of 8 and 1..256 groups; other calls (and other
platforms) run the reference paths below with identical semantics (on a GPU, saying so once):
- CPU: jax.lax.ragged_dot (XLA:CPU runs it in jax 0.11.2).
- elsewhere: ragged_dot lowers to a dense computation on GPUs (every row times every expert's matrix: E
  times the FLOPs and an (E, m, n) temporary), which does not fit at MoE sizes. Instead a scan over
  (row tile, group) pairs, as MegaBlocks schedules its grouped GEMM: rows are cut into tiles of `tile_rows`,
  and each pair multiplies one tile (rows outside the group masked) by that group's matrix. A tile meets
  at most the groups that start inside it, so there are at most ceil(m / tile) + E - 1 pairs: the work is
  m_used * k * n plus at most (E - 1) tiles' worth (pairs past the rows in use skip their GEMM), and the memory one tile and one expert matrix at a time.
The VJP is two grouped GEMMs on the same paths: dx = grouped(dy, w^T), dw[e] = x_e^T dy_e; an operand
replicated over an axis the rows are sharded over gets its gradient summed by pk_jax.all_reduce.

Kernel schedule variants (benchmarking; identical results): PK_JAX_GROUPED_VARIANT, read when a call is traced,
names any of `dyn` (tasks claimed at run time from a device-wide counter: CTAs with cheap tiles take more),
`narrow` (half-width MMAs for an n tail of at most half a tile), `n128` (128x128 tiles where n % 256 is 1..128 in
the weight grad too: the forward and input grad take them there by default), `pipe` (weight grad: 128x128
tiles, each tile's epilogue under the next tile's MMAs), `pair` (forward: two-CTA clusters whose CTAs share each B
box by TMA multicast), `w128` (128x128 tiles everywhere), `nosplit` and `nokslice`, joined by "+" or ","; unset,
empty or "default": the static schedule with `split` and `kslice` (kernels/grouped_gemm_kernel.cuh), DEFAULT_BITS.
`split` (forward and input grad): a tile whose rows fit in one 64-row slice (a group's short last tile) runs on both
consumer warpgroups, half the columns each, instead of on one while the other idles. `kslice` (weight grad): a
group's last k-block runs only the 16-row k-slices that hold its rows, and zeros rows past the group only inside
the last of them. The variant is part of the traced call, so a jitted function keeps the variant it was traced with.

Measured (bits identical in every case): on one H200 (2026-11-23, `bench moe --op grouped_matmul --variants`)
dyn+narrow 1.04-1.06x the default then on the k 7168 / E 64 rows but 0.68-0.95x on the n 1408 rows; pipe
0.82-0.95x forward+backward. On 2x H200 (2026-11-27, n 1408, E 64 at G 2): 128-wide tiles 1.06 / 1.08x forward
(uniform / skewed), so the forward and input grad take them where n % 256 is 1..128; dyn 0.91x. One H200
(2026-11-27, `scripts/grouped_probe.py` and the bench rows): pair 0.90-1.0x, w128 0.85-0.93x (`early`, each stage
released once its own MMAs were done, 0.91-1.03x, was removed); split 1.04-1.06x forward on the k 7168 / E 64 rows
(m 32768 k 7168 n 2048 E 64, multinomial counts: 2-9 % faster in three runs, 0.81-0.85x jnp.dot), hence the
default. What is left against jnp.dot there (0.99x with 512 rows per group): a group's last tile of 65-127 rows
costs a full tile, and the static round robin spreads the cheaper split tiles unevenly over the CTAs; a walk
that balanced them but ran a split row tile's n-tiles back to back on one CTA was 1.3x slower (B streamed out of
step through L2; docs/design-moe.md). One H200 (2026-11-27): kslice takes the weight grad at E 64 from 2.004 to
1.920 ms (0.83x -> 0.87x jnp.dot), hence the default.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config, core, dispatch
from jax.interpreters import batching, mlir

from pk_jax import _ext
from pk_jax.collectives import gradient_sum
from pk_jax.context._varying import full_varying, varying_axes

TILE_ROWS = 128
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_GROUPS = 256  # the kernel's group table (kernels/pk/group_table.cuh)
FORWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2  # the kernel's modes
VARIANT_ENV = "PK_JAX_GROUPED_VARIANT"
# the kernel's Variant bits (grouped_gemm_kernel.cuh; 16, notail, is expert_ffn's)
VARIANT_BITS = {"dyn": 1, "narrow": 2, "n128": 4, "pipe": 8, "pair": 32, "w128": 64, "split": 128, "kslice": 256}
# Bits every spec gets unless it names "no<variant>": split (one H200, 2026-11-27, m 32768 k 7168 n 2048 E 64
# with multinomial counts: forward 2-9 % faster in three runs; bench rows at k 7168 / E 64 1.04-1.06x; bits identical)
# and kslice (one H200, same shape: weight grad 2.004 -> 1.920 ms, fwd+bwd bench rows 0.6-1.0 % faster; bits identical).
DEFAULT_BITS = VARIANT_BITS["split"] | VARIANT_BITS["kslice"]
# Variants the GPU tests run beside the default: every bit, every kernel instantiation and every variant that
# `bench moe --variants` times (n128 is host-only: with dyn, its 128-wide tiles at n = 1408 / 1096).
VARIANTS = ("dyn", "narrow", "pipe", "dyn+narrow", "dyn+narrow+pipe", "dyn+n128", "pair", "pair+narrow",
            "pair+w128", "nosplit", "nosplit+pair", "nosplit+dyn+narrow", "nokslice",
            "nokslice+dyn+narrow+pipe")


def variant_bits(spec: str | None) -> int:
    """The kernel's variant bits of a PK_JAX_GROUPED_VARIANT value ("dyn+narrow", "n128,dyn", "" ...): the
    named bits plus DEFAULT_BITS, less any default named as "no<variant>" ("nosplit": the schedule before split)."""
    bits, cleared = DEFAULT_BITS, 0
    for name in (spec or "").replace(",", "+").split("+"):
        name = name.strip().lower()
        if name in ("", "default", "none"):
            continue
        if name.startswith("no") and VARIANT_BITS.get(name[2:], 0) & DEFAULT_BITS:
            cleared |= VARIANT_BITS[name[2:]]
            continue
        if name not in VARIANT_BITS:
            known = ", ".join([*VARIANT_BITS, *("no" + v for v, b in VARIANT_BITS.items() if b & DEFAULT_BITS)])
            raise ValueError(f"{VARIANT_ENV}={spec!r}: unknown variant {name!r} (known: {known})")
        bits |= VARIANT_BITS[name]
    return bits & ~cleared


def _variant() -> int:
    return variant_bits(os.environ.get(VARIANT_ENV))

# (a, b, group_sizes) -> forward: x (m, k), w (E, k, n) -> (m, n); input grad: dy (m, k), w (E, n, k) -> (m, n)
# (w read transposed in place); weight grad: x (m, k), dy (m, n) -> (E, k, n). Always the inputs' dtype.
pk_grouped_matmul_p = core.Primitive("pk_grouped_matmul")


def _check(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"pk_jax.grouped_matmul: x must be (m, k) and w (E, k, n) with the same k, got "
                         f"x {x.shape}, w {w.shape}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"pk_jax.grouped_matmul: group_sizes must be integers of shape (E,) = ({w.shape[0]},), "
                         f"got {group_sizes.dtype} {group_sizes.shape}")


def _pairs(group_sizes: jax.Array, m: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, int]:
    """(tile index, group) of every (row tile, group) pair that holds rows, groups' starts and ends, and the
    static pair count bound (inactive pairs point at group 0 with an empty row range)."""
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    cum_sizes = jnp.cumsum(sizes)
    ends, starts = jnp.minimum(cum_sizes, m), jnp.minimum(cum_sizes - sizes, m)
    nonempty = ends > starts
    per_group = jnp.where(nonempty, (ends - 1) // tile - starts // tile + 1, 0)
    bound = -(-m // tile) + e - 1
    cum = jnp.cumsum(per_group)
    p = jnp.arange(bound, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, p, side="right"), e - 1).astype(jnp.int32)
    active = p < cum[-1]
    tile_index = jnp.where(active, starts[group] // tile + p - (cum[group] - per_group[group]), 0)
    starts = jnp.where(active, starts[group], 0)
    ends = jnp.where(active, ends[group], 0)
    return tile_index, group, starts, ends, bound


def _tile_rows(tile: int, m: int) -> int:
    return max(1, min(tile, m))


def _scan_pairs(x: jax.Array, group_sizes: jax.Array, tile: int, init: jax.Array, add) -> jax.Array:
    """Folds `add(acc, t, group, x_tile)` over the (row tile t, group) pairs, x_tile being x's rows of tile t
    masked to the group's rows; pairs past the real rows (the static bound assumes every row is used) skip."""
    m = x.shape[0]
    xp = jnp.pad(x, ((0, -(-m // tile) * tile - m), (0, 0)))
    tiles, groups, starts, ends, _ = _pairs(group_sizes, m, tile)

    def step(acc, pair):
        t, grp, lo, hi = pair

        def contribute(a):
            rows = t * tile + jnp.arange(tile)
            mask = ((rows >= lo) & (rows < hi))[:, None]
            return add(a, t, grp, jnp.where(mask, jax.lax.dynamic_slice_in_dim(xp, t * tile, tile), 0))

        return jax.lax.cond(hi > lo, contribute, lambda a: a, acc), None

    acc, _ = jax.lax.scan(step, init, (tiles, groups, starts, ends))
    return acc


def grouped_matmul_tiled(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile_rows: int = TILE_ROWS,
                         out_dtype=None) -> jax.Array:
    """(m, k) x (E, k, n) -> (m, n) by the (row tile, group) scan; rows past sum(group_sizes) are zero."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    m, n = x.shape[0], w.shape[2]
    tile = _tile_rows(tile_rows, m)

    def add(out, t, grp, xt):
        part = jnp.dot(xt, w[grp], preferred_element_type=jnp.float32)
        cur = jax.lax.dynamic_slice_in_dim(out, t * tile, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, cur + part, t * tile, 0)

    init = full_varying((-(-m // tile) * tile, n), 0, jnp.float32, (x, w, group_sizes))
    return _scan_pairs(x, group_sizes, tile, init, add)[:m].astype(out_dtype or x.dtype)


def grouped_weight_grad_tiled(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *,
                              tile_rows: int = TILE_ROWS, out_dtype=None) -> jax.Array:
    """(m, k), (m, n) -> (E, k, n): dw[e] = x_e^T dy_e over group e's rows, by the same pair scan."""
    x, dy = jnp.asarray(x), jnp.asarray(dy)
    m, k, n, e = x.shape[0], x.shape[1], dy.shape[1], group_sizes.shape[0]
    tile = _tile_rows(tile_rows, m)
    dyp = jnp.pad(dy, ((0, -(-m // tile) * tile - m), (0, 0)))

    def add(dw, t, grp, xt):
        part = jnp.dot(xt.T, jax.lax.dynamic_slice_in_dim(dyp, t * tile, tile), preferred_element_type=jnp.float32)
        return dw.at[grp].add(part)

    init = full_varying((e, k, n), 0, jnp.float32, (x, dy, group_sizes))
    return _scan_pairs(x, group_sizes, tile, init, add).astype(out_dtype or x.dtype)


def _kernel_unsupported(x: jax.Array, w: jax.Array) -> str | None:
    """Why the GPU kernel cannot take grouped_matmul(x, w) (and its VJP), None when it can."""
    if x.dtype != w.dtype or x.dtype not in KERNEL_DTYPES:
        return f"x and w are {x.dtype} and {w.dtype} (the kernel takes two bfloat16 or two float16 arrays)"
    if x.shape[1] % 8 or w.shape[2] % 8:
        return f"k = {x.shape[1]} and n = {w.shape[2]} must be multiples of 8 (TMA rows of 16 bytes)"
    if not 1 <= w.shape[0] <= MAX_GROUPS:
        return f"{w.shape[0]} groups (the kernel takes 1..{MAX_GROUPS})"
    return None


@functools.cache
def _note_fallback(why: str) -> None:
    warnings.warn(f"pk_jax.grouped_matmul: {why}; this call runs the jax.lax reference instead of the pk_jax "
                  "kernel", stacklevel=4)


def varying_like(out, *ins):
    """An output aval varying over every axis any input varies over (shard_map's vma typing)."""
    if config._check_vma.value:
        varying = frozenset().union(*(frozenset(a.mat.varying) for a in ins))
        out = out.update(manual_axis_type=ins[0].mat.update(varying=varying))
    return out


def _abstract_eval(a, b, group_sizes, *, mode, variant=0):
    if mode == WEIGHT_GRAD:
        shape = (group_sizes.shape[0], a.shape[1], b.shape[1])
    else:
        shape = (a.shape[0], b.shape[1] if mode == INPUT_GRAD else b.shape[2])
    return varying_like(a.update(shape=shape, dtype=a.dtype), a, b, group_sizes)


def _reference(a, b, group_sizes, *, mode, variant=0, tile_rows=TILE_ROWS):
    """The primitive's semantics on the reference paths (its fallback lowering and batching rule)."""
    if mode == FORWARD:
        return _lax_forward(a, b, group_sizes, tile_rows)
    if mode == INPUT_GRAD:
        return _lax_forward(a, jnp.swapaxes(b, 1, 2), group_sizes, tile_rows).astype(a.dtype)
    return _lax_weight_grad(a, b, group_sizes, a.dtype, tile_rows)


def _batch(args, dims, *, mode, variant=0):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)]
    return jax.vmap(functools.partial(_reference, mode=mode))(*args), 0


def _cuda_lowering(ctx, a, b, group_sizes, *, mode, variant=0):
    return jax.ffi.ffi_lowering("pk_grouped_matmul")(ctx, a, b, group_sizes, mode=np.int32(mode), tile=np.int32(-1),
                                                      variant=np.int32(variant))


pk_grouped_matmul_p.def_abstract_eval(_abstract_eval)
pk_grouped_matmul_p.def_impl(functools.partial(dispatch.apply_primitive, pk_grouped_matmul_p))
batching.primitive_batchers[pk_grouped_matmul_p] = _batch
mlir.register_lowering(pk_grouped_matmul_p, lambda ctx, *args, mode, variant=0: mlir.lower_fun(
    functools.partial(_reference, mode=mode), multiple_results=False)(ctx, *args))
if _ext.available():
    mlir.register_lowering(pk_grouped_matmul_p, _cuda_lowering, platform="cuda")


def _with_kernel(reference, kernel, use_kernel: bool):
    """reference() everywhere; on CUDA kernel() where the call fits it (only the platform's branch is
    lowered)."""
    if not use_kernel:
        return reference()
    return jax.lax.platform_dependent(cpu=reference, cuda=kernel, default=reference)


def _lax_forward(x, w, group_sizes, tile_rows):
    gs = group_sizes.astype(jnp.int32)
    on_cpu = lambda: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)
    tiled = lambda: grouped_matmul_tiled(x, w, gs, tile_rows=tile_rows)
    return jax.lax.platform_dependent(cpu=on_cpu, default=tiled)


def _lax_weight_grad(x, dy, group_sizes, w_dtype, tile_rows):
    gs = group_sizes.astype(jnp.int32)

    def on_cpu():
        zero_w = full_varying((gs.shape[0], x.shape[1], dy.shape[1]), 0, jnp.float32, (x, dy, gs))
        _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x.astype(jnp.float32), w, gs), zero_w)
        return vjp(dy.astype(jnp.float32))[0].astype(w_dtype)

    tiled = lambda: grouped_weight_grad_tiled(x, dy, gs, tile_rows=tile_rows, out_dtype=w_dtype)
    return jax.lax.platform_dependent(cpu=on_cpu, default=tiled)


def _forward(x, w, group_sizes, tile_rows, use_kernel, variant=0):
    gs = group_sizes.astype(jnp.int32)
    return _with_kernel(lambda: _lax_forward(x, w, gs, tile_rows),
                        lambda: pk_grouped_matmul_p.bind(x, w, gs, mode=FORWARD, variant=variant), use_kernel)


def _input_grad(dy, w, group_sizes, x_dtype, tile_rows, use_kernel, variant=0):
    gs = group_sizes.astype(jnp.int32)
    dy = dy.astype(x_dtype)
    return _with_kernel(lambda: _lax_forward(dy, jnp.swapaxes(w, 1, 2), gs, tile_rows).astype(x_dtype),
                        lambda: pk_grouped_matmul_p.bind(dy, w, gs, mode=INPUT_GRAD, variant=variant), use_kernel)


def _weight_grad(x, dy, group_sizes, w_dtype, tile_rows, use_kernel, variant=0):
    gs = group_sizes.astype(jnp.int32)
    return _with_kernel(lambda: _lax_weight_grad(x, dy, gs, w_dtype, tile_rows),
                        lambda: pk_grouped_matmul_p.bind(x, dy.astype(x.dtype), gs, mode=WEIGHT_GRAD,
                                                         variant=variant), use_kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(x, w, group_sizes, tile_rows, use_kernel, variant):
    return _forward(x, w, group_sizes, tile_rows, use_kernel, variant)


def _grouped_fwd(x, w, group_sizes, tile_rows, use_kernel, variant):
    return _forward(x, w, group_sizes, tile_rows, use_kernel, variant), (x, w, group_sizes)


def _grouped_bwd(tile_rows, use_kernel, variant, res, dy):
    x, w, group_sizes = res
    dx = _input_grad(dy, w, group_sizes, x.dtype, tile_rows, use_kernel, variant)
    dw = _weight_grad(x, dy, group_sizes, w.dtype, tile_rows, use_kernel, variant)
    return _unvary_like(dx, x), _unvary_like(dw, w), None


def _unvary_like(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """Inside shard_map, an operand invariant over an axis that the cotangent varies over (e.g. weights
    replicated over the token axis) was implicitly broadcast: its cotangent is the sum over that axis
    (collectives.gradient_sum: pk_jax.all_reduce, float32 accumulation in rank order, one rounding)."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(primal), key=str))
    return gradient_sum(grad, extra, "grouped_matmul")


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile_rows: int = TILE_ROWS) -> jax.Array:
    """Multiplies contiguous groups of rows of x by their group's matrix, like `jax.lax.ragged_dot`.

    Args:
      x: (m, k); rows [sum(group_sizes[:e]), sum(group_sizes[:e+1])) form group e.
      w: (E, k, n), one matrix per group.
      group_sizes: (E,) int rows per group; sum <= m (rows past the sum give zero rows; a sum above m is
        cut at m).
      tile_rows: the row tile of the non-CPU reference scan (see the module docstring; the kernel tiles its own).
      (PK_JAX_GROUPED_VARIANT, read here at trace time, picks a kernel schedule variant: module docstring.)

    Returns:
      (m, n) in x's dtype, accumulated in float32. Differentiable in x and w (grouped-GEMM VJP).
    """
    _check(x, w, group_sizes)
    x, w = jnp.asarray(x), jnp.asarray(w)
    why = _kernel_unsupported(x, w)
    if why is not None and _ext.available() and jax.default_backend() == "gpu":
        _note_fallback(why)
    variant = _variant()  # validated on every platform; only the kernel uses it
    return _grouped(x, w, group_sizes, tile_rows, why is None and _ext.available(), variant)
