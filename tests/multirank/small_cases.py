"""The small-message path's cases for check_small.py / check_small_replay.py: the size sweep, the op
table (each op forced onto the small path, its NumPy float32 reference and the `variant` it must
lower to), and how a program is checked to hold those variants (its jaxpr: the API's choice, on CPU
too; its compiled HLO: the custom calls a GPU runs).

Sizes are each op's message per member: all_reduce and all_gather x, reduce_scatter one block (x holds
G of them). The LL lines serve 1..SMALL_MAX_BYTES (1 MiB), small_two_shot also needs x's 4-byte words
divisible by G; the chunk-flag all_reduces (small_chunked, small_pipelined, and "small" above the LL range)
and the LL128 one (small_ll128) serve 1..CHUNKED_MAX_BYTES (8 MiB).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

import pk_jax
from pk_jax import _small_path
from pk_jax._primitive import OP_CODES
from pk_jax.bench import hlo_checks

F32 = np.float32
MIB = 1 << 20
# Odd element counts, 16-bit halves ending at 2 (mod 4) bytes, around the 1 MiB cap, up to 8 MiB. A
# size that is not a whole number of elements of a dtype (6 B of float32) is left out for it.
SIZES = (4, 6, 10, 12, 30, 1002, 1004, 4096, 65534, 65536, 262148, MIB - 2, MIB, MIB + 4, MIB + 6, 8 * MIB)
QUICK_SIZES = (4, 6, 1004, MIB + 4)  # CPU CI: float32 runs 4 B, 1004 B and one size above the cap
BULK = -1  # `want` of an op the API must send down the bulk path (variant < VARIANT_SMALL)


@dataclasses.dataclass(frozen=True)
class SmallOp:
    """One op of a program: fn(axis, x) with x of `shape` (per member), checked against ref(blocks, pos)
    (blocks: the group's x in rank order, float32; pos: this member's place in the group)."""

    op: str                      # pk_jax function: all_reduce, all_gather, reduce_scatter
    case: str                    # what the row calls it: the forced algorithm or the layout
    shape: tuple[int, ...]
    kind: str                    # tolerance class of harness.TOLERANCES
    fn: Callable[[str, jax.Array], jax.Array]
    ref: Callable[[list[np.ndarray], int], np.ndarray]
    algorithm: str               # what fn passes: the small algorithm, or "auto" where the API refuses it
    want: int                    # variant the op must lower to (VARIANT_SMALL*, or BULK)
    refused: str = ""            # the API's refusal of the small algorithm (then the op runs with "auto")


def elements(nbytes: int, itemsize: int) -> int | None:
    return nbytes // itemsize if nbytes % itemsize == 0 else None


def factor_shape(n: int, ndim: int) -> tuple[int, ...]:
    """A rank-`ndim` shape of n elements: last dim the largest divisor <= 128, the middle ones <= 16."""
    dims, rest = [], n
    for cap in (128, 16)[: ndim - 1]:
        d = max(k for k in range(1, min(rest, cap) + 1) if rest % k == 0)
        dims.insert(0, d)
        rest //= d
    return (rest, *dims)


def _sum(blocks: Sequence[np.ndarray]) -> np.ndarray:
    return sum(np.asarray(b, F32) for b in blocks)  # rank order, float32: the kernels' order


def _expect(op: str, algorithm: str, nbytes: int, payload: int, g: int) -> tuple[int, str]:
    """(variant, refusal the API must give or "") by the issue's limits, independent of the API's code
    path: the LL lines take 1..SMALL_MAX_BYTES of payload (two-shot: words divisible by G), the chunk-flag
    all_reduce 1..CHUNKED_MAX_BYTES; auto follows _small_path's rule (PK_JAX_SMALL_PATH=1)."""
    if algorithm != "auto":
        cap = _small_path.max_bytes(algorithm) if op == "all_reduce" else _small_path.SMALL_MAX_BYTES
        if payload > cap:
            return BULK, f"payload {payload} B > {cap} B"
        if algorithm == "small_two_shot" and _small_path.words(nbytes) % g:
            return BULK, f"{_small_path.words(nbytes)} words not divisible by {g}"
        if op != "all_reduce":
            return _small_path.VARIANT_SMALL, ""
        if algorithm == "small":  # the API's pick by size and G
            algorithm = _small_path.all_reduce_choice(nbytes, g, auto=False)
        return _small_path.ALL_REDUCE_VARIANTS[algorithm], ""
    if op == "all_reduce":
        choice = _small_path.all_reduce_choice(nbytes, g, auto=True)
        return (BULK if choice is None else _small_path.ALL_REDUCE_VARIANTS[choice]), ""
    return (_small_path.VARIANT_SMALL if _small_path.copy_fits(payload, g, auto=True) else BULK), ""


