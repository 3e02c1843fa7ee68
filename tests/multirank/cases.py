"""The checked cases: each pk_jax op (local function of a member's blocks) with its NumPy float32
reference (a function of the group's blocks, in rank order, and the member's position). Shared by
check_ops.py (every case once) and soak.py (many calls in a random order)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pk_jax

F32 = np.float32


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    case: str
    dtype: str
    kind: str                                   # tolerance class (harness.TOLERANCES)
    local_shapes: tuple[tuple[int, ...], ...]   # each input's per-member block
    scales: tuple[float, ...]
    fn: Callable[..., tuple]                    # fn(axis, *blocks) -> tuple of local outputs
    ref: Callable[[list[list[np.ndarray]], int], list[np.ndarray]]  # (group blocks per input, position)
    shape: tuple[int, ...]                      # the row's shape (results-format: the op's own shape)
    grouped: bool = True                        # False: a local op (matmul), group of 1

    @property
    def name(self) -> str:
        return f"{self.op}/{self.case}/{self.dtype}"


def _f(blocks: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(b, F32) for b in blocks]


def collective_cases(g: int, dtype: str, quick: bool = False) -> list[Case]:
    """all_gather (axis 0 / last, tiled / stacked), reduce_scatter (dim 0 / last), all_reduce (three
    algorithms, below and above 1 MiB), all_to_all (B, S/G, H, D) -> (B, S, H/G, D)."""
    cases = []
    ag = (96, 160)
    for name, axis, tiled, ref in (
            ("axis0_tiled", 0, True, lambda xs: np.concatenate(xs, 0)),
            ("axis0", 0, False, lambda xs: np.stack(xs, 0)),
            ("last_tiled", -1, True, lambda xs: np.concatenate(xs, -1)),
            ("last", -1, False, lambda xs: np.stack(xs, -1))):
        if quick and name not in ("axis0_tiled", "last"):
            continue
        out_shape = ref([np.zeros(ag)] * g).shape
        cases.append(Case("all_gather", name, dtype, "exact", (ag,), (1.0,),
                          lambda ax, x, a=axis, t=tiled: (pk_jax.all_gather(x, ax, axis=a, tiled=t),),
                          lambda blocks, pos, r=ref: [r(_f(blocks[0]))], out_shape))
    rs = (64 * g, 48 * g)
    for name, dim in (("dim0", 0), ("last", 1)):
        if quick and name != "dim0":
            continue
        cases.append(Case("reduce_scatter", name, dtype, "reduce", (rs,), (1.0,),
                          lambda ax, x, d=dim: (pk_jax.reduce_scatter(x, ax, scatter_dimension=d, tiled=True),),
                          lambda blocks, pos, d=dim: [np.split(sum(_f(blocks[0])), g, axis=d)[pos]], rs))
    for size, shape in (("small", (64, 256)), ("large", (1024, 1024))):  # 64 KiB f32; >= 2 MiB in any dtype
        for algo in ("one_shot", "two_shot", "auto"):
            if quick and (size, algo) != ("small", "auto"):
                continue
            cases.append(Case("all_reduce", f"{algo}_{size}", dtype, "reduce", (shape,), (1.0,),
                              lambda ax, x, a=algo: (pk_jax.all_reduce(x, ax, algorithm=a),),
                              lambda blocks, pos: [sum(_f(blocks[0]))], shape))
    a2a = (2, 32, 2 * g, 64)
    cases.append(Case("all_to_all", "seq_to_heads", dtype, "exact", (a2a,), (1.0,),
                      lambda ax, x: (pk_jax.all_to_all(x, ax, 2, 1, tiled=True),),
                      lambda blocks, pos: [np.concatenate([np.split(b, g, axis=2)[pos] for b in _f(blocks[0])], 1)],
                      (2, 32 * g, 2 * g, 64)))
    return cases


def matmul_cases(dtype: str) -> list[Case]:
    a, b = (256, 512), (512, 384)
    return [Case("matmul", "local", dtype, "gemm", (a, b), (1.0, 1 / math.sqrt(b[0])),
                 lambda ax, x, w: (pk_jax.matmul(x, w),),
                 lambda blocks, pos: [_f(blocks[0])[pos] @ _f(blocks[1])[pos]], (a[0], b[1], a[1]), grouped=False)]


# Fused TP GEMMs: rows per member a multiple of 128 (the kernels' row chunk), x (256 G, 512) / w (512, 384).
M_PER_MEMBER, K, N = 256, 512, 384
FUSED_SCHEDULES = {"all_gather_matmul": ("comm_sms", "intra_sm", "small"),
                   "matmul_reduce_scatter": ("pull", "store_add", "small"),
                   "matmul_all_reduce": ("pull", "store_add", "small")}  # small: our GEMM + the LL collective


def _fused_call(op: str, schedule: str) -> Callable:
    def call(ax, x, w):
        if op == "all_gather_matmul":
            return pk_jax.all_gather_matmul(x, w, ax, return_gathered=True, schedule=schedule)
        f = pk_jax.matmul_reduce_scatter if op == "matmul_reduce_scatter" else pk_jax.matmul_all_reduce
        return (f(x, w, ax, schedule=schedule, deterministic=False),)
    return call


def _fused_ref(op: str, g: int) -> Callable:
    def ref(blocks, pos):
        xs, ws = _f(blocks[0]), _f(blocks[1])
        if op == "all_gather_matmul":
            gathered = np.concatenate(xs, 0)
            return [gathered @ ws[pos], gathered]
        total = sum(x @ w for x, w in zip(xs, ws))
        return [np.split(total, g, 0)[pos] if op == "matmul_reduce_scatter" else total]
    return ref


def _grad_call(op: str, schedule: str) -> Callable:
    """d/d(x, w) of the sum of the op's outputs (AG: product and gathered x), in float32."""
    call = _fused_call(op, schedule)

    def grads(ax, x, w):
        loss = lambda a, b: sum(jnp.sum(o.astype(jnp.float32)) for o in call(ax, a, b))
        return tuple(jax.grad(loss, argnums=(0, 1))(x, w))
    return grads


def _grad_ref(op: str, g: int) -> Callable:
    """The loss inside shard_map is per member; a varying output (AG, RS) sums the members' losses
    in the gradient, the invariant all-reduce output counts once (check_vma semantics)."""
    def ref(blocks, pos):
        xs, ws = _f(blocks[0]), _f(blocks[1])
        x, w = xs[pos], ws[pos]
        if op == "all_gather_matmul":
            gathered = np.concatenate(xs, 0)
            dx = np.ones((x.shape[0], N), F32) @ sum(ws).T + g
            return [dx, gathered.T @ np.ones((gathered.shape[0], N), F32)]
        return [np.ones((x.shape[0], N), F32) @ w.T, x.T @ np.ones((x.shape[0], N), F32)]
    return ref


def fused_cases(g: int, dtype: str, grads: bool = True) -> list[Case]:
    cases = []
    for op, schedules in FUSED_SCHEDULES.items():
        rows = M_PER_MEMBER if op == "all_gather_matmul" else M_PER_MEMBER * g
        shapes, scales = ((rows, K), (K, N)), (1.0, 1 / math.sqrt(K))
        for s in schedules:
            cases.append(Case(op, s, dtype, "gemm", shapes, scales, _fused_call(op, s), _fused_ref(op, g),
                              (M_PER_MEMBER * g, N, K)))
            if grads:
                cases.append(Case(op, f"{s}_grad", dtype, "gemm", shapes, scales, _grad_call(op, s),
                                  _grad_ref(op, g), (M_PER_MEMBER * g, N, K)))
    return cases
