"""The asynchronous ring shift: member r's arrays land on member (r+1) mod G, while other work runs.

Two primitives, used as a pair inside `jax.shard_map` (pk_jax/context/ring_overlap.py):

    ys, token = shift_start(xs, axes)          # xs: a tuple of 1..4 arrays; ys: the predecessor's xs
                                               # (dists=(d, ...): member rank - d's, for an all-to-all)
    ...the step's compute, with its inputs made to depend on `token` (after_token)...
    ys = shift_done(ys, token, keep_alive=xs, after=result_of_the_compute)

On GPUs (the extension built, the group on this host) start is the `pk_ring_shift_start` FFI call: it
records an event on XLA's stream, makes the device's side stream wait for it and launches the shift
kernel there with `PK_JAX_RING_SHIFT_CTAS` CTAs (default 8; each pushes ~43-45 GB/s with 16-byte remote
stores on 2x H200), then returns. XLA's stream goes on with the step's attention, which leaves that many
SMs free (`reserve_sms`), so the transfer runs under it: that is `PK_JAX_RING_SHIFT_ENGINE=sm`. By default
(`copy`) the copy engines move the bytes instead where every member is a GPU of this process (ffi/copy_shift.h):
no SM is reserved; multi-process jobs run the kernel. done is
`pk_ring_shift_done`: XLA's stream waits for the side stream; its outputs alias ys. Handshakes use the
control block's side channel (kernels/pk/control_block.h), so a pk collective that XLA runs on its own
stream while a shift is in flight never takes the shift's epochs (docs/design.md).

Ordering (what keeps XLA from serializing the two): the step's compute must read its inputs through
`after_token(inputs, token)` (an optimization barrier over the inputs and the token), so it cannot be
hoisted above start; done takes the compute's result as an operand (`after`), so the wait cannot move
in front of the compute; and it takes xs (`keep_alive`), so XLA does not reuse xs's memory while the
side kernel still reads it. Compiled order on CPU (2 devices, forward, G = 2):
ppermute (start's fallback), opt-barrier, the step's attention and merge, opt-barrier (done's
fallback), the next step's attention (tests/test_ring_shift_cpu.py checks it in the HLO).

Elsewhere (CPU, no extension, a group XLA must carry) start lowers to `lax.ppermute` and done to an
optimization barrier that returns ys, with the same semantics and the same dependencies.
PK_JAX_RING_TRANSPORT=xla makes ring attention skip these primitives (its earlier ppermute ring).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config, core, dispatch
from jax._src.lax.parallel import insert_collective_pvary
from jax.interpreters import mlir

from pk_jax import _ext, runtime
from pk_jax._env import choice_setting, int_setting
from pk_jax.sharding import group_size

TRANSPORT_VAR = "PK_JAX_RING_TRANSPORT"
TRANSPORTS = ("pk", "xla")
CTAS_VAR = "PK_JAX_RING_SHIFT_CTAS"
DEFAULT_CTAS = 8
ENGINE_VAR = "PK_JAX_RING_SHIFT_ENGINE"
ENGINES = ("sm", "copy")  # the handler's `engine` attribute is the index
UNROLL_VAR = "PK_JAX_RING_SHIFT_UNROLL"
UNROLLS = (4, 8, 16)  # kernels/ring_shift.cuh kShiftUnrolls
MAX_BUFFERS = 4  # kernels/ring_shift.cuh kMaxShiftBuffers

Axes = tuple[Hashable, ...]

pk_ring_shift_start_p = core.Primitive("pk_ring_shift_start")
pk_ring_shift_start_p.multiple_results = True
pk_ring_shift_done_p = core.Primitive("pk_ring_shift_done")
pk_ring_shift_done_p.multiple_results = True


def transport() -> str:
    """How ring attention moves its blocks: $PK_JAX_RING_TRANSPORT, read when the ring is traced. "pk"
    (default): these primitives, overlapped with the attention; "xla": lax.ppermute between the steps."""
    return choice_setting(TRANSPORT_VAR, "pk", TRANSPORTS, owner="pk_jax.ring_attention")


def shift_engine() -> str:
    """What moves a shift's bytes: $PK_JAX_RING_SHIFT_ENGINE, read when traced. "copy" (default): the copy engines
    (cudaMemcpyPeerAsync on the side stream, handshakes by CUDA events between the members), no SM taken, so the
    attention keeps them all; where a member is in another process the kernel runs instead. "sm": the shift kernel
    on `shift_ctas()` SMs the attention leaves free; beside the attention on 4x H100 it pushed 166-221 GB/s whatever
    its CTAs and loads in flight, so the ring's forward waited for it. Measured side by side (ring rows at S 12288):
    on 4x H200 (2026-11-26) the copy engines were level on the forward (10.43 vs 10.38 ms) and faster on the others
    (causal zigzag fwd 6.85 vs 7.11, fwd+bwd 39.39 vs 40.31, causal zigzag fwd+bwd 26.45 vs 28.22); on 2x H100
    0.3-1.8 ms faster on the causal rows and level on the others."""
    return choice_setting(ENGINE_VAR, "copy", ENGINES, owner="pk_jax.ring_attention")


def shift_sms() -> int:
    """SMs a shift in flight takes from the work beside it: shift_ctas() for the SM kernel, 0 for the copy
    engines (multi-process jobs run the kernel whatever the setting)."""
    from pk_jax.distributed import is_multiprocess

    return shift_ctas() if shift_engine() == "sm" or is_multiprocess() else 0


def shift_ctas() -> int:
    """CTAs (one per SM) of the shift kernel: $PK_JAX_RING_SHIFT_CTAS, default 8, read when traced."""
    return int_setting(CTAS_VAR, DEFAULT_CTAS, minimum=1, owner="pk_jax.ring_attention", what="a count of CTAs")


def shift_unroll() -> int:
    """16-byte loads each thread of the shift kernel keeps in flight: $PK_JAX_RING_SHIFT_UNROLL, 4 (default), 8 or
    16, read when traced. A thread's push rate is bounded by its outstanding loads (the remote stores are
    posted): at 4 one SM pushed ~43-45 GB/s on 2x H200 but ~25-30 beside the attention on 4x H100 (8 CTAs: ~200-250
    GB/s of the link's ~370); 8 and 16 keep 2x / 4x the bytes in flight, which moved no ring row on 4x H100
    (2026-11-26, CTAs x loads 8:4 16:4 8:8 8:16 16:8)."""
    value = int_setting(UNROLL_VAR, 4, minimum=1, owner="pk_jax.ring_attention", what="a load count")
    if value not in UNROLLS:
        raise ValueError(f"pk_jax.ring_attention: ${UNROLL_VAR}={value}; use one of {UNROLLS}")
    return value


def _perm(g: int, dist: int = 1) -> list[tuple[int, int]]:
    return [(i, (i + dist) % g) for i in range(g)]


def _token_aval(xs):
    token = xs[0].update(shape=(), dtype=jnp.int32)
    if config._check_vma.value:
        varying = frozenset().union(*(x.mat.varying for x in xs))
        token = token.update(manual_axis_type=xs[0].mat.update(varying=varying))
    return token


def shift_start(xs: Sequence[jax.Array], axes: Axes, *, ctas: int | None = None,
                dists: Sequence[int] | None = None) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Starts moving `xs` (1..4 arrays) one member on along `axes`: returns (ys, token); ys is only
    valid after shift_done(ys, token, ...). A group of one: ys = xs, at once. dists: per array, how many
    members on it goes (1..G-1, default 1): ys[i] is then xs[i] of member rank - dists[i]."""
    xs = tuple(xs)
    if not 1 <= len(xs) <= MAX_BUFFERS:
        raise ValueError(f"pk_jax ring shift: 1..{MAX_BUFFERS} arrays per shift, got {len(xs)}")
    axes = tuple(axes)
    g = group_size(axes)
    if g == 1:
        return xs, jnp.zeros((), jnp.int32)
    dists = tuple(int(d) for d in dists) if dists is not None else (1,) * len(xs)
    if len(dists) != len(xs) or not all(1 <= d < g for d in dists):
        raise ValueError(f"pk_jax ring shift: dists {dists} must give each of the {len(xs)} arrays a distance in 1..{g - 1}")
    xs = tuple(insert_collective_pvary(axes, x) for x in xs)
    out = pk_ring_shift_start_p.bind(*xs, axes=axes, g=g, ctas=int(shift_ctas() if ctas is None else ctas), dists=dists,
                                     unroll=shift_unroll(), engine=shift_engine())
    return tuple(out[:-1]), out[-1]


def shift_done(ys: Sequence[jax.Array], token: jax.Array, *, keep_alive=(), after=()) -> tuple[jax.Array, ...]:
    """Finishes a shift: ys, now holding the sending members' arrays (the predecessor's at distance 1). `keep_alive`: the shift's xs (their
    memory must outlive the transfer); `after`: results that must be computed before this point (the
    step's compute, so the wait does not move in front of it). Both are pytrees, never read."""
    ys = tuple(ys)
    extra = tuple(jax.tree.leaves((keep_alive, after)))
    return tuple(pk_ring_shift_done_p.bind(*ys, token, *extra, n=len(ys)))


def after_token(tree, *tokens: jax.Array):
    """`tree` made to depend on `tokens` (an optimization barrier): what reads the result cannot be
    scheduled before the shifts that made the tokens were started."""
    out = lax.optimization_barrier((tree, tokens))
    return out[0]


# --- primitive rules -----------------------------------------------------------------------------

def _start_abstract(*xs, axes, g, ctas, dists, unroll, engine):
    return [*xs, _token_aval(xs)]


def _done_abstract(*args, n):
    return list(args[:n])


pk_ring_shift_start_p.def_abstract_eval(_start_abstract)
pk_ring_shift_done_p.def_abstract_eval(_done_abstract)
pk_ring_shift_start_p.def_impl(functools.partial(dispatch.apply_primitive, pk_ring_shift_start_p))
pk_ring_shift_done_p.def_impl(functools.partial(dispatch.apply_primitive, pk_ring_shift_done_p))


def _start_fallback(ctx, *xs, axes, g, ctas, dists, unroll, engine):
    def f(*xs):
        name = axes if len(axes) > 1 else axes[0]
        return [*(lax.ppermute(x, name, _perm(g, d)) for x, d in zip(xs, dists)), jnp.zeros((), jnp.int32)]

    return mlir.lower_fun(f, multiple_results=True)(ctx, *xs)


def _done_fallback(ctx, *args, n):
    # The barrier keeps done's dependencies (after, keep_alive) in the lowered program, so XLA orders and
    # keeps buffers alive as it does on GPUs (the memory tests measure the same live set).
    return mlir.lower_fun(lambda *a: list(lax.optimization_barrier(a)[:n]), multiple_results=True)(ctx, *args)


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"pk_jax: ring shift falls back to lax.ppermute on GPU: {reason}", stacklevel=3)


