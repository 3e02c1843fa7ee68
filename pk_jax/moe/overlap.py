"""Dispatch + the first grouped GEMM in one kernel (DispatchMatmul, kernels/moe_gemm_kernel.cuh; issue 27 item 3).

A few SMs (PK_JAX_MOE_OVERLAP_SMS, default 16) run the dispatch's communication: the count exchange, then every
kept row pushed to its expert's member, local expert by local expert, in chunks of CHUNK_ROWS rows, each chunk's
landed rows added to the receiver's arrival count of (source, local expert) with release semantics. The other
SMs run the grouped GEMM's gate and up tiles (the grouped GEMM's schedule, tasks claimed from a counter) and
start an expert's tiles once every source's rows of it have landed (acquire, bounded wait). The comm SMs join
the GEMM when their rows are out. Same outputs as pk_jax.moe.dispatch followed by two grouped_matmul calls
(bit for bit: the same layout, the same tiles and k order); the backward is that unfused path's (the grouped
GEMM's VJP, then dispatch's transpose, combine).

moe_mlp takes it with PK_JAX_MOE_OVERLAP=1 (read at trace time; default off until measured) where the fused
exchange runs (pk_jax.moe.fused.use_fused) and the kernel fits (supported); elsewhere the primitive lowers to
its jax.lax emulation (the fused dispatch's emulation, then grouped_matmul), so CPU tests pin the semantics.

The index math both sides of an arrival count agree on (comm_items, landed_rows, expected_arrivals) mirrors
kernels/moe_arrivals.cuh and the comm CTAs of kernels/moe_gemm_kernel.cuh; tests/test_moe_overlap_cpu.py
checks it against the dispatch layout. docs/design.md, "Dispatch + grouped GEMM", has the design and the
prediction.
"""

from __future__ import annotations

import functools
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax.interpreters import mlir

from pk_jax import _ext
from pk_jax._env import int_setting
from pk_jax.moe import fused, routing
from pk_jax.moe.routing import RoutingHandle, RoutingSizes
from pk_jax.sharding import group_size, normalize_axis_name
from pk_jax.sharding.mesh_groups import AxisName

_gm = importlib.import_module("pk_jax.moe.grouped_matmul")  # the module (the package attribute is the function)

ENV = "PK_JAX_MOE_OVERLAP"
SMS_ENV = "PK_JAX_MOE_OVERLAP_SMS"
DEFAULT_COMM_SMS = 16
CHUNK_ROWS = 64     # kChunkRows (kernels/moe_arrivals.cuh)
MAX_LOCAL = 256     # the GEMM's group table (kernels/pk/group_table.cuh)
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ---------------------------------------------------------------------------------------------------------
# The index math (mirror of kernels/moe_arrivals.cuh and the Dispatcher of kernels/moe_gemm_kernel.cuh)

def comm_dest(rank: int, g: int, i: int) -> int:
    """Destination of a member's i-th pair of a local expert: peers first, its own member last."""
    return (rank + 1 + i) % g


def landed_rows(first: int, count: int, recv_rows: int) -> int:
    """Rows of a run of `count` rows from row `first` of the receive buffer that land below R."""
    return max(0, min(count, recv_rows - first))


def chunks_of(rows: int) -> int:
    return -(-rows // CHUNK_ROWS)


def comm_items(own: np.ndarray, rank: int, g: int) -> list[tuple[int, int, int, int]]:
    """The chunks a member's comm CTAs push, in chunk-index order (CTA c takes chunks c, c + C, ...):
    (local expert l, destination, first position p0 among its kept rows of expert dest * L + l, rows).

    own: (E,) this member's kept rows per global expert.
    """
    e = own.shape[0]
    local = e // g
    out = []
    for j in range(e):  # item j = l * G + i
        l, dest = j // g, comm_dest(rank, g, j % g)
        count = int(own[dest * local + l])
        for c in range(chunks_of(count)):
            out.append((l, dest, c * CHUNK_ROWS, min(CHUNK_ROWS, count - c * CHUNK_ROWS)))
    return out


def send_bases(counts: np.ndarray, recv_rows: int) -> np.ndarray:
    """(G, E) row at expert e's member of source s's first row of e: the rows of e's local experts before it
    (all sources), then sources before s (rank order). Unclipped (rows at or past R drop).

    counts: (G, E) every member's kept rows per global expert.
    """
    g, e = counts.shape
    local = e // g
    total = counts.sum(axis=0).reshape(g, local)
    start = (np.cumsum(total, axis=1) - total).reshape(e)
    before = np.cumsum(counts, axis=0) - counts
    return before + start[None, :]


def arrival_signals(counts: np.ndarray, recv_rows: int) -> np.ndarray:
    """(G dest, G source, L) the rows the sources' comm CTAs add to each destination's arrival counts,
    simulated chunk by chunk as the kernel does.

    counts: (G, E) every member's kept rows per global expert.
    """
    g, e = counts.shape
    local = e // g
    base = send_bases(counts, recv_rows)
    out = np.zeros((g, g, local), np.int64)
    for s in range(g):
        for l, dest, p0, rows in comm_items(counts[s], s, g):
            out[dest, s, l] += landed_rows(int(base[s, dest * local + l]) + p0, rows, recv_rows)
    return out


def expected_arrivals(recv_counts: np.ndarray, recv_rows: int) -> np.ndarray:
    """(G source, L) the rows a member's GEMM waits for before an expert's tiles (the loader's wait_expert):
    the expert's first row (clipped at R) plus the rows of earlier sources, clipped at R.

    recv_counts: (G, L) rows of each local expert from each source (dispatch's recv_counts).
    """
    g, local = recv_counts.shape
    totals = recv_counts.sum(axis=0)
    start = np.minimum(np.cumsum(totals) - totals, recv_rows)
    out = np.zeros((g, local), np.int64)
    for l in range(local):
        first = int(start[l])
        for s in range(g):
            out[s, l] = landed_rows(first, int(recv_counts[s, l]), recv_rows)
            first += int(recv_counts[s, l])
    return out


def expert_rows(recv_counts: jax.Array, recv_rows: int) -> jax.Array:
    """(L,) rows of each local expert in the receive buffer (the GEMM's group sizes after the R bound), as
    routing.plan_receive's expert_counts."""
    totals = recv_counts.sum(axis=0)
    return jnp.clip(recv_rows - (jnp.cumsum(totals) - totals), 0, totals).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------------------
# Settings

def enabled() -> bool:
    """PK_JAX_MOE_OVERLAP=1 (read at trace time): moe_mlp runs dispatch and its first grouped GEMM fused."""
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "on")


