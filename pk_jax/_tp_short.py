"""The fused GEMMs at short sizes: our GEMM plus a small-path collective instead of the fused kernel.

A fused kernel pays the bulk protocol's handshakes (publish, ready, done: ~2 cross-GPU round trips,
docs/design-small-collectives.md) before and after its tiles. Where the traffic is a few hundred KiB (decode:
m = 1..256 tokens) those handshakes, not the bytes, set the time, and there is nothing large to hide under
the GEMM. There the op runs as two kernels with no handshake at all: AG+GEMM = small all_gather, then
pk_jax.matmul; GEMM+RS / GEMM+AR = pk_jax.matmul, then small reduce_scatter / all_reduce (one LL trip,
the sums in rank order in float32: identical bits on every member and every run). Gradients come from the
two ops' own VJPs (a gather's transpose is a reduce-scatter, and so on), on our kernels too.

Chosen by the collectives' `auto` rule (pk_jax._small_path; PK_JAX_SMALL_PATH=0 turns it off), or forced
with schedule="small".
"""

from __future__ import annotations

import jax

from pk_jax import _small_path
from pk_jax.context._varying import varying_axes
from pk_jax.sharding.mesh_groups import AxisName


def payload_fits(op: str, m: int, n: int, k: int, g: int, itemsize: int, auto: bool) -> bool:
    """Whether the small path serves op's collective: AG moves x (m, k); RS one (m / G, n) chunk of the
    partial product; AR the whole (m, n) partial. auto: the size rule `auto` uses; else the path's cap."""
    if op == "all_gather_matmul":
        return _small_path.copy_fits(m * k * itemsize, g, auto)
    if op == "matmul_reduce_scatter":
        return m % g == 0 and _small_path.copy_fits(m // g * n * itemsize, g, auto)
    # up to SMALL_MAX_BYTES only (larger partials are not measured under a GEMM); within it, whatever
    # all_reduce_choice picks (LL128 by default: two-shot from G = 3 and 256 KiB)
    nbytes = m * n * itemsize
    return nbytes <= _small_path.SMALL_MAX_BYTES and _small_path.all_reduce_choice(nbytes, g, auto) is not None


def takes_small_path(op: str, schedule: str | None, m: int, n: int, k: int, g: int, itemsize: int) -> bool:
    """schedule "small": yes (ValueError if the small path cannot serve it); None: by `auto`."""
    if schedule == "small":
        if op == "matmul_reduce_scatter" and m % g:
            raise ValueError(f"pk_jax.{op}: schedule='small' needs x's rows (m={m}) divisible by the group size {g}")
        if not payload_fits(op, m, n, k, g, itemsize, auto=False):
            raise ValueError(f"pk_jax.{op}: schedule='small' serves collectives of at most "
                             f"{_small_path.SMALL_MAX_BYTES} bytes per member (m={m}, n={n}, k={k}, G={g}); "
                             f"use schedule=None")
        return True
    return schedule is None and g > 1 and _small_path.auto_enabled() and payload_fits(op, m, n, k, g, itemsize,
                                                                                      auto=True)


def apply(op: str, x: jax.Array, w: jax.Array, axis_name: AxisName, transpose_w: bool) -> tuple[jax.Array,
                                                                                                  jax.Array | None]:
    """(out, gathered x for AG / None) of op on x (m, k) and w (k, n) (or (n, k) with transpose_w)."""
    from pk_jax import collectives
    from pk_jax.matmul import matmul

    def product(a: jax.Array, b: jax.Array) -> jax.Array:
        # pk_jax.matmul's VJP returns gradients typed like the product: an operand invariant over an axis
        # the other varies over (AG's replicated w) is cast to varying first; its gradient is then summed
        # over the members by pk_jax.all_reduce (pk_jax.pcast), as the fused op's VJP does.
        axes = varying_axes(a, b)
        a, b = (collectives.pcast(t, tuple(sorted(axes - varying_axes(t), key=str)), to="varying")
                if axes - varying_axes(t) else t for t in (a, b))
        return matmul(a, b, transpose_b=transpose_w)

    if op == "all_gather_matmul":
        gathered = collectives.all_gather(x, axis_name, axis=0, tiled=True, algorithm="small")
        return product(gathered, w), gathered
    partial = product(x, w)
    if op == "matmul_reduce_scatter":
        return collectives.reduce_scatter(partial, axis_name, scatter_dimension=0, tiled=True,
                                          algorithm="small"), None
    return collectives.all_reduce(partial, axis_name, algorithm="small"), None