def _kernel_table(ctx, axes):
    """The group table when the kernel serves this shift, else None (after a one-time warning)."""
    table, reason = runtime.lowering_group(ctx, axes)
    if table is None and reason:
        runtime.lax_fallback_allowed("ring shift", reason)
        _warn_once(f"over {axes}: {reason}")
    return table


def _start_cuda(ctx, *xs, axes, g, ctas, dists, unroll, engine):
    table = _kernel_table(ctx, axes)
    if table is None:
        return _start_fallback(ctx, *xs, axes=axes, g=g, ctas=ctas, dists=dists, unroll=unroll, engine=engine)
    return jax.ffi.ffi_lowering("pk_ring_shift_start", has_side_effect=True)(
        ctx, *xs, engine=np.int32(ENGINES.index(engine)), ctas=np.int32(ctas), unroll=np.int32(unroll), dists=np.asarray(dists, np.int64),
        mesh_ids=np.asarray(table.mesh_ids, np.int64),
        mesh_shape=np.asarray(table.mesh_shape, np.int64), group_axes=np.asarray(table.group_axes, np.int64))


def _done_cuda(ctx, *args, n):
    # Harmless where start fell back: with no side stream on the device, done only passes ys through.
    return jax.ffi.ffi_lowering("pk_ring_shift_done", has_side_effect=True,
                                operand_output_aliases={i: i for i in range(n)})(ctx, *args)


mlir.register_lowering(pk_ring_shift_start_p, _start_fallback)
mlir.register_lowering(pk_ring_shift_done_p, _done_fallback)
if _ext.available():
    mlir.register_lowering(pk_ring_shift_start_p, _start_cuda, platform="cuda")
    mlir.register_lowering(pk_ring_shift_done_p, _done_cuda, platform="cuda")