def comm_sms() -> int:
    """SMs that push rows first (PK_JAX_MOE_OVERLAP_SMS, default 16), read at trace time."""
    return int_setting(SMS_ENV, DEFAULT_COMM_SMS, minimum=1, owner="pk_jax.moe",
                       what="a number of SMs (it must leave SMs for the GEMM)")


def supported(sizes: RoutingSizes, hidden: int, ffn: int, dtype) -> bool:
    """Whether the kernel serves this layer: the fused exchange's limits, 16-bit operands, H and F multiples of
    8 (16-byte rows for the pushes and TMA) and at most MAX_LOCAL local experts."""
    return (fused.supported(sizes, hidden, dtype) and jnp.dtype(dtype) in KERNEL_DTYPES and hidden % 8 == 0
            and ffn > 0 and ffn % 8 == 0 and sizes.local_experts <= MAX_LOCAL)


def use_overlap(sizes: RoutingSizes, hidden: int, ffn: int, dtype) -> bool:
    """Trace-time choice of moe_mlp: fused dispatch + GEMM when enabled, on the fused exchange, and supported."""
    return enabled() and fused.use_fused(sizes, hidden, dtype) and supported(sizes, hidden, ffn, dtype)


# ---------------------------------------------------------------------------------------------------------
# The primitive: x, key, pos, order, w_gate, w_up -> recv, recv_counts, send_row, gate, up

moe_dispatch_matmul_p = core.Primitive("pk_moe_dispatch_matmul")
moe_dispatch_matmul_p.multiple_results = True


def _abstract(x, key, pos, order, w_gate, w_up, *, axis_name, sizes: RoutingSizes, num_comm_sms):
    r, ffn = sizes.recv_rows, w_gate.shape[2]
    others = (key, pos, order, w_gate, w_up)
    return (fused._varying(x, axis_name, (r, x.shape[1]), x.dtype, *others),
            fused._varying(x, axis_name, (sizes.g, sizes.local_experts), jnp.int32, *others),
            fused._varying(x, axis_name, key.shape, jnp.int32, *others),
            fused._varying(x, axis_name, (r, ffn), x.dtype, *others),
            fused._varying(x, axis_name, (r, ffn), x.dtype, *others))


def _emulation(x, key, pos, order, w_gate, w_up, *, axis_name, sizes: RoutingSizes, num_comm_sms):
    """The semantics: the fused dispatch's emulation, then the two grouped GEMMs (order is the kernel's)."""
    recv, recv_counts, send_row = fused._dispatch_emulation(x, key, pos, axis_name=axis_name, sizes=sizes)
    rows = expert_rows(recv_counts, sizes.recv_rows)
    return recv, recv_counts, send_row, _gm.grouped_matmul(recv, w_gate, rows), _gm.grouped_matmul(recv, w_up, rows)


def _lax(ctx, *args, axis_name, sizes, num_comm_sms):
    fn = functools.partial(_emulation, axis_name=axis_name, sizes=sizes, num_comm_sms=num_comm_sms)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _cuda(ctx, x, key, pos, order, w_gate, w_up, *, axis_name, sizes, num_comm_sms):
    if (table := fused._group(ctx, "moe dispatch_matmul", axis_name)) is None:
        return _lax(ctx, x, key, pos, order, w_gate, w_up, axis_name=axis_name, sizes=sizes,
                    num_comm_sms=num_comm_sms)
    # One more result than the primitive: totals (L,) int32, the GEMM's group sizes (scratch); dropped here.
    scratch = core.ShapedArray((sizes.local_experts,), jnp.int32)
    outs = jax.ffi.ffi_lowering("pk_moe_dispatch_matmul")(
        ctx.replace(avals_out=[*ctx.avals_out, scratch]), x, key, pos, order, w_gate, w_up,
        num_experts=np.int32(sizes.num_experts), num_comm_sms=np.int32(num_comm_sms), **fused._mesh_attrs(table))
    return outs[:5]


