"""Fused tensor-parallel GEMMs: the GEMM and its collective in one kernel, NVLink traffic hidden
under tensor-core work (paper 3.1.3, 4.1). Call inside `jax.shard_map` over one mesh axis (or a
tuple of axes), like the jax.lax composition each replaces:

  all_gather_matmul(x, w, axis)       == jnp.dot(lax.all_gather(x, axis, tiled=True), w)
  matmul_reduce_scatter(x, w, axis)   == lax.psum_scatter(jnp.dot(x, w), axis, tiled=True)
  matmul_all_reduce(x, w, axis)       == lax.psum(jnp.dot(x, w), axis)

(jnp.dot with float32 accumulation, output in the input dtype.) `transpose_w=True` takes w stored
(n, k) (e.g. a weight for an input gradient) and computes with wᵀ, read in place. The schedule (the SMs given to
communication; for RS/AR also store-add vs deterministic pull) is autotuned once per shape and GPU
and cached on disk (pk_jax/autotune.py); keyword arguments override it (num_comm_sms=0 or
schedule="xla" runs the unfused composition, which the autotuner also picks where it is faster).
Where the fused kernel cannot run (CPU, other dtypes, rows per member not a multiple of 128, ...)
the composition itself runs, with a one-time warning on GPUs. Gradients are those of the
composition, computed by fused kernels too (pk_jax/_tp_vjp.py: AG's backward is a GEMM+RS and a
GEMM, RS's an AG+GEMM and a GEMM, AR's two GEMMs), in the input dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config, core, dispatch
from jax._src import mesh as mesh_lib
from jax._src.lax.parallel import insert_collective_pvary
from jax.interpreters import mlir

from pk_jax import _ext, _tp_short, autotune, runtime
from pk_jax.sharding import group_size, normalize_axis_name
from pk_jax.sharding.mesh_groups import AxisName

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")  # index = kernel kind
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def kernel_kind(op: str, intra_sm: bool) -> int:
    """The kernel kind (kernels/tp_gemm.cuh): 0-2 with comm SMs; intra-SM AG 5, store-add RS/AR 3 and 4."""
    if not intra_sm:
        return OPS.index(op)
    return 5 if op == "all_gather_matmul" else OPS.index(op) + 2


def _dot(a: jax.Array, w: jax.Array, transpose_w: bool) -> jax.Array:
    """a (m, k) @ op(w) with w (k, n) or, transposed, (n, k): float32 accumulation, output in the
    product dtype (jnp.dot's)."""
    dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
    # Output in the product dtype directly (float32 accumulation inside, as jnp.dot): the VJP then stays
    # in bf16/fp16 too (an f32 result would make it cast the cotangent and operands to float32).
    return jax.lax.dot_general(a, w, dims, preferred_element_type=jnp.result_type(a, w))


@dataclasses.dataclass(frozen=True)
class TpSpec:
    op: str
    axis_name: tuple[Hashable, ...]
    group: int
    num_comm_sms: int | None  # None: autotuned at lowering
    fused: bool               # False: the kernel cannot run this call; lower to the composition
    intra_sm: bool = False    # the kernel without comm SMs (AG: pushers on every SM; RS/AR: store-add)
    may_intra_sm: bool = False   # autotuned: the intra-SM kernel is a candidate
    composition: bool = True     # autotuned: the unfused composition is a candidate
    tile: int = autotune.AUTO_TILE  # the block tile (set by the autotuner; AUTO_TILE: the kernel picks)
    # Backward pass only (pk_jax/_tp_vjp.py): its reduce-scatter/all-reduce deterministic; AG keeps the
    # gathered x from the forward for dw (False: gathers x again in the backward, saving G m k memory);
    # return_gathered: the caller sees AG's gathered x (its cotangent then adds into dx).
    deterministic: bool = False
    save_gathered: bool = True
    return_gathered: bool = False
    transpose_w: bool = False    # w is stored (n, k): the product is x @ wᵀ

    def n_of(self, w_shape: tuple[int, ...]) -> int:
        """The output columns n of w as stored ((k, n), or (n, k) with transpose_w)."""
        return w_shape[0] if self.transpose_w else w_shape[1]

    def out_shapes(self, m: int, n: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
        if self.op == "all_gather_matmul":
            return (self.group * m, n), (self.group * m, k)
        aux = (0, n) if self.intra_sm else (m, n)  # the partial product (a pull kernel may be chosen)
        if self.op == "matmul_reduce_scatter":
            return (m // self.group, n), aux
        return (m, n), aux

    def lax_apply(self, x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The composition the kernel replaces (and its second output: gathered x / partial)."""
        name = self.axis_name if len(self.axis_name) > 1 else self.axis_name[0]
        dot = lambda a: _dot(a, w, self.transpose_w)
        if self.op == "all_gather_matmul":
            gathered = jax.lax.all_gather(x, name, axis=0, tiled=True)
            return dot(gathered), gathered
        partial = dot(x)
        aux = partial[:0] if self.intra_sm else partial
        if self.op == "matmul_reduce_scatter":
            return jax.lax.psum_scatter(partial, name, scatter_dimension=0, tiled=True), aux
        return jax.lax.psum(partial, name), aux


pk_tp_gemm_p = core.Primitive("pk_tp_gemm")
pk_tp_gemm_p.multiple_results = True
pk_tp_gemm_p.def_impl(functools.partial(dispatch.apply_primitive, pk_tp_gemm_p))


def _abstract_eval(x, w, *, spec: TpSpec):
    (m, k), n = x.shape, spec.n_of(w.shape)
    out_shape, aux_shape = spec.out_shapes(m, n, k)
    product = jnp.result_type(x.dtype, w.dtype)  # as jnp.dot (the fused kernel needs x.dtype == w.dtype)
    out = x.update(shape=out_shape, dtype=product)
    aux = x.update(shape=aux_shape, dtype=x.dtype if spec.op == "all_gather_matmul" else product)
    if config._check_vma.value:
        varying = frozenset(x.mat.varying) | frozenset(w.mat.varying)
        group = set(spec.axis_name)
        out_v = varying - group if spec.op == "matmul_all_reduce" else varying | group
        out = out.update(manual_axis_type=x.mat.update(varying=frozenset(out_v)))
        aux = aux.update(manual_axis_type=x.mat.update(varying=frozenset(varying | group)))
    return out, aux


pk_tp_gemm_p.def_abstract_eval(_abstract_eval)


def _lax_lowering(ctx, x, w, *, spec: TpSpec):
    return mlir.lower_fun(lambda a, b: list(spec.lax_apply(a, b)), multiple_results=True)(ctx, x, w)


@functools.cache
def _warn_once(msg: str) -> None:
    warnings.warn(f"pk_jax: {msg}", stacklevel=4)


def _cache_key(spec: TpSpec, m: int, n: int, k: int, dtype, gpu: str) -> str:
    """The autotuner's cache key of an autotuned call (local x (m, k), w (k, n) or (n, k) with
    transpose_w: another layout is another kernel, timed on its own) on GPU model `gpu`."""
    choices = "+".join(c for c, on in (("intra_sm", spec.may_intra_sm), ("no_xla", not spec.composition),
                                       ("w_nk", spec.transpose_w)) if on)
    return autotune.key(spec.op, m, n, k, jnp.dtype(dtype).name, spec.group, gpu, choices)


def _with_cached_store_add(spec: TpSpec, x: jax.Array, w: jax.Array) -> TpSpec:
    """An autotuned RS/AR whose cached choice is store-add, traced as store-add: its second output is
    then (0, n), not the (m, n) partial product that only the pull kernel writes (2 GiB per call at
    m = n = 32768 in bf16). The lowering makes the same choice from the cache. The first trace, before
    any tuning, keeps the (m, n) output, which a pull choice needs."""
    if not spec.may_intra_sm or spec.op == "all_gather_matmul" or jax.default_backend() != "gpu":
        return spec
    (m, k), n = x.shape, spec.n_of(w.shape)
    hit = autotune.entries().get(_cache_key(spec, m, n, k, x.dtype, jax.devices()[0].device_kind))
    if hit is None or int(hit["num_comm_sms"]) != autotune.INTRA_SM:
        return spec
    return dataclasses.replace(spec, intra_sm=True, may_intra_sm=False, tile=int(hit.get("tile", autotune.AUTO_TILE)))


def _tuned_schedule(spec: TpSpec, table, x_aval, w_aval) -> autotune.Choice:
    """Autotunes the schedule over the first group of the mesh (every group has the same shape)."""
    from pk_jax.bench import timing

    (m, k), n = x_aval.shape, spec.n_of(w_aval.shape)
    if runtime.distributed.is_multiprocess():
        # Timing would need every process to time in lockstep and agree on the winner; the cached
        # choice (tuned in a single-process run on the same GPU model) or the default is the same on
        # every rank. (The kernels' SM counts follow each process's share of the GPU under MPS.)
        choice = autotune.cached_or_start(spec.op, _cache_key(spec, m, n, k, x_aval.dtype, jax.devices()[0].device_kind),
                                          spec.may_intra_sm)
        if choice.num_comm_sms == 0 and runtime.distributed.shares_gpu():  # NCCL refuses there: keep fusing
            choice = autotune.start_choice(spec.op, spec.may_intra_sm)
        return choice
    devices = {d.id: d for d in jax.devices()}
    member_ids, _ = table.members(table.mesh_ids[0])
    group_devs = [devices[i] for i in member_ids]
    cache_key = _cache_key(spec, m, n, k, x_aval.dtype, group_devs[0].device_kind)
    mesh = jax.sharding.Mesh(np.array(group_devs), ("pk_tune",))
    P = jax.sharding.PartitionSpec
    x_spec = P("pk_tune")  # local x blocks stacked on rows
    w_global = (spec.group * n, k) if spec.transpose_w else (spec.group * k, n)  # local w blocks stacked on rows

    # Ops per timed call, each on its own inputs (identical calls would be merged by XLA); as many as the
    # benchmark uses where memory allows: with fewer, the start skew between members weighs more and
    # ranked the intra-SM AG kernel behind comm SMs at N=8192, the reverse of 8-call timings.
    out_rows = m * spec.group if spec.op == "all_gather_matmul" else m  # (RS: m / group; the larger bound)
    per_call = (m * k + k * n + out_rows * n) * jnp.dtype(x_aval.dtype).itemsize
    calls = timing.calls_per_measure(per_call, budget_bytes=6 << 30, lo=2, hi=8)
    inputs: list = []  # made on the first timed candidate (never on a cache hit), shared by all

    def make_inputs() -> tuple[list, list]:
        make = jax.jit(lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(x_aval.dtype),
                       static_argnums=1, out_shardings=jax.sharding.NamedSharding(mesh, x_spec))
        return ([make(jax.random.key(i), (spec.group * m, k)) for i in range(calls)],
                [make(jax.random.key(10 + i), w_global) for i in range(calls)])

    compiled: dict = {}  # a candidate is timed again when it is among the best (autotune.choose)

    def time_candidate(c: autotune.Choice) -> float:
        if c not in compiled:
            intra = c.num_comm_sms == autotune.INTRA_SM
            tuned = dataclasses.replace(spec, axis_name=("pk_tune",), num_comm_sms=0 if intra else c.num_comm_sms,
                                        intra_sm=intra, may_intra_sm=False, tile=c.tile)
            body = lambda xs, ws: [pk_tp_gemm_p.bind(a, b, spec=tuned)[0] for a, b in zip(xs, ws)]
            compiled[c] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=([x_spec] * calls, [P("pk_tune")] * calls),
                                                out_specs=[P("pk_tune")] * calls, check_vma=False))
        if not inputs:
            inputs.extend(make_inputs())
        t0 = time.perf_counter()
        jax.block_until_ready(compiled[c](*inputs))
        return (time.perf_counter() - t0) * 1e3 / calls

    # Lowering runs inside the user's shard_map context; the tuning program has its own mesh.
    with mesh_lib.use_abstract_mesh(mesh_lib.AbstractMesh((), ())):
        return autotune.choose(spec.op, cache_key, time_candidate, max_sms=group_devs[0].core_count or 132,
                               intra_sm=spec.may_intra_sm, composition=spec.composition,
                               tiles=range(len(autotune.TILE_NAMES)))


def _cuda_lowering(ctx, x, w, *, spec: TpSpec):
    table, reason = runtime.lowering_group(ctx, spec.axis_name) if spec.fused else (None, None)
    if table is None:
        if reason:
            runtime.lax_fallback_allowed(spec.op, reason)
            _warn_once(f"{spec.op} over {spec.axis_name} runs the XLA composition: {reason}")
        return _lax_lowering(ctx, x, w, spec=spec)
    x_aval, w_aval = ctx.avals_in
    if spec.intra_sm:
        choice = autotune.Choice(autotune.INTRA_SM, spec.tile)
    elif spec.num_comm_sms is not None:
        choice = autotune.Choice(spec.num_comm_sms, spec.tile)
    else:
        choice = _tuned_schedule(spec, table, x_aval, w_aval)
    if choice.num_comm_sms == 0:  # the autotuner (or the caller) found the unfused composition faster here
        runtime.lax_fallback_allowed(spec.op, "the composition was asked for (schedule='xla' or num_comm_sms=0)")
        return _lax_lowering(ctx, x, w, spec=spec)
    intra = choice.num_comm_sms == autotune.INTRA_SM
    return jax.ffi.ffi_lowering("pk_tp_gemm")(
        ctx, x, w,
        kind=np.int32(kernel_kind(spec.op, intra)), tile=np.int32(choice.tile),
        num_comm_sms=np.int32(0 if intra else choice.num_comm_sms), transpose_w=np.int32(spec.transpose_w),
        mesh_ids=np.asarray(table.mesh_ids, np.int64), mesh_shape=np.asarray(table.mesh_shape, np.int64),
        group_axes=np.asarray(table.group_axes, np.int64))


mlir.register_lowering(pk_tp_gemm_p, _lax_lowering)
if _ext.available():
    mlir.register_lowering(pk_tp_gemm_p, _cuda_lowering, platform="cuda")


def _check(fn: str, x, w, axis_name: AxisName, num_comm_sms: int | None,
           transpose_w: bool = False) -> tuple[jax.Array, jax.Array, int]:
    x, w = jnp.asarray(x), jnp.asarray(w)
    w_form = "(n, k) (transpose_w=True)" if transpose_w else "(k, n)"
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"pk_jax.{fn}: x must be (m, k) and w {w_form}; got x{x.shape}, w{w.shape}. "
                         f"Reshape leading dimensions into m first.")
    w_k = 1 if transpose_w else 0
    if x.shape[1] != w.shape[w_k]:
        raise ValueError(f"pk_jax.{fn}: contraction sizes differ: x{x.shape}[1] = {x.shape[1]} but "
                         f"w{w.shape}[{w_k}] = {w.shape[w_k]} (w is {w_form})")
    if num_comm_sms is not None and (not isinstance(num_comm_sms, int) or num_comm_sms < 0):
        raise ValueError(f"pk_jax.{fn}: num_comm_sms={num_comm_sms!r}; pass None (autotune), a positive int, "
                         f"or 0 (run the unfused XLA composition)")
    return x, w, group_size(axis_name)


def _fusable(op: str, x: jax.Array, w: jax.Array, g: int, intra_sm: bool, transpose_w: bool) -> str | None:
    """Why the fused kernel (with or without comm SMs) cannot run this call (None: it can)."""
    if x.dtype != w.dtype or x.dtype not in KERNEL_DTYPES:
        return f"x and w are {x.dtype} and {w.dtype} (the kernel takes two bfloat16 or two float16 arrays)"
    if _ext.ext is None:
        return None  # CPU-only install: lowers to the composition anyway, silently
    (m, k), n = x.shape, w.shape[0] if transpose_w else w.shape[1]
    why = _ext.ext.tp_gemm_unsupported(kernel_kind(op, intra_sm), g, m, n, k, 1)
    return why or None


# schedule= names per op: (the kernel without comm SMs, the kernel with comm SMs). "xla": the composition.
SCHEDULES = {"all_gather_matmul": ("intra_sm", "comm_sms"), "matmul_reduce_scatter": ("store_add", "pull"),
             "matmul_all_reduce": ("store_add", "pull")}


def _call(op: str, x: jax.Array, w: jax.Array, axis_name: AxisName, num_comm_sms: int | None,
          deterministic: bool = True, schedule: str | None = None, transpose_w: bool = False,
          save_gathered: bool = True, return_gathered: bool = False):
    transpose_w = bool(transpose_w)
    x, w, g = _check(op, x, w, axis_name, num_comm_sms, transpose_w)
    intra_name, comm_name = SCHEDULES[op]
    if schedule not in (None, intra_name, comm_name, "small", "xla"):
        raise ValueError(f"pk_jax.{op}: schedule={schedule!r}; use None (autotuned), {intra_name!r}, "
                         f"{comm_name!r}, 'small' or 'xla'")
    (m, k), n = x.shape, (w.shape[0] if transpose_w else w.shape[1])
    if _tp_short.takes_small_path(op, schedule, m, n, k, g, max(x.dtype.itemsize, w.dtype.itemsize)):
        return _tp_short.apply(op, x, w, axis_name, transpose_w)
    if schedule == intra_name and num_comm_sms:
        raise ValueError(f"pk_jax.{op}: schedule={intra_name!r} uses no comm SMs; pass no num_comm_sms")
    if schedule == "store_add" and deterministic:
        raise ValueError(f"pk_jax.{op}: schedule='store_add' adds tiles in a varying order; pass "
                         f"deterministic=False, or schedule='pull' for identical bits")
    if schedule == "xla":
        num_comm_sms = 0
    why_intra = _fusable(op, x, w, g, intra_sm=True, transpose_w=transpose_w)
    why = why_intra if schedule == intra_name else _fusable(op, x, w, g, intra_sm=False, transpose_w=transpose_w)
    if why and jax.default_backend() == "gpu":
        runtime.lax_fallback_allowed(op, why)  # ranks sharing a GPU: a clear error, not NCCL's
        _warn_once(f"{op} runs the XLA composition: {why}")
    # The intra-SM AG is as deterministic as the other (no sums); store-add only with deterministic=False.
    intra_allowed = (op == "all_gather_matmul" or not deterministic) and why_intra is None
    spec = TpSpec(op, normalize_axis_name(axis_name), g, num_comm_sms, why is None,
                  intra_sm=schedule == intra_name,
                  may_intra_sm=schedule is None and intra_allowed and num_comm_sms is None,
                  composition=schedule != comm_name, transpose_w=transpose_w, deterministic=deterministic,
                  save_gathered=save_gathered, return_gathered=return_gathered)
    return _fused(x, w, _with_cached_store_add(spec, x, w))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fused(x, w, spec: TpSpec):
    x = insert_collective_pvary(spec.axis_name, x)
    return tuple(pk_tp_gemm_p.bind(x, w, spec=spec))


def _install_vjp() -> None:
    from pk_jax import _tp_vjp  # the backward pass (fused kernels in the input dtype) builds on this module

    _fused.defvjp(_tp_vjp.fused_fwd, _tp_vjp.fused_bwd)


_install_vjp()


def all_gather_matmul(x: jax.Array, w: jax.Array, axis_name: AxisName, *, return_gathered: bool = False,
                      schedule: str | None = None, num_comm_sms: int | None = None, transpose_w: bool = False,
                      deterministic: bool = False, save_gathered: bool = True):
    """all_gather(x) @ op(w) in one kernel.

    Args:
      x: (m, k) rows of this member (the activations, sharded on rows over `axis_name`).
      w: (k, n) local weights, or (n, k) with `transpose_w`.
      axis_name: the mesh axis (or tuple of axes) of the group, size G.
      return_gathered: also return the gathered x, (G m, k) (the backward pass of a layer needs it).
      schedule: None (default: autotuned once per shape and GPU), "comm_sms" (`num_comm_sms` whole SMs
        push x to the peers, then compute; the paper's schedule), "intra_sm" (one producer thread of
        every compute SM pushes pieces of x while the SM computes), "small" (the small-path all_gather, then
        our GEMM: no handshakes, for short x; `auto` picks it by size unless PK_JAX_SMALL_PATH=0) or "xla"
        (the composition).
      num_comm_sms: "comm_sms" schedule: SMs that push x (None: autotuned; 0: the composition).
      transpose_w: w is stored (n, k); computes all_gather(x) @ wᵀ reading w in place.
      deterministic: the backward pass's reduce-scatter (dx = RS(dy w^T)) uses only schedules that give
        identical bits every run (see `matmul_reduce_scatter`).
      save_gathered: True (default): the backward pass's dw = gathered_x^T dy uses the gathered x that the
        forward kernel wrote (G m k elements kept alive until then); False: gathers x again instead.

    Returns:
      (G m, n), or ((G m, n), (G m, k)) with return_gathered.
    """
    out, gathered = _call("all_gather_matmul", x, w, axis_name, num_comm_sms, deterministic, schedule,
                          transpose_w, save_gathered, return_gathered)
    return (out, gathered) if return_gathered else out


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis_name: AxisName, *, scatter_dimension: int = 0,
                          deterministic: bool = False, schedule: str | None = None,
                          num_comm_sms: int | None = None, transpose_w: bool = False) -> jax.Array:
    """psum_scatter(x @ op(w), scatter_dimension, tiled=True) in one kernel.

    Args:
      x: (m, k) with k this member's slice of the contraction.
      w: (k, n), or (n, k) with `transpose_w`.
      scatter_dimension: 0 (rows; the fused kernel) or 1 (columns; runs the composition).
      deterministic: False (default): the fastest schedule, measured (see `schedule`); with the
        store-add schedule the order of the adds varies, so the last bits can differ between runs
        at more than 2 members. True: only schedules that give identical bits every run.
      schedule: None (default: autotuned once per shape and GPU among those `deterministic` allows),
        "store_add" (each tile is added into its owner's output by TMA store-add as soon as it is
        computed; no extra SMs; needs deterministic=False), "pull" (the owner sums each tile over
        the members in rank order in float32 on `num_comm_sms` SMs: deterministic), "small" (our GEMM, then
        the small-path collective: no handshakes, deterministic; for short m, and picked by size with
        unless PK_JAX_SMALL_PATH=0) or "xla" (the unfused composition).
      num_comm_sms: pull schedule: SMs that reduce the tiles this member owns (None: autotuned;
        0: the unfused composition).
      transpose_w: w is stored (n, k); computes x @ wᵀ reading w in place.

    Returns:
      (m / G, n) for scatter_dimension=0, (m, n / G) for 1.
    """
    if scatter_dimension not in (0, 1, -1, -2):
        raise ValueError(f"pk_jax.matmul_reduce_scatter: scatter_dimension={scatter_dimension}; use 0 or 1")
    if scatter_dimension % 2 == 1:
        x, w, _ = _check("matmul_reduce_scatter", x, w, axis_name, num_comm_sms, bool(transpose_w))
        return jax.lax.psum_scatter(_dot(x, w, bool(transpose_w)), axis_name, scatter_dimension=1, tiled=True)
    return _call("matmul_reduce_scatter", x, w, axis_name, num_comm_sms, deterministic, schedule, transpose_w)[0]


def matmul_all_reduce(x: jax.Array, w: jax.Array, axis_name: AxisName, *, deterministic: bool = False,
                      schedule: str | None = None, num_comm_sms: int | None = None,
                      transpose_w: bool = False) -> jax.Array:
    """psum(x @ op(w)) in one kernel: x (m, k) with k this member's contraction slice, w (k, n) (or
    (n, k) with `transpose_w`, read in place as wᵀ); returns (m, n).

    `deterministic`, `schedule` and `num_comm_sms` as in `matmul_reduce_scatter`; here "store_add"
    adds every tile into every member's output (G - 1 copies of the partial cross NVLink, as many as
    the pull schedule's 2 (G - 1) / G at G = 2), and "pull" has the owner of each tile sum it in rank
    order and write it to every member: identical bits on every member and every run."""
    return _call("matmul_all_reduce", x, w, axis_name, num_comm_sms, deterministic, schedule, transpose_w)[0]
