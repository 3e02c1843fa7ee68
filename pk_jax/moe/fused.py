"""The fused MoE exchange: dispatch and combine as device-initiated kernels (kernels/moe_dispatch.cu).

Three primitives, each one FFI custom call on GPUs (docs/design-moe.md has the protocol):
- moe_dispatch: x, key, pos -> recv, recv_counts, send_row. Every member counts its rows per expert, publishes
  the counts with its receive buffer's address (one handshake), derives every offset (prefix over sources in
  rank order) and pushes each kept row of x straight into its destination's receive buffer.
- moe_send: the same push with the layout known (send_row), rows optionally scaled per assignment: the
  backward of combine.
- moe_combine: each member pulls its assignments' expert rows back and sums them by weight in choice order,
  float32 (or gathers them one per assignment: the weight gradient of combine).
Where no kernel serves a call (CPU, no concrete mesh), the lowering is a jax.lax emulation of the kernels'
semantics (all_gather / all_to_all), so the layout and results are the same everywhere.

Which path pk_jax.moe.dispatch takes: PK_JAX_MOE_DISPATCH = "auto" (default: fused where the CUDA extension
serves GPUs, else the reference exchange of pk_jax/moe/dispatch.py), "fused" (also on CPU, through the
emulation: for tests) or "reference".
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config, core
from jax._src.lax.parallel import insert_collective_pvary
from jax.interpreters import mlir

from pk_jax import _ext, runtime
from pk_jax.moe.routing import RoutingSizes

ENV = "PK_JAX_MOE_DISPATCH"
# "0": the kernels before deduplication (every choice's row crosses NVLink; combine pulls every choice's
# row): a same-run baseline for pk_jax.bench moe. Read at trace time.
DEDUP_ENV = "PK_JAX_MOE_DEDUP"
IMPLEMENTATIONS = ("auto", "fused", "reference")
# kMoeMaxExperts in kernels/pk/control_block.h: experts whose counts fit a member's publication area.
MAX_EXPERTS = 1024
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


_override: list[str] = []


@contextlib.contextmanager
def override(impl: str):
    """Within the block, trace pk_jax.moe.dispatch with `impl` ("auto" | "fused" | "reference") whatever
    PK_JAX_MOE_DISPATCH says (benchmarks and tests compare the paths in one process)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"pk_jax.moe.fused.override: {impl!r}; use one of {', '.join(IMPLEMENTATIONS)}")
    _override.append(impl)
    try:
        yield
    finally:
        _override.pop()


def implementation() -> str:
    """The path pk_jax.moe.dispatch takes, read at trace time: override(), else PK_JAX_MOE_DISPATCH."""
    if _override:
        return _override[-1]
    impl = os.environ.get(ENV, "auto") or "auto"
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"pk_jax.moe: {ENV}={impl!r}; use one of {', '.join(IMPLEMENTATIONS)}")
    return impl


_dedup_override: list[bool] = []


@contextlib.contextmanager
def override_dedup(flag: bool):
    """Within the block, trace the fused kernels deduplicated (True) or as before (False), whatever
    PK_JAX_MOE_DEDUP says (same-run comparisons)."""
    _dedup_override.append(bool(flag))
    try:
        yield
    finally:
        _dedup_override.pop()


def _dedup_setting() -> bool | None:
    """override_dedup(), else PK_JAX_MOE_DEDUP: "0" never, "1" always (where the kernels can), unset or "auto"
    None: by the measured rules of dispatch_dedup / combine_partials."""
    if _dedup_override:
        return _dedup_override[-1]
    value = os.environ.get(DEDUP_ENV, "auto") or "auto"
    if value in ("0", "false", "off"):
        return False
    return True if value in ("1", "true", "on") else None


def dedup() -> bool:
    """Whether the deduplicating kernels may be traced at all (not PK_JAX_MOE_DEDUP=0 / override_dedup(False))."""
    return _dedup_setting() is not False