moe_dispatch_matmul_p.def_abstract_eval(_abstract)
mlir.register_lowering(moe_dispatch_matmul_p, _lax)
if _ext.available():
    mlir.register_lowering(moe_dispatch_matmul_p, _cuda, platform="cuda")


# ---------------------------------------------------------------------------------------------------------
# The fused op with the unfused path's VJP

def _grouped_vjp(recv: jax.Array, w: jax.Array, rows: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(d recv, d w) of grouped_matmul(recv, w, rows), as its own VJP computes them (kernel or reference)."""
    use_kernel = _gm._kernel_unsupported(recv, w) is None and _ext.available()
    d_recv, d_w, _ = _gm._grouped_bwd(_gm.TILE_ROWS, use_kernel, _gm._variant(), (recv, w, rows), dy)
    return d_recv, d_w


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def dispatch_gate_up_rows(x, key, pos, order, w_gate, w_up, axis_name, sizes: RoutingSizes, num_comm_sms: int):
    """x (T, H), key / pos / order (T * K,) of routing.plan_local, w_gate / w_up (L, H, F) ->
    (recv (R, H), recv_counts (G, L), send_row (T * K,), gate (R, F), up (R, F))."""
    return tuple(fused._bind(moe_dispatch_matmul_p, x, key, pos, order, w_gate, w_up, axis_name=axis_name,
                             sizes=sizes, num_comm_sms=num_comm_sms))


def _fwd(x, key, pos, order, w_gate, w_up, axis_name, sizes, num_comm_sms):
    out = dispatch_gate_up_rows(x, key, pos, order, w_gate, w_up, axis_name, sizes, num_comm_sms)
    recv, recv_counts, send_row = out[:3]
    return out, (recv, recv_counts, send_row, w_gate, w_up)


def _bwd(axis_name, sizes, num_comm_sms, res, cts):
    recv, recv_counts, send_row, w_gate, w_up = res
    d_recv, _, _, d_gate, d_up = cts
    rows = expert_rows(recv_counts, sizes.recv_rows)
    dr_gate, dw_gate = _grouped_vjp(recv, w_gate, rows, d_gate)
    dr_up, dw_up = _grouped_vjp(recv, w_up, rows, d_up)
    d_rows = dr_gate + dr_up + d_recv.astype(recv.dtype)  # as autodiff sums the unfused path's two uses of recv
    dx = fused.pull(d_rows, send_row, None, axis_name, sizes.top_k, gather=False, g=sizes.g)
    return dx, None, None, None, dw_gate, dw_up


dispatch_gate_up_rows.defvjp(_fwd, _bwd)


def dispatch_gate_up(x: jax.Array, topk_ids: jax.Array, w_gate: jax.Array, w_up: jax.Array, axis_name: AxisName, *,
                     num_experts: int, capacity: int | None = None, recv_rows: int | None = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array, RoutingHandle]:
    """pk_jax.moe.dispatch followed by grouped_matmul(recv, w_gate) and grouped_matmul(recv, w_up), fused.

    Call inside `jax.shard_map` over `axis_name` (as pk_jax.moe.dispatch; the caller checked use_overlap).

    Args:
      x: (T, H); topk_ids: (T, K) global expert ids; w_gate, w_up: (L, H, F) this member's experts.
      num_experts, capacity, recv_rows: as pk_jax.moe.dispatch.

    Returns:
      (gate (R, F), up (R, F), counts (L,), handle): the grouped GEMMs of dispatch's rows, dispatch's counts
      and routing handle (for combine).
    """
    g = group_size(axis_name)
    sizes = routing.routing_sizes(g, num_experts, x.shape[0], topk_ids.shape[1], capacity, recv_rows)
    if w_gate.ndim != 3 or w_up.shape != w_gate.shape or w_gate.shape[:2] != (sizes.local_experts, x.shape[1]):
        raise ValueError(f"pk_jax.moe.overlap.dispatch_gate_up: w_gate and w_up must be (L, H, F) = "
                         f"({sizes.local_experts}, {x.shape[1]}, F), got {w_gate.shape} and {w_up.shape}")
    lp = routing.plan_local(topk_ids, sizes)
    axes = normalize_axis_name(axis_name)
    recv, recv_counts, send_row, gate, up = dispatch_gate_up_rows(x, lp.key, lp.pos, lp.order, w_gate, w_up, axes,
                                                                  sizes, comm_sms())
    recv_source_row, expert_counts, received = routing.plan_receive(recv_counts, sizes)
    h = RoutingHandle(lp.send_assignment, lp.assignment_slot, recv_source_row, expert_counts, received, lp.sent,
                      send_row, axis_name, sizes)
    return gate, up, expert_counts, h
