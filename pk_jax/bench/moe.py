"""`python -m pk_jax.bench moe`: expert-parallel dispatch, combine, grouped_matmul and moe_mlp.

Rows: op = dispatch | combine | grouped_matmul | moe_mlp | dispatch_gemm; shape = [T, hidden, experts, top_k] (T
tokens per member); case = routing (uniform | skewed) + _fwd | _fwd_bwd. extra.gbps = bytes that arrive at the busiest
receiver (dispatch: its rows; combine: the rows back at the busiest home member; moe_mlp: both) / time;
extra.remote_gbps counts the bytes the kernels move over NVLink to that receiver (forward cases): deduplicated
dispatch one row per (token, member) plus 4-byte src_of entries, combine by partials one float32 row per
(token, peer member) (fused.partials_pay), else every remote choice's row; backward cases count rows. extra.path: "fused" (the
kernels of pk_jax/moe/fused.py) or "reference" (the padded all_to_all exchange), as PK_JAX_MOE_DISPATCH picks.
dispatch, combine and moe_mlp also run at the DeepSeek-V3 per-GPU shape (T 4096, H 7168, E 256, top-8, F 2048,
uniform).
combine is timed alone: the routing handle and the rows come from a dispatch run once beforehand.
Baselines, timed in turns in the same run:
- dispatch and combine: the fused kernels before deduplication (PK_JAX_MOE_DEDUP=0: every choice's row
  crosses, combine pulls), the reference exchange (PK_JAX_MOE_DISPATCH=reference: padded pk_jax.all_to_all plus
  gathers) and, forward (GPU only: XLA:CPU lacks it), jax.lax.ragged_all_to_all of the sender-sorted rows,
  which leaves rows source-major (not regrouped by expert) and, for combine, sends them back the same way;
- grouped_matmul (on GPUs our grouped GEMM kernel): jnp.dot of the same FLOPs (the used rows times one
  expert's matrix), jax.lax.ragged_dot (skipped where XLA's dense emulation would need an (E, m, n) temporary
  over 8 GB) and, forward only, (GPU, if importable) jax.experimental.pallas ragged_dot_mgpu; also at the
  per-GPU shape of a DeepSeek-V3-sized layer (m 32768 = 4096 tokens x top-8, k 7168, n 2048, 64 experts);
- moe_mlp: the JAX composition (the ratio's baseline): jax.lax.ragged_all_to_all dispatch, the rows in
  per-expert buffers of capacity 1.25 x the mean, SwiGLU einsums, ragged_all_to_all back (_ragged_mlp; GPU only,
  like ragged_all_to_all); and GShard-style one-hot dispatch + capacity-padded einsum over pk_jax.all_to_all
  (capacity factor 1.25); both drop, so no check. Also at the DeepSeek-V3 per-GPU shape (uniform; there the
  one-hot baseline is left out: its (T, K, E, C) einsums are ~19 TFLOP).
- dispatch_gemm (--op dispatch_gemm; not in the default list): dispatch + the first grouped GEMM (gate and up)
  fused in one kernel (pk_jax/moe/overlap.py, PK_JAX_MOE_OVERLAP_SMS comm SMs) against the grouped GEMMs alone
  on already-dispatched rows (the baseline: extra.fused_over_gemm, the issue's target <= 1.1) and dispatch then
  the GEMMs unfused; at the DeepSeek-V3 per-GPU shape (T 4096, H 7168, E 256, top-8, F 2048, uniform) and
  skewed; extra.tflops counts the busiest member's gate + up FLOPs.
--variants (grouped_matmul): our kernel's schedule variants (PK_JAX_GROUPED_VARIANT: BENCH_VARIANTS) timed
in the same turns as the default and the baselines (extra.variants_ms, each checked against the default's
result: the variants change the schedule, not the sums); lax.ragged_dot is left out there (time). moe_mlp:
ours[compose], the experts' FFN composed from grouped_matmul and jax.nn (PK_JAX_MOE_EXPERT_FFN=compose) instead
of pk_jax/moe/expert_ffn.py (its SwiGLU rounds twice: extra.baseline_errors.variant_checks gives the difference).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.bench import results, timing
from pk_jax.moe import expert_ffn, fused, overlap, routing

AX = "ep"
# --variants: the schedule variants timed beside the default (PK_JAX_BENCH_GROUPED_VARIANTS, space-separated,
# replaces the list: e.g. "dyn+narrow dyn+narrow+pipe").
BENCH_VARIANTS = tuple(os.environ.get("PK_JAX_BENCH_GROUPED_VARIANTS", "dyn dyn+narrow dyn+n128 dyn+narrow+pipe").split())
_gm = importlib.import_module("pk_jax.moe.grouped_matmul")  # the module (the package attribute is the function)


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class _Traced:
    """A jitted function lowered (so traced) with environment variable `env` (default PK_JAX_GROUPED_VARIANT) set
    to `spec` (read at trace time)."""

    def __init__(self, jitted, spec: str, env: str = _gm.VARIANT_ENV):
        self.jitted, self.spec, self.env = jitted, spec, env

    def lower(self, *args):
        with _env(self.env, self.spec):
            return self.jitted.lower(*args)


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    t: int
    h: int
    e: int
    k: int
    f: int
    routing: str
    backward: bool

    @property
    def name(self) -> str:
        return f"{self.routing}_{'fwd_bwd' if self.backward else 'fwd'}"


DEEPSEEK_EXCHANGE = (4096, 7168, 256, 8, 2048)  # dispatch / combine at the issue's target shape (uniform)


def all_cases(g: int, small: bool) -> list[Case]:
    """Full: T 4096, H 4096, (E 64, K 4, F 1408) and (E 8 rounded up to G, K 2, F 4096); small: tiny."""
    shapes = [(64, 64, max(8, g), 2, 128)] if small else [(4096, 4096, 64, 4, 1408), (4096, 4096, max(8, g), 2, 4096)]
    out = []
    for kind in ("uniform", "skewed"):  # dispatch + first grouped GEMM (run by --op dispatch_gemm only)
        if small:
            out.append(Case("dispatch_gemm", 64, 64, max(8, g), 2, 128, kind, False))
        elif DEEPSEEK_EXCHANGE[2] % g == 0:
            out.append(Case("dispatch_gemm", *DEEPSEEK_EXCHANGE, kind, False))
    for op in ("dispatch", "combine", "grouped_matmul", "moe_mlp"):
        per_gpu = [] if small or op != "grouped_matmul" else [(4096, 7168, 64 * g, 8, 2048)]
        if not small and op in ("dispatch", "combine", "moe_mlp") and DEEPSEEK_EXCHANGE[2] % g == 0:
            out += [Case(op, *DEEPSEEK_EXCHANGE, "uniform", backward) for backward in (False, True)]
        for t, h, e, k, f in shapes + per_gpu:
            for kind in ("uniform", "skewed"):
                for backward in (False, True):
                    out.append(Case(op, t, h, e, k, f, kind, backward))
    return out


def _ids(c: Case, g: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((g * c.t, c.e))
    if c.routing == "skewed":
        scores[:, [0, c.e // 2]] += 2.0
    return np.argsort(-scores, axis=-1)[:, :c.k].astype(np.int32)


def _ragged_a2a_dispatch(x, ids, e: int):
    """Baseline: the sender's rows sorted by expert, exchanged by jax.lax.ragged_all_to_all (source-major)."""
    g = jax.lax.axis_size(AX)
    sizes = routing.routing_sizes(g, e, x.shape[0], ids.shape[1], None, None)
    order = jnp.argsort(ids.reshape(-1), stable=True)
    rows = x[order // ids.shape[1]]
    sent = jnp.zeros(e, jnp.int32).at[ids.reshape(-1)].add(1).reshape(g, -1).sum(1)
    recv = jax.lax.all_to_all(sent, AX, 0, 0, tiled=True)
    recv_off = jnp.cumsum(recv) - recv
    out_off = jax.lax.all_to_all(recv_off, AX, 0, 0, tiled=True)
    out = jnp.zeros((sizes.recv_rows, x.shape[1]), x.dtype)
    return jax.lax.ragged_all_to_all(rows, out, jnp.cumsum(sent) - sent, sent, out_off, recv, axis_name=AX)


def _ragged_a2a_combine(y, ids, wts, e: int):
    """Baseline: rows of _ragged_a2a_dispatch (source-major) back to their senders by
    jax.lax.ragged_all_to_all, unsorted, and summed by weight in float32."""
    g = jax.lax.axis_size(AX)
    t, k = ids.shape
    order = jnp.argsort(ids.reshape(-1), stable=True)
    sent = jnp.zeros(e, jnp.int32).at[ids.reshape(-1)].add(1).reshape(g, -1).sum(1)
    recv = jax.lax.all_to_all(sent, AX, 0, 0, tiled=True)
    back_off = jax.lax.all_to_all(jnp.cumsum(sent) - sent, AX, 0, 0, tiled=True)
    out = jnp.zeros((t * k, y.shape[1]), y.dtype)
    got = jax.lax.ragged_all_to_all(y, out, jnp.cumsum(recv) - recv, recv, back_off, sent, axis_name=AX)
    rows = jnp.zeros_like(got).at[order].set(got)
    return jnp.einsum("tkh,tk->th", rows.reshape(t, k, -1).astype(jnp.float32),
                      wts.astype(jnp.float32)).astype(y.dtype)


def _ragged_mlp(x, ids, wts, wg, wu, wd, cf: float = 1.25):
    """Baseline, the JAX composition issue 27 measures moe_mlp against: jax.lax.ragged_all_to_all dispatch
    (_ragged_a2a_dispatch: rows arrive source-major, expert-sorted within a source), the rows scattered into
    per-expert buffers of capacity cf x the mean (rows beyond it dropped, as GShard does), SwiGLU einsums,
    gathered back, and returned and weighted by _ragged_a2a_combine."""
    g = jax.lax.axis_size(AX)
    local = wg.shape[0]
    e, (t, k) = local * g, ids.shape
    recv = _ragged_a2a_dispatch(x, ids, e)                                     # (R, H)
    sent = jnp.zeros(e, jnp.int32).at[ids.reshape(-1)].add(1).reshape(g, local)
    counts = jax.lax.all_to_all(sent, AX, 0, 0, tiled=True)                    # [source, local expert]
    flat = counts.reshape(-1)                                                  # the received runs, in order
    ends = jnp.cumsum(flat)
    j = jnp.arange(recv.shape[0], dtype=jnp.int32)
    run = jnp.minimum(jnp.searchsorted(ends, j, side="right"), flat.size - 1)
    expert = run % local
    before = (jnp.cumsum(counts, 0) - counts).reshape(-1)                     # same expert, earlier sources
    pos = j - (ends - flat)[run] + before[run]
    cap = routing.expert_capacity(g * t, k, e, cf)
    valid = (j < ends[-1]) & (pos < cap)
    slot = jnp.where(valid, expert * cap + pos, local * cap)                   # out of range: dropped
    buf = jnp.zeros((local * cap, x.shape[1]), x.dtype).at[slot].set(recv, mode="drop").reshape(local, cap, -1)
    hid = jax.nn.silu(jnp.einsum("lch,lhf->lcf", buf, wg)) * jnp.einsum("lch,lhf->lcf", buf, wu)
    y = jnp.einsum("lcf,lfh->lch", hid, wd).reshape(local * cap, -1)
    back = jnp.where(valid[:, None], y.at[slot].get(mode="fill", fill_value=0), 0).astype(x.dtype)
    return _ragged_a2a_combine(back, ids, wts, e)


class _TracedPath:
    """A jitted program lowered with pk_jax.moe's path `impl` (fused.override) and the fused kernels deduplicated
    or not (fused.override_dedup): the reference exchange and the fused kernels before dedup as baselines in
    the same run as the default path. (Named apart from _Traced, the grouped GEMM variants' wrapper.)"""

    def __init__(self, impl: str, jitted, dedup: bool = True):
        self.impl, self.jitted, self.dedup = impl, jitted, dedup

    def lower(self, *args):
        with fused.override(self.impl), fused.override_dedup(self.dedup):
            return self.jitted.lower(*args)


def _routed_inputs(mesh: Mesh, disp: Callable, impl: str | None, x, ids):
    """(recv, handle leaves) of one dispatch run with path `impl` (None: as PK_JAX_MOE_DISPATCH says), and the
    function that rebuilds the handle from a member's leaves inside shard_map: combine's inputs, so that
    combine is timed alone."""
    meta: dict = {}

    def f(x, ids):
        recv, _, h = disp(x, ids)
        leaves, meta["tree"] = jax.tree.flatten(h)
        meta["scalar"] = [leaf.ndim == 0 for leaf in leaves]
        return recv, [leaf.reshape(1) if leaf.ndim == 0 else leaf for leaf in leaves]

    prog = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AX), out_specs=P(AX), check_vma=False))
    with fused.override(impl) if impl else contextlib.nullcontext():
        recv, leaves = prog(x, ids)
    rebuild = lambda ls: jax.tree.unflatten(meta["tree"], [l.reshape(()) if s else l
                                                           for l, s in zip(ls, meta["scalar"])])
    return recv, leaves, rebuild