def dispatch_dedup(g: int, top_k: int) -> bool:
    """Whether dispatch sends each token once per member (then fills the other choices' rows locally). Auto: when
    a token has >= 2 choices per member on average (top_k >= 2 G). Measured on 2x H200 (2026-11-23, bench moe,
    same runs): T 4096 H 7168 E 256 top-8 1.11 / 1.58 ms against 1.49 / 1.96 before dedup (two runs); E 64 top-4
    0.79 vs 0.77 uniform, 0.58 vs 0.73 skewed; E 8 top-2 (one choice per member) 0.73 / 0.76 vs 0.62 / 0.69: the
    fill launch and the src_of entries cost more than the few rows saved."""
    setting = _dedup_setting()
    return setting if setting is not None else top_k >= 2 * g


def combine_partials(g: int, top_k: int, itemsize: int) -> bool:
    """Whether combine pushes float32 partial sums (kernels/moe_partials.cu) instead of pulling every row: only
    when forced (PK_JAX_MOE_DEDUP=1 / override_dedup(True)) and fewer NVLink bytes move (partials_pay). Auto: off.
    Measured on 2x H200 (2026-11-23): top-8 of 256, H 7168: 1.11 vs 1.19 ms pulling in one run, 1.44 vs 1.26 in
    another; E 64 top-4: 0.78 vs 0.69 uniform, 0.72 vs 0.52 skewed: its extra local traffic (~2.6x) is not
    repaid at G = 2."""
    return _dedup_setting() is True and partials_pay(g, top_k, itemsize)


def supported(sizes: RoutingSizes, hidden: int, dtype) -> bool:
    """Whether the fused kernels serve this routing: a group of 2..8, at most MAX_EXPERTS experts, a row
    layout that fits int32 (dest * R + row), rows of whole 16-bit words, float32 / bfloat16 / float16."""
    dtype = jnp.dtype(dtype)
    return (2 <= sizes.g <= 8 and sizes.num_experts <= MAX_EXPERTS and sizes.tokens * sizes.top_k > 0
            and hidden > 0 and dtype in DTYPES and sizes.g * sizes.recv_rows < 2 ** 31)


def use_fused(sizes: RoutingSizes, hidden: int, dtype) -> bool:
    """Trace-time choice of pk_jax.moe.dispatch: the fused path (auto: on GPUs with the extension)."""
    impl = implementation()
    if impl == "reference" or not supported(sizes, hidden, dtype):
        return False
    return impl == "fused" or (_ext.available() and jax.default_backend() == "gpu")


def _name(axis_name: tuple):
    return axis_name if len(axis_name) > 1 else axis_name[0]


def _varying(aval, axis_name: tuple, shape, dtype, *others):
    """An output aval: varying over the group axes and whatever the inputs vary over."""
    if not config._check_vma.value:
        return aval.update(shape=shape, dtype=dtype, weak_type=False)
    vma = frozenset(axis_name).union(*(a.mat.varying for a in (aval, *others)))
    return aval.update(shape=shape, dtype=dtype, weak_type=False, manual_axis_type=aval.mat.update(varying=vma))


def _bind(p, *args, **params):
    axis_name = params["axis_name"]
    return p.bind(*(insert_collective_pvary(axis_name, a) for a in args), **params)


# ---------------------------------------------------------------------------------------------------------
# Semantics (the lax emulation: the CPU lowering and the GPU fallback)

