"""The `pk_collective` primitive: abstract evaluation, autodiff, and lowering.

On CUDA (with the extension built and >= 2 local GPUs) it lowers to the `pk_collective` FFI custom
call; everywhere else — and whenever the GPU path cannot serve the call (no concrete mesh, devices of
other processes) — to the jax.lax op it mirrors, so results have identical semantics.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Hashable

import jax
import numpy as np
from jax._src import config, core
from jax._src.lax.parallel import insert_collective_pvary
from jax._src.interpreters import ad
from jax.interpreters import mlir

from pk_jax import _ext, runtime
from pk_jax._layout import Box

OP_CODES = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "all_to_all": 4}


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
    """Everything static about one collective call (hashable: it is the primitive's parameter)."""

    op: str
    axis_name: tuple[Hashable, ...]
    out_shape: tuple[int, ...]
    box: Box | None  # None: this call has no GPU kernel path (e.g. empty array)
    variant: int     # all_reduce: 0 one-shot, 1 two-shot; AG/A2A: 1 pull; >= 2 small path (_small_path.VARIANT_*)
    lax_kwargs: tuple[tuple[str, object], ...]

    @property
    def reduces(self) -> bool:
        return self.op == "all_reduce"

    def lax_apply(self, x: jax.Array) -> jax.Array:
        """The jax.lax op with the same semantics (fallback and reference)."""
        kw = dict(self.lax_kwargs)
        name = self.axis_name if len(self.axis_name) > 1 else self.axis_name[0]
        if self.op == "all_gather":
            return jax.lax.all_gather(x, name, **kw)
        if self.op == "reduce_scatter":
            return jax.lax.psum_scatter(x, name, **kw)
        if self.op == "all_reduce":
            return jax.lax.psum(x, name)
        return jax.lax.all_to_all(x, name, **kw)


pk_collective_p = core.Primitive("pk_collective")


def bind(x: jax.Array, spec: CollectiveSpec) -> jax.Array:
    """Binds the primitive after making x varying over the group axes, as jax.lax does."""
    x = insert_collective_pvary(spec.axis_name, x)
    return pk_collective_p.bind(x, spec=spec)


def _abstract_eval(x, *, spec: CollectiveSpec):
    if not config._check_vma.value:
        return x.update(shape=spec.out_shape)
    varying = x.mat.varying
    varying = varying - set(spec.axis_name) if spec.reduces else varying | set(spec.axis_name)
    return x.update(shape=spec.out_shape, manual_axis_type=x.mat.update(varying=frozenset(varying)))


pk_collective_p.def_abstract_eval(_abstract_eval)


def _transpose(ct, x, *, spec: CollectiveSpec):
    """The ops are linear; the backward pass of a gather is a reduce-scatter and vice versa, and an
    all-to-all's is the all-to-all with the axes swapped, so training runs on our kernels too.
    all_reduce's transpose under vma typing is not a collective: it defers to jax.lax."""
    from pk_jax import collectives  # the public ops build on this module

    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    kw = dict(spec.lax_kwargs)
    name = spec.axis_name if len(spec.axis_name) > 1 else spec.axis_name[0]
    if spec.op == "all_gather":
        return [collectives.reduce_scatter(ct, name, scatter_dimension=kw["axis"], tiled=kw["tiled"])]
    if spec.op == "reduce_scatter":
        return [collectives.all_gather(ct, name, axis=kw["scatter_dimension"], tiled=kw["tiled"])]
    if spec.op == "all_to_all":
        return [collectives.all_to_all(ct, name, kw["concat_axis"], kw["split_axis"], tiled=kw["tiled"])]
    (x_ct,) = jax.linear_transpose(spec.lax_apply, x.aval)(ct)
    return [x_ct]


ad.deflinear2(pk_collective_p, _transpose)


def _lax_lowering(ctx, x, *, spec: CollectiveSpec):
    return mlir.lower_fun(spec.lax_apply, multiple_results=False)(ctx, x)


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"pk_jax: using the jax.lax fallback on GPU: {reason}", stacklevel=3)


def _cuda_lowering(ctx, x, *, spec: CollectiveSpec):
    table, reason = runtime.lowering_group(ctx, spec.axis_name) if spec.box is not None else (None, None)
    if table is None:
        if reason:  # no reason: nothing for a kernel to do (empty array, group of one)
            runtime.lax_fallback_allowed(spec.op, reason)
            _warn_once(f"{spec.op} over {spec.axis_name}: {reason}")
        return _lax_lowering(ctx, x, spec=spec)
    box = spec.box
    return jax.ffi.ffi_lowering("pk_collective")(
        ctx, x,
        op=np.int32(OP_CODES[spec.op]),
        variant=np.int32(spec.variant),
        vec_bytes=np.int32(box.vec_bytes),
        mesh_ids=np.asarray(table.mesh_ids, np.int64),
        mesh_shape=np.asarray(table.mesh_shape, np.int64),
        group_axes=np.asarray(table.group_axes, np.int64),
        box=np.asarray(box.fields(), np.int64),
    )


mlir.register_lowering(pk_collective_p, _lax_lowering)
if _ext.available():
    mlir.register_lowering(pk_collective_p, _cuda_lowering, platform="cuda")