def _capacity_einsum_mlp(x, ids, wts, wg, wu, wd):
    """Baseline: GShard one-hot dispatch with capacity factor 1.25, all_to_all, per-expert einsums, back."""
    g = jax.lax.axis_size(AX)
    local, t, k = wg.shape[0], x.shape[0], ids.shape[1]
    e = local * g
    cap = routing.expert_capacity(t, k, e, 1.25)
    keep = routing.capacity_keep(ids.reshape(-1), e, t, k, cap).reshape(t, k)
    onehot = jax.nn.one_hot(ids, e, dtype=jnp.int32)                    # (T, K, E)
    prio = jnp.swapaxes(onehot, 0, 1).reshape(k * t, e)                 # choice-major priority
    pos = (jnp.cumsum(prio, 0) - prio).reshape(k, t, e).swapaxes(0, 1)  # slot of each choice in its expert
    slot = jnp.sum(pos * onehot, -1)
    disp = (jax.nn.one_hot(ids, e, dtype=x.dtype)[..., None] * jax.nn.one_hot(slot, cap, dtype=x.dtype)[:, :, None]
            * keep[..., None, None].astype(x.dtype))                   # (T, K, E, C)
    xe = jnp.einsum("tkec,th->ech", disp, x).reshape(g, local, cap, -1)
    xe = pk_jax.all_to_all(xe, AX, 0, 0, tiled=True).reshape(g, local, cap, -1)
    hid = jax.nn.silu(jnp.einsum("glch,lhf->glcf", xe, wg)) * jnp.einsum("glch,lhf->glcf", xe, wu)
    ye = pk_jax.all_to_all(jnp.einsum("glcf,lfh->glch", hid, wd), AX, 0, 0, tiled=True).reshape(e, cap, -1)
    return jnp.einsum("tkec,tk,ech->th", disp, wts.astype(x.dtype), ye)