def _send_emulation(x, send_row, scale, *, axis_name, recv_rows, g):
    n, t = send_row.shape[0], x.shape[0]
    rows = x[jnp.arange(n) // (n // t)]
    if scale is not None:
        rows = (rows.astype(jnp.float32) * scale[:, None].astype(jnp.float32)).astype(x.dtype)
    ok = send_row >= 0
    dest = jnp.where(ok, send_row // recv_rows, 0)
    row = jnp.where(ok, send_row % recv_rows, recv_rows)  # row R: a discarded extra row
    buf = jnp.zeros((g, recv_rows + 1, x.shape[1]), x.dtype).at[dest, row].set(rows)[:, :recv_rows]
    mask = jnp.zeros((g, recv_rows + 1), jnp.int32).at[dest, row].set(1)[:, :recv_rows]
    name = _name(axis_name)
    got = jax.lax.all_to_all(buf, name, 0, 0, tiled=True)  # (G sources, R, H)
    got_mask = jax.lax.all_to_all(mask, name, 0, 0, tiled=True)
    src = jnp.argmax(got_mask, axis=0)
    pick = jnp.take_along_axis(got, src[None, :, None], axis=0)[0]
    return jnp.where(got_mask.any(axis=0)[:, None], pick, jnp.zeros((), x.dtype))


def _dispatch_emulation(x, key, pos, *, axis_name, sizes: RoutingSizes):
    g, e, r = sizes.g, sizes.num_experts, sizes.recv_rows
    local = e // g
    name = _name(axis_name)
    me = jax.lax.axis_index(name)
    valid = (key >= 0) & (key < e)
    k = jnp.clip(key, 0, e - 1)
    own = jnp.zeros(e + 1, jnp.int32).at[jnp.where(valid, key, e)].add(1)[:e]
    counts = jax.lax.all_gather(own, name)  # (G sources, E), rank order
    before = jnp.where(jnp.arange(g)[:, None] < me, counts, 0).sum(axis=0)
    total = counts.sum(axis=0).reshape(g, local)
    base = before + (jnp.cumsum(total, axis=1) - total).reshape(e)
    row = base[k] + pos
    keep = valid & (row < r)
    send_row = jnp.where(keep, (k // local) * r + row, -1).astype(jnp.int32)
    recv_counts = jax.lax.dynamic_slice_in_dim(counts, me * local, local, axis=1).astype(jnp.int32)
    recv = _send_emulation(x, send_row, None, axis_name=axis_name, recv_rows=r, g=g)
    return recv, recv_counts, send_row


def _combine_emulation(y, send_row, weights, *, axis_name, top_k, gather, partials=0):
    """partials: 0 (each token's choices summed in choice order) or G (combine by pushed partials)."""
    r, n = y.shape[0], send_row.shape[0]
    ys = jax.lax.all_gather(y, _name(axis_name))  # (G, R, H)
    ok = send_row >= 0
    rows = ys[jnp.where(ok, send_row // r, 0), jnp.where(ok, send_row % r, 0)]
    rows = jnp.where(ok[:, None], rows, jnp.zeros((), y.dtype))
    if gather:
        return rows
    per = rows.reshape(n // top_k, top_k, -1).astype(jnp.float32)
    w = weights.reshape(n // top_k, top_k).astype(jnp.float32)
    if not partials:
        return jnp.einsum("tkh,tk->th", per, w).astype(y.dtype)
    # Pushed partials: each member's choices summed in float32, then the members' partials in rank order.
    member = jnp.where(ok, send_row // r, -1).reshape(n // top_k, top_k)
    out = jnp.zeros(per.shape[::2], jnp.float32)
    for m in range(partials):
        out = out + jnp.einsum("tkh,tk->th", per, jnp.where(member == m, w, 0.0))
    return out.astype(y.dtype)


# ---------------------------------------------------------------------------------------------------------
# Primitives

moe_dispatch_p = core.Primitive("pk_moe_dispatch")
moe_dispatch_p.multiple_results = True
moe_send_p = core.Primitive("pk_moe_send")
moe_combine_p = core.Primitive("pk_moe_combine")


def _dispatch_abstract(x, key, pos, *, axis_name, sizes: RoutingSizes):
    return (_varying(x, axis_name, (sizes.recv_rows, x.shape[1]), x.dtype, key, pos),
            _varying(x, axis_name, (sizes.g, sizes.local_experts), jnp.int32, key, pos),
            _varying(x, axis_name, key.shape, jnp.int32, key, pos))


def _send_abstract(x, send_row, scale, received, *, axis_name, recv_rows, g, scaled, zero_tail=True):
    return _varying(x, axis_name, (recv_rows, x.shape[1]), x.dtype, send_row, scale, received)


def _combine_abstract(y, send_row, weights, *, axis_name, top_k, gather, partials):
    rows = send_row.shape[0] if gather else send_row.shape[0] // top_k
    return _varying(y, axis_name, (rows, y.shape[1]), y.dtype, send_row, weights)


moe_dispatch_p.def_abstract_eval(_dispatch_abstract)
moe_send_p.def_abstract_eval(_send_abstract)
moe_combine_p.def_abstract_eval(_combine_abstract)


def _dispatch_lax(ctx, x, key, pos, *, axis_name, sizes):
    return mlir.lower_fun(functools.partial(_dispatch_emulation, axis_name=axis_name, sizes=sizes),
                          multiple_results=True)(ctx, x, key, pos)


def _send_lax(ctx, x, send_row, scale, received, *, axis_name, recv_rows, g, scaled, zero_tail=True):
    fn = lambda x, s, c, _: _send_emulation(x, s, c if scaled else None, axis_name=axis_name, recv_rows=recv_rows,
                                            g=g)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x, send_row, scale, received)


def _combine_lax(ctx, y, send_row, weights, *, axis_name, top_k, gather, partials):
    fn = functools.partial(_combine_emulation, axis_name=axis_name, top_k=top_k, gather=gather, partials=partials)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, y, send_row, weights)


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"pk_jax: the fused MoE exchange runs its jax.lax emulation on GPU: {reason}", stacklevel=3)


def _group(ctx, op: str, axis_name):
    """The group table of a GPU lowering, or None after checking that the lax emulation may run."""
    table, reason = runtime.lowering_group(ctx, axis_name)
    if table is None:
        runtime.lax_fallback_allowed(op, reason)
        _warn_once(f"{op} over {axis_name}: {reason}")
    return table


def _mesh_attrs(table) -> dict:
    return dict(mesh_ids=np.asarray(table.mesh_ids, np.int64), mesh_shape=np.asarray(table.mesh_shape, np.int64),
                group_axes=np.asarray(table.group_axes, np.int64))


def _dispatch_cuda(ctx, x, key, pos, *, axis_name, sizes):
    if (table := _group(ctx, "moe dispatch", axis_name)) is None:
        return _dispatch_lax(ctx, x, key, pos, axis_name=axis_name, sizes=sizes)
    # One more result than the primitive: src_of (R int32), the scratch the peers fill with each received
    # row's primary (deduplicated rows); dropped here.
    scratch = core.ShapedArray((sizes.recv_rows,), jnp.int32)
    outs = jax.ffi.ffi_lowering("pk_moe_dispatch")(ctx.replace(avals_out=[*ctx.avals_out, scratch]), x, key, pos,
                                                   num_experts=np.int32(sizes.num_experts),
                                                   dedup=np.int32(dispatch_dedup(sizes.g, sizes.top_k)),
                                                   zero_tail=np.int32(sizes.zero_tail), **_mesh_attrs(table))
    return outs[:3]


def _send_cuda(ctx, x, send_row, scale, received, *, axis_name, recv_rows, g, scaled, zero_tail=True):
    if (table := _group(ctx, "moe dispatch", axis_name)) is None:
        return _send_lax(ctx, x, send_row, scale, received, axis_name=axis_name, recv_rows=recv_rows, g=g,
                         scaled=scaled)
    top_k = ctx.avals_in[1].shape[0] // ctx.avals_in[0].shape[0]
    return jax.ffi.ffi_lowering("pk_moe_send")(ctx, x, send_row, scale, received, top_k=np.int32(top_k),
                                               scaled=np.int32(scaled), zero_tail=np.int32(zero_tail),
                                               **_mesh_attrs(table))


def _combine_cuda(ctx, y, send_row, weights, *, axis_name, top_k, gather, partials):
    if (table := _group(ctx, "moe combine", axis_name)) is None:
        return _combine_lax(ctx, y, send_row, weights, axis_name=axis_name, top_k=top_k, gather=gather,
                            partials=partials)
    # One more result than the primitive: the float32 scratch the peers push their partials into ((G - 1)
    # slots of T x H'), one unused float without partials; dropped here.
    tokens, hidden = ctx.avals_in[1].shape[0] // top_k, ctx.avals_in[0].shape[1]
    scratch = core.ShapedArray(((partials - 1) * tokens * hidden if partials else 1,), jnp.float32)
    outs = jax.ffi.ffi_lowering("pk_moe_combine")(ctx.replace(avals_out=[*ctx.avals_out, scratch]), y, send_row,
                                                  weights, top_k=np.int32(top_k), gather=np.int32(gather),
                                                  partials=np.int32(partials != 0), **_mesh_attrs(table))
    return outs[:1]


mlir.register_lowering(moe_dispatch_p, _dispatch_lax)
mlir.register_lowering(moe_send_p, _send_lax)
mlir.register_lowering(moe_combine_p, _combine_lax)
if _ext.available():
    mlir.register_lowering(moe_dispatch_p, _dispatch_cuda, platform="cuda")
    mlir.register_lowering(moe_send_p, _send_cuda, platform="cuda")
    mlir.register_lowering(moe_combine_p, _combine_cuda, platform="cuda")


# ---------------------------------------------------------------------------------------------------------
# The exchanges with their VJPs (the reference path's: d(dispatch) = combine with weights 1,
# d(combine)/dy = dispatch of the weighted cotangent).

def send(x, send_row, scale, received, axis_name, sizes: RoutingSizes):
    """(T, H) rows -> (R, H) at their destinations (layout known), scaled per assignment unless scale is None;
    rows past those received are zero, or unspecified where sizes.zero_tail is False (the kernel leaves them)."""
    scaled = scale is not None
    scale = (scale.reshape(-1).astype(jnp.float32) if scaled else jnp.ones(send_row.shape, jnp.float32))
    return _bind(moe_send_p, x, send_row, scale, jnp.asarray(received, jnp.int32).reshape(()),
                 axis_name=axis_name, recv_rows=sizes.recv_rows, g=sizes.g, scaled=scaled, zero_tail=sizes.zero_tail)


def partials_pay(g: int, top_k: int, itemsize: int) -> bool:
    """Whether combine by pushed float32 partials moves fewer NVLink bytes than pulling every remote choice's
    row, uniform routing (docs/design-moe.md's cost table): per member and token, (G - 1) * p partials of 4 h
    bytes (h elements; p = 1 - (1 - 1/G)^K, a token has a choice on a given member) against (G - 1) / G * K rows
    of itemsize * h. bf16, G = 2, K = 8: 8 h against 16 h bytes; G = 8, K = 8: no."""
    p = 1.0 - (1.0 - 1.0 / g) ** top_k
    return 4 * g * p < top_k * itemsize


def pull(y, send_row, weights, axis_name, top_k: int, gather: bool, g: int):
    """(R, H) expert rows -> (T, H) weighted sums (gather: (T * K, H), one row per assignment). Combined by
    pushed partials (summed per member, then over members in rank order) where chosen (combine_partials)."""
    w = jnp.ones(send_row.shape, jnp.float32) if weights is None else weights.reshape(-1).astype(jnp.float32)
    on = not gather and combine_partials(g, top_k, jnp.dtype(y.dtype).itemsize)
    return _bind(moe_combine_p, y, send_row, w, axis_name=axis_name, top_k=top_k, gather=gather,
                 partials=g if on else 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def dispatch_rows(x, key, pos, axis_name, sizes: RoutingSizes):
    """x (T, H), key/pos (T * K,) of routing.plan_local -> (recv (R, H), recv_counts (G, L), send_row (T * K,))."""
    return tuple(_bind(moe_dispatch_p, x, key, pos, axis_name=axis_name, sizes=sizes))


def _dispatch_fwd(x, key, pos, axis_name, sizes):
    out = dispatch_rows(x, key, pos, axis_name, sizes)
    return out, out[2]


def _dispatch_bwd(axis_name, sizes, send_row, cts):
    d_recv = cts[0]
    return pull(d_recv, send_row, None, axis_name, sizes.top_k, gather=False, g=sizes.g), None, None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def combine_rows(y, weights, send_row, received, axis_name, sizes: RoutingSizes):
    """y (R, H') expert rows, weights (T, K) -> (T, H'): each token's choices summed by weight in float32."""
    return pull(y, send_row, weights, axis_name, sizes.top_k, gather=False, g=sizes.g)


def _combine_fwd(y, weights, send_row, received, axis_name, sizes):
    return combine_rows(y, weights, send_row, received, axis_name, sizes), (y, weights, send_row, received)


def _combine_bwd(axis_name, sizes, res, d_out):
    y, weights, send_row, received = res
    dy = send(d_out, send_row, weights, received, axis_name, sizes)
    per_choice = pull(y, send_row, None, axis_name, sizes.top_k, gather=True, g=sizes.g)
    per_choice = per_choice.reshape(sizes.tokens, sizes.top_k, -1)
    dw = jnp.einsum("tkh,th->tk", per_choice.astype(jnp.float32), d_out.astype(jnp.float32))
    return dy, dw.astype(weights.dtype), None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)