def _ops_spec(g: int, n: int) -> list[tuple]:
    """(op, case, x shape, kind, call(axis, x, algorithm), ref, payload elements) of every row."""
    ar = lambda ax, x, a: pk_jax.all_reduce(x, ax, algorithm=a)
    rs0, rsl = factor_shape(n, 2), (1, n)  # blocks; x stacks G of them along the scatter dimension
    return [
        ("all_reduce", "small_one_shot", factor_shape(n, 3), "reduce", ar, lambda b, p: _sum(b), n),
        ("all_reduce", "small_two_shot", factor_shape(n, 2), "reduce", ar, lambda b, p: _sum(b), n),
        ("all_reduce", "small", (n,), "reduce", ar, lambda b, p: _sum(b), n),
        ("all_reduce", "small_chunked", factor_shape(n, 2), "reduce", ar, lambda b, p: _sum(b), n),
        ("all_reduce", "small_pipelined", factor_shape(n, 2), "reduce", ar, lambda b, p: _sum(b), n),
        ("all_reduce", "small_ll128", factor_shape(n, 2), "reduce", ar, lambda b, p: _sum(b), n),
        ("all_gather", "axis0_tiled", factor_shape(n, 2), "exact",
         lambda ax, x, a: pk_jax.all_gather(x, ax, axis=0, tiled=True, algorithm=a),
         lambda b, p: np.concatenate([np.asarray(v, F32) for v in b], 0), n),
        ("all_gather", "last_tiled", (1, n), "exact",  # contiguous blocks along the last axis: leading 1s
         lambda ax, x, a: pk_jax.all_gather(x, ax, axis=-1, tiled=True, algorithm=a),
         lambda b, p: np.concatenate([np.asarray(v, F32) for v in b], -1), n),
        ("reduce_scatter", "dim0", (g * rs0[0], rs0[1]), "reduce",
         lambda ax, x, a: pk_jax.reduce_scatter(x, ax, scatter_dimension=0, tiled=True, algorithm=a),
         lambda b, p: np.split(_sum(b), g, 0)[p], n),
        ("reduce_scatter", "last", (1, g * rsl[1]), "reduce",
         lambda ax, x, a: pk_jax.reduce_scatter(x, ax, scatter_dimension=-1, tiled=True, algorithm=a),
         lambda b, p: np.split(_sum(b), g, -1)[p], n),
    ]


def small_ops(g: int, nbytes: int, dtype, refusal: Callable[[Callable, tuple[int, ...]], str]) -> list[SmallOp]:
    """The ops of one program over a group of g at `nbytes` per member in `dtype` (empty when nbytes is
    not a whole number of elements). refusal(fn, shape) traces fn on x of `shape` and returns the
    API's ValueError message, "" when it accepts. A refused op runs with algorithm="auto" instead; its
    `refused` holds the message, or a mismatch note when the API refused what it should serve (or the
    reverse), which fails the row."""
    itemsize = np.dtype(dtype).itemsize
    n = elements(nbytes, itemsize)
    if n is None:
        return []
    out = []
    for op, case, shape, kind, call, ref, payload in _ops_spec(g, n):
        forced = case if op == "all_reduce" else "small"
        want, why_expected = _expect(op, forced, nbytes, payload * itemsize, g)
        got = refusal(lambda ax, x, c=call, a=forced: c(ax, x, a), shape)
        algorithm, refused = forced, ""
        if got or why_expected:
            algorithm = "auto"
            want, _ = _expect(op, "auto", nbytes, payload * itemsize, g)
            refused = got if got and why_expected else (
                f"MISMATCH: the API {'refused' if got else 'accepted'} algorithm={forced!r} "
                f"(expected {'a refusal: ' + why_expected if why_expected else 'it to serve it'}) {got}")
        out.append(SmallOp(op, case, shape, kind, lambda ax, x, c=call, a=algorithm: c(ax, x, a), ref,
                           algorithm, want, refused))
    return out


def jaxpr_variants(jaxpr) -> list[tuple[int, int]]:
    """(op code, variant) of every pk_collective equation in trace order, inside nested jaxprs too."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == "pk_collective":
            found.append((OP_CODES[e.params["spec"].op], e.params["spec"].variant))
        for v in e.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                found += jaxpr_variants(inner)
    return found


def _key(op_code: int, variant: int) -> tuple[int, int]:
    return op_code, variant if variant >= _small_path.VARIANT_SMALL else BULK


def variant_problems(want: Sequence[tuple[str, int]], jaxpr_found: Sequence[tuple[int, int]],
                     hlo_text: str | None) -> list[str]:
    """Per op of `want` ((op name, variant it must lower to), in call order), what is wrong with the
    variants the program holds ("" where nothing is): its own jaxpr equation (trace order is the call
    order) and, given the compiled HLO (GPU), the number of pk_collective custom calls of its (op,
    variant), since XLA may reorder them: a jax.lax fallback or another variant shows there."""
    keys = [(OP_CODES[op], v) for op, v in want]
    if len(jaxpr_found) != len(keys):
        return [f"{len(jaxpr_found)} pk_collective equations for {len(keys)} ops"] * len(keys)
    hlo = None
    if hlo_text is not None:
        hlo = collections.Counter(_key(a.get("op", -1), a.get("variant", -1))
                                  for a in hlo_checks.custom_call_attrs(hlo_text, "pk_collective"))
    counts = collections.Counter(keys)
    name = lambda v: "bulk" if v == BULK else str(v)
    problems = []
    for w, f in zip(keys, jaxpr_found):
        p = [] if _key(*f) == w else [f"jaxpr variant {f[1]}, want {name(w[1])}"]
        if hlo is not None and hlo[w] != counts[w]:
            p.append(f"compiled HLO holds {hlo[w]} pk_collective calls of (op {w[0]}, variant {name(w[1])}), "
                     f"want {counts[w]}")
        problems.append("; ".join(p))
    return problems