def _program(fn: Callable, mesh: Mesh, in_specs, backward: bool, diff: tuple[int, ...]) -> Callable:
    body = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(AX), check_vma=False)
    if backward:
        return jax.jit(jax.grad(lambda *a: jnp.sum(body(*a).astype(jnp.float32) ** 2), diff))
    return jax.jit(body)


def _try(jitted, args):
    try:
        compiled = jitted.lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        return (lambda xs: compiled(*xs)), None
    except Exception as e:  # noqa: BLE001 - reported in the row, the suite goes on
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _contenders(c: Case, g: int, mesh: Mesh, dtype, variants: bool = False):
    """(args, ours, [(name, baseline)], bytes at the busiest receiver, of them over NVLink) of one case;
    variants: our grouped GEMM's schedule variants as more contenders, named "ours[<variant>]"."""
    rng = np.random.default_rng(1)
    shard = NamedSharding(mesh, P(AX))
    put = lambda a, dt=dtype: jax.device_put(jnp.asarray(a, dt), shard)
    ids = put(_ids(c, g, 0), jnp.int32)
    x = put(rng.standard_normal((g * c.t, c.h)) / 4)
    wts = put(rng.uniform(0.1, 1.0, (g * c.t, c.k)))
    local = c.e // g
    disp = lambda x, ids: pk_jax.moe.dispatch(x, ids, AX, num_experts=c.e)
    # rows per receiver, for the busiest receiver's bytes and the grouped_matmul groups
    info = jax.jit(jax.shard_map(lambda x, ids: (disp(x, ids)[2].received[None], disp(x, ids)[1]), mesh=mesh,
                                 in_specs=P(AX), out_specs=P(AX)))(x, ids)
    busiest = int(np.max(info[0]))
    row_bytes = c.h * jnp.dtype(dtype).itemsize
    bases = []
    ids_np = _ids(c, g, 0).reshape(g, c.t * c.k) // local  # destination member of each assignment
    remote_in = max(int(np.sum((ids_np == d) & (np.arange(g)[:, None] != d))) for d in range(g))
    remote_back = max(int(np.sum(ids_np[s] != s)) for s in range(g))
    # NVLink bytes the kernels actually move (nothing drops here: no capacity, R the worst case). Deduplicated
    # dispatch: one row per (token, peer member) it has choices on, plus a 4-byte src_of entry per remote choice;
    # combine by partials: one float32 row per (token, peer member) it has choices on, into the token's home.
    per_token = ids_np.reshape(g, c.t, c.k)
    pairs = [[int(np.sum((per_token[s] == m).any(axis=1))) for m in range(g)] for s in range(g)]  # pairs[s][m]
    dedup_in = max(sum(pairs[s][d] for s in range(g) if s != d) for d in range(g))
    pairs_back = max(sum(pairs[s][m] for m in range(g) if m != s) for s in range(g))
    itemsize = jnp.dtype(dtype).itemsize
    fused_path = not c.backward and fused.use_fused(routing.routing_sizes(g, c.e, c.t, c.k, None, None), c.h, dtype)
    dedup = fused_path and fused.dispatch_dedup(g, c.k)  # the reference path moves rows
    partials = fused_path and fused.combine_partials(g, c.k, itemsize)
    if c.op == "dispatch":
        ours = _program(lambda x, ids: disp(x, ids)[0], mesh, P(AX), c.backward, (0,))
        args = [x, ids]
        bases.append(("reference exchange", _TracedPath("reference", _program(lambda x, ids: disp(x, ids)[0], mesh,
                                                                              P(AX), c.backward, (0,)))))
        bases.append(("fused before dedup", _TracedPath("fused", _program(lambda x, ids: disp(x, ids)[0], mesh, P(AX),
                                                                          c.backward, (0,)), dedup=False)))
        if not c.backward:
            bases.append(("lax.ragged_all_to_all", _program(lambda x, ids: _ragged_a2a_dispatch(x, ids, c.e), mesh,
                                                             P(AX), False, (0,))))
        moved = busiest * row_bytes
        remote = (dedup_in * row_bytes + remote_in * 4 if dedup else remote_in * row_bytes)
    elif c.op == "combine":
        def combine_program(rebuild):
            return _program(lambda y, wts, *leaves: pk_jax.moe.combine(y, wts, rebuild(leaves)), mesh, P(AX),
                            c.backward, (0, 1))
        recv, leaves, rebuild = _routed_inputs(mesh, disp, None, x, ids)
        ours = combine_program(rebuild)
        args = [recv, wts, *leaves]
        recv_r, leaves_r, rebuild_r = _routed_inputs(mesh, disp, "reference", x, ids)
        bases.append(("reference exchange", _TracedPath("reference", combine_program(rebuild_r)),
                      [recv_r, wts, *leaves_r]))
        bases.append(("fused before dedup", _TracedPath("fused", combine_program(rebuild), dedup=False)))
        if not c.backward and jax.devices()[0].platform == "gpu":
            try:
                y_lax = _program(lambda x, ids: _ragged_a2a_dispatch(x, ids, c.e), mesh, P(AX), False, (0,))(x, ids)
                bases.append(("lax.ragged_all_to_all", _program(
                    lambda y, ids, wts: _ragged_a2a_combine(y, ids, wts, c.e), mesh, P(AX), False, (0,)),
                    [y_lax, ids, wts]))
            except Exception as e:  # noqa: BLE001 - optional baseline
                print(f"  (lax.ragged_all_to_all combine baseline unavailable: {type(e).__name__})", flush=True)
        # rows that arrive back at the busiest home member (every kept choice's row)
        moved = c.t * c.k * row_bytes
        remote = pairs_back * c.h * 4 if partials else remote_back * row_bytes
    elif c.op == "grouped_matmul":
        rows = routing.worst_case_recv_rows(g, c.t, c.k)
        counts = np.asarray(info[1]).reshape(g, local)[int(np.argmax(info[0]))]
        dev = jax.devices()[0]
        gpu = dev.platform == "gpu"
        gs = jax.device_put(jnp.asarray(counts, jnp.int32), dev)
        kx, kw = jax.random.split(jax.random.key(1))  # on the device: w is ~1 GB at the per-GPU shape
        with jax.default_device(dev):
            xm = (jax.random.normal(kx, (rows, c.h), jnp.float32) / 4).astype(dtype)
            wm = (jax.random.normal(kw, (local, c.h, c.f), jnp.float32) / 64).astype(dtype)
            used = int(counts.sum())
            dense_args = [xm[:used], wm[0], gs]  # the same FLOPs as one GEMM
        one = lambda f: jax.jit(jax.grad(lambda a, b, s: jnp.sum(f(a, b, s).astype(jnp.float32) ** 2), (0, 1))
                                if c.backward else f)
        ours = _Traced(one(lambda a, b, s: pk_jax.grouped_matmul(a, b, s)), "")
        args = [xm, wm, gs]
        if variants:
            for spec in BENCH_VARIANTS:
                bases.append((f"ours[{spec}]", _Traced(one(lambda a, b, s: pk_jax.grouped_matmul(a, b, s)), spec)))
        if gpu and not c.backward:
            try:
                from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
                mg = lambda a, b, s: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s, block_m=64, block_n=256,
                                                                block_k=64, max_concurrent_steps=4, grid_block_n=2)
                bases.append(("pallas ragged_dot_mgpu", jax.jit(mg)))
            except Exception:  # noqa: BLE001 - optional baseline
                pass
        bases.append(("jnp.dot same FLOPs", one(lambda a, b, s: jnp.dot(a, b)), dense_args))
        if not variants and (not gpu or local * rows * c.f * 4 <= 8 << 30):  # XLA:GPU may emulate it densely
            bases.append(("lax.ragged_dot", one(lambda a, b, s: jax.lax.ragged_dot(a, b, s))))
        moved = int(counts.sum()) * row_bytes  # no exchange: the bytes of the busiest member's rows
        remote = 0
    elif c.op == "dispatch_gemm":
        args, ours, bases, moved, remote = _dispatch_gemm_contenders(c, mesh, x, ids, disp)
        remote = remote_in * row_bytes  # every remote choice's row crosses (the fused kernel does not deduplicate)
    else:
        wg, wu, wd = (_sharded_weights(i + 4, (c.e,) + s, shard, dtype) for i, s in
                      enumerate([(c.h, c.f), (c.h, c.f), (c.f, c.h)]))
        mlp = lambda x, ids, wts, a, b, d: pk_jax.moe.moe_mlp(x, ids, wts, a, b, d, AX)
        ours = _program(mlp, mesh, P(AX), c.backward, (0, 2, 3, 4, 5))
        args = [x, ids, wts, wg, wu, wd]
        if variants:  # the experts' FFN composed from grouped_matmul and jax.nn (before expert_ffn), same turns
            bases.append(("ours[compose]", _Traced(_program(mlp, mesh, P(AX), c.backward, (0, 2, 3, 4, 5)),
                                                   "compose", expert_ffn.MODE_ENV)))
        bases.append(("lax.ragged_all_to_all + capacity-padded einsum (cf 1.25)",
                      _program(_ragged_mlp, mesh, P(AX), c.backward, (0, 2, 3, 4, 5))))
        if (c.t, c.h, c.e, c.k, c.f) != DEEPSEEK_EXCHANGE:  # there its (T, K, E, C) one-hot einsums are ~19 TFLOP
            bases.append(("dispatch + capacity-padded einsum (cf 1.25)",
                          _program(_capacity_einsum_mlp, mesh, P(AX), c.backward, (0, 2, 3, 4, 5))))
        moved, remote = 2 * busiest * row_bytes, (remote_in + remote_back) * row_bytes
    return args, ours, bases, moved, remote


def _grouped_check(got, want, used: int, backward: bool, name: str) -> str:
    """Ours against a ragged_dot on the rows the group sizes cover. Forward: the output rows past their sum
    are only checked to be zero in ours (pk_jax.grouped_matmul's contract; ragged_dot_mgpu leaves them
    unwritten: NaN there on 4 x H100, 2026-11-26, skewed [4096, 7168, 256, 8])."""
    if not backward:
        tail_zero = bool(jnp.all(got[used:] == 0))
        e = results.rel_err(got[:used], want[:used])
        ok = e < 3e-2 and tail_zero
        return (f"{'ok' if ok else 'MISMATCH'} rel={e:.1e} vs {name} on {used} rows"
                + ("" if tail_zero else f"; rows past {used} not zero"))
    e = max(results.rel_err(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    return f"ok rel={e:.1e} vs {name}" if e < 3e-2 else f"MISMATCH rel={e:.1e} vs {name}"


def _sharded_weights(seed: int, shape: tuple[int, ...], sharding: NamedSharding, dtype) -> jax.Array:
    """Normal(0, 1 / shape[1]) weights drawn on the devices, each its own shard: the DeepSeek-V3 expert weights
    (256 x 7168 x 2048) are 3.8 G values, which NumPy drew and converted on the host for minutes (4 x H100,
    2026-11-26: no dispatch_gemm row in 170 s)."""
    draw = lambda key: (jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[1])).astype(dtype)
    return jax.jit(draw, out_shardings=sharding)(jax.random.key(seed))


def _dispatch_gemm_contenders(c: Case, mesh: Mesh, x, ids, disp):
    """dispatch + gate/up grouped GEMMs: fused (ours), the GEMMs alone on dispatched rows, dispatch then GEMMs."""
    wg, wu = (_sharded_weights(seed, (c.e, c.h, c.f), NamedSharding(mesh, P(AX)), x.dtype) for seed in (2, 3))
    gm = pk_jax.moe.grouped_matmul

    def fused_layer(x, ids, a, b):
        gate, up, _, _ = overlap.dispatch_gate_up(x, ids, a, b, AX, num_experts=c.e)
        return gate, up

    def unfused_layer(x, ids, a, b):
        recv, counts, _ = disp(x, ids)
        return gm(recv, a, counts), gm(recv, b, counts)

    routed = jax.jit(jax.shard_map(lambda x, ids: disp(x, ids)[:2], mesh=mesh, in_specs=P(AX), out_specs=P(AX)))
    recv, counts = routed(x, ids)
    alone = _program(lambda r, n, a, b: (gm(r, a, n), gm(r, b, n)), mesh, P(AX), False, (0,))
    ours = _program(fused_layer, mesh, P(AX), False, (0,))
    bases = [("grouped GEMM alone", alone, [recv, counts, wg, wu]),
             ("dispatch then GEMM", _program(unfused_layer, mesh, P(AX), False, (0,)))]
    busiest_rows = int(np.max(np.asarray(counts).reshape(mesh.devices.size, -1).sum(axis=1)))
    return [x, ids, wg, wu], ours, bases, busiest_rows * c.h * jnp.dtype(x.dtype).itemsize, 0


def run(small: bool, reps: int, dtype=jnp.bfloat16, only: str | None = None, cases: list[str] | None = None,
        hidden: list[int] | None = None, variants: bool = False) -> list[dict]:
    """only: ops (comma-separated); cases: case names (uniform_fwd, ...); hidden: hidden sizes; variants: the
    grouped GEMM's schedule variants too."""
    devices = jax.devices()
    g = len(devices)
    mesh = Mesh(np.array(devices), (AX,))
    rows = []
    ops = only.split(",") if only else None
    for c in all_cases(g, small):
        if (ops and c.op not in ops) or (cases and c.name not in cases) or (hidden and c.h not in hidden):
            continue
        if c.op == "dispatch_gemm" and (not ops or g < 2):  # only when asked for; needs an exchange
            continue
        args, ours_jit, bases, moved, remote = _contenders(c, g, mesh, dtype, variants)
        sizes = routing.routing_sizes(g, c.e, c.t, c.k, None, None)
        path = "fused" if fused.use_fused(sizes, c.h, dtype) else "reference"
        if c.op == "grouped_matmul":  # one GPU, no exchange: the kernel or its XLA fallback
            on_kernel = pk_jax._ext.available() and jax.default_backend() == "gpu" and \
                _gm._kernel_unsupported(args[0], args[1]) is None
            path = "kernel" if on_kernel else "xla"
        if c.op == "dispatch_gemm":
            path = (f"overlap[{overlap.comm_sms()} comm SMs]" if fused.use_fused(sizes, c.h, dtype)
                    and overlap.supported(sizes, c.h, c.f, dtype) else "emulation")
        ours, err = _try(ours_jit, args)
        if ours is None:
            raise RuntimeError(f"pk_jax.bench moe: {c.op} {c.name} failed: {err}")
        fns, names, errors = [ours], [], {}
        for name, b, *own in bases:  # (name, jitted[, its own args]: e.g. the dense GEMM of the same FLOPs)
            fn, berr = _try(b, own[0] if own else args)
            if fn is None:
                errors[name] = berr
            else:
                fns.append((lambda xs, f=fn, o=own[0]: f(o)) if own else fn)
                names.append(name)
        check = "no baseline"
        mine = [i for i, name in enumerate(names) if name.startswith("ours[")]
        if mine:  # the variants sum the same products in the same order: bit-identical to the default
            first = jax.tree.leaves(fns[0](args))
            for i in mine:
                again = jax.tree.leaves(fns[1 + i](args))
                same_bits = all(bool(jnp.array_equal(a, b)) for a, b in zip(first, again))
                errors.setdefault("variant_checks", {})[names[i]] = "identical" if same_bits else (
                    f"rel={max(results.rel_err(a, b) for a, b in zip(first, again)):.1e}")
        same = [i for i, name in enumerate(names) if name in ("lax.ragged_dot", "pallas ragged_dot_mgpu")]
        if c.op == "grouped_matmul" and same:
            check = _grouped_check(fns[0](args), fns[1 + same[-1]](args), int(np.asarray(args[2]).sum()),
                                   c.backward, names[same[-1]])
        times = timing.time_interleaved(fns, args, reps=reps, ops_per_call=1, min_sample_ms=timing.DEVICE_SAMPLE_MS)
        base = {k: v for k, v in zip(names, times[1:]) if not k.startswith("ours[")}
        mine_ms = {k[5:-1]: v for k, v in zip(names, times[1:]) if k.startswith("ours[")}
        names_b = [k for k in names if not k.startswith("ours[")]
        times_b = [times[0]] + [v for k, v in zip(names, times[1:]) if not k.startswith("ours[")]
        rows.append({
            "op": c.op, "case": c.name, "shape": [c.t, c.h, c.e, c.k], "dtype": jnp.dtype(dtype).name, "group": g,
            "ours_ms": round(times[0], 5), "baseline": names_b[0] if names_b else None,
            "baseline_ms": round(times_b[1], 5) if names_b else None,
            "ratio": round(times_b[1] / times[0], 4) if names_b else None,
            "extra": {"gbps": round(moved / times[0] / 1e6, 2), "busiest_bytes": moved, "ffn": c.f, "reps": reps,
                      "remote_gbps": round(remote / times[0] / 1e6, 2), "remote_bytes": remote, "path": path,
                      "baselines_gbps": {k: round(moved / v / 1e6, 2) for k, v in base.items()},
                      "baselines_ms": {k: round(v, 5) for k, v in base.items()}, "baseline_errors": errors,
                      "check": check},
        })
        if mine_ms:
            rows[-1]["extra"]["variants_ms"] = {k: round(v, 5) for k, v in mine_ms.items()}
        if c.op == "dispatch_gemm":
            rows[-1]["extra"].update(_dispatch_gemm_extra(c, fns, args, names, times, moved, dtype))
            ex = rows[-1]["extra"]
            check = (f"{ex['check']}  fused/GEMM-alone {ex.get('fused_over_gemm')}  unfused/GEMM-alone "
                     f"{ex.get('unfused_over_gemm')}  {ex['tflops']} TFLOP/s  ({ex['comm_sms']} comm SMs)")
        results.add_partial(rows[-1])  # before its line: a run killed once the line is out keeps the row
        print(f"  {c.op:<15}{c.name:<18}{str(rows[-1]['shape']):<24} ours ({path}) {times[0]:9.3f} ms  "
              f"{rows[-1]['extra']['gbps']:8.1f} GB/s ({rows[-1]['extra']['remote_gbps']:.1f} remote)  "
              + "  ".join(f"{k} {v:9.3f} ms" for k, v in base.items())
              + "".join(f"  ours[{k}] {v:9.3f} ms" for k, v in mine_ms.items())
              + "".join(f"  [{k}: {v}]" for k, v in errors.items()) + f"  {check}", flush=True)
    return rows


def _dispatch_gemm_extra(c: Case, fns, args, names, times, moved: int, dtype) -> dict:
    """The issue's ratio (fused / grouped GEMM alone; target <= 1.1), the unfused one, TFLOP/s, and the check
    of the fused outputs against dispatch then GEMM (same layout, same tiles: equal up to the tile width)."""
    out: dict = {"comm_sms": overlap.comm_sms()}
    ms = dict(zip(names, times[1:]))
    rows = moved // (c.h * jnp.dtype(dtype).itemsize)
    out["tflops"] = round(2 * rows * c.h * 2 * c.f / times[0] / 1e9, 1)
    if "grouped GEMM alone" in ms:
        out["fused_over_gemm"] = round(times[0] / ms["grouped GEMM alone"], 4)
        if "dispatch then GEMM" in ms:
            out["unfused_over_gemm"] = round(ms["dispatch then GEMM"] / ms["grouped GEMM alone"], 4)
    if "dispatch then GEMM" in names:
        ref = fns[1 + names.index("dispatch then GEMM")]
        e = max(results.rel_err(a, b) for a, b in zip(jax.tree.leaves(fns[0](args)), jax.tree.leaves(ref(args))))
        out["check"] = f"ok rel={e:.1e} vs dispatch then GEMM" if e < 2e-2 else f"MISMATCH rel={e:.1e}"
    return out


def print_table(rows) -> None:
    head = f"{'op':<15}{'case':<18}{'shape':<24}{'G':>3}{'ours ms':>11}{'GB/s':>9}{'base ms':>11}{'ratio':>7}  baseline"
    print(head)
    print("-" * len(head))
    for r in rows:
        fmt = lambda x, spec: "-" if x is None else format(x, spec)
        print(f"{r['op']:<15}{r['case']:<18}{str(r['shape']):<24}{r['group']:>3}{r['ours_ms']:>11.3f}"
              f"{r['extra']['gbps']:>9.1f}{fmt(r['baseline_ms'], '11.3f'):>11}{fmt(r['ratio'], '7.2f'):>7}  "
              f"{r['baseline'] or '-'}")
