"""A float32 sum over rows (axis 1) whose parts are added in one pass at the end instead of one pass each.

The ring's backward adds every block pair's dQ (and the owner's dK/dV parts) into a float32 array: each add
reads and writes the whole float32 slice (10 bytes per element with a 16-bit part), so G pairs cost G passes.
Kept as parts (in the dtype the kernel wrote them) with static row starts, the same sum costs one read of each
part and one write of the result, fused by XLA into one loop over concatenated row segments:

    s = RowSum.empty(shape=(B, T, N, H))
    s = s.add(part, start=0).add(other, start=T // 2)     # nothing computed yet
    y = s.total(jnp.bfloat16)                              # one pass: segment sums, concatenated

Where a caller needs the array itself (an in-kernel add, a lax.cond operand) `flush()` folds the parts into the
float32 base once. At most `max_parts` parts wait (more are folded in first), which bounds the memory they hold:
each is alive until the total. A part at a traced start is added at once (a dynamic-update-slice). Addition
order differs from adding each part as it comes (parts after the base, in the order added): float32 rounding
only.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
from jax import lax

from pk_jax._env import choice_setting
from pk_jax.context._varying import full_varying

MAX_PARTS = 4
SUMS_VAR = "PK_JAX_RING_SUMS"


def deferred_sums() -> bool:
    """$PK_JAX_RING_SUMS, read when the ring is traced: "deferred" (default: each block's (out, lse), the
    backward's dQ and the owner's dK/dV parts kept as LseParts / RowSum parts and merged or added in one pass
    at the end) or "eager" (each merged or added into float32 as it comes). Deferred measured on 4x H100
    (2026-11-27, G 4, S 12288, ms eager / deferred): fwd 10.11 / 9.31, causal zigzag fwd 7.36 / 5.96, causal
    zigzag fwd+bwd 28.91 / 26.98, fwd+bwd 40.16 / 40.67 (within the run's noise)."""
    return choice_setting(SUMS_VAR, "deferred", ("eager", "deferred"), owner="pk_jax.ring_attention") == "deferred"


def static_start(start, length: int, rows: int, owner: str) -> int | None:
    """`start` as a Python int (None where it is traced), checked: rows [start, start + length) lie in [0, rows)."""
    try:
        start = operator.index(start)
    except TypeError:  # a tracer
        return None
    if not 0 <= start <= rows - length:
        raise ValueError(f"{owner}: rows [{start}, {start + length}) are not within [0, {rows})")
    return start


def row_segments(rows: int, spans: list[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """[(a, b, covering)]: rows [0, rows) cut at every span's ends; covering lists the spans (their indices) that
    hold all of [a, b). The one place the deferred sums and merges do their row math."""
    cuts = sorted({0, rows, *(x for span in spans for x in span)})
    return [(a, b, [i for i, (s, e) in enumerate(spans) if s <= a and b <= e]) for a, b in zip(cuts[:-1], cuts[1:])]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSum:
    """base (float32 or None: zeros) plus parts[i] placed at rows starts[i] of axis 1; shape[1] == rows."""
    base: jax.Array | None
    parts: tuple[jax.Array, ...]
    starts: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    max_parts: int = dataclasses.field(default=MAX_PARTS, metadata=dict(static=True))

    @staticmethod
    def empty(shape: tuple[int, ...], max_parts: int = MAX_PARTS) -> RowSum:
        return RowSum(None, (), (), tuple(shape), max_parts)

    @staticmethod
    def of(base: jax.Array, max_parts: int = MAX_PARTS) -> RowSum:
        return RowSum(base.astype(jnp.float32), (), (), tuple(base.shape), max_parts)

    def add(self, part: jax.Array, start) -> RowSum:
        """This sum plus `part` at rows [start, start + part.shape[1])."""
        if part.shape[0] != self.shape[0] or part.shape[2:] != self.shape[2:]:
            raise ValueError(f"RowSum.add: part {part.shape} does not fit rows of {self.shape}")
        static = static_start(start, part.shape[1], self.shape[1], "RowSum.add")
        if static is None:  # traced: added now, into the base
            base = self.flush().array()
            return RowSum.of(lax.dynamic_update_slice_in_dim(
                base, lax.dynamic_slice_in_dim(base, start, part.shape[1], axis=1) + part.astype(jnp.float32),
                start, axis=1), self.max_parts)
        s = self if len(self.parts) < self.max_parts else self.flush()
        return RowSum(s.base, (*s.parts, part), (*s.starts, static), self.shape, self.max_parts)

    def spans(self) -> list[tuple[int, int]]:
        return [(a, a + p.shape[1]) for p, a in zip(self.parts, self.starts)]

    def total(self, dtype=jnp.float32) -> jax.Array:
        """base + every part, in `dtype`: one expression (slices, float32 adds, one concatenate, one convert)."""
        if not self.parts:
            return (self.base if self.base is not None else self._zeros(self.shape[1])).astype(dtype)
        if self.base is None and len(self.parts) == 1 and self.parts[0].shape == self.shape:
            return self.parts[0].astype(dtype)  # one part covering every row: as it is
        segs = []
        for a, b, covering in row_segments(self.shape[1], self.spans()):
            terms = [] if self.base is None else [self.base[:, a:b]]
            terms += [self.parts[i][:, a - self.starts[i]:b - self.starts[i]].astype(jnp.float32) for i in covering]
            seg = terms[0] if terms else self._zeros(b - a)
            for t in terms[1:]:
                seg = seg + t
            segs.append(seg.astype(dtype))
        return segs[0] if len(segs) == 1 else jnp.concatenate(segs, axis=1)

    def exact_dtype(self):
        """The dtype `total` can use without rounding: the parts' own where there is no base and the parts cover
        disjoint rows in one dtype (each element is one part's value or zero), else float32."""
        if self.base is not None or not self.parts or len({p.dtype for p in self.parts}) != 1:
            return jnp.float32
        spans = sorted(self.spans())
        disjoint = all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
        return self.parts[0].dtype if disjoint else jnp.float32

    def _zeros(self, rows: int) -> jax.Array:
        """float32 zeros of `rows` rows, varying (inside shard_map) over the axes the parts and base vary over."""
        like = [x for x in (self.base, *self.parts) if x is not None]
        return full_varying((self.shape[0], rows, *self.shape[2:]), 0.0, jnp.float32, like=like)

    def flush(self) -> RowSum:
        """The parts folded into a float32 base (one pass); nothing to do without parts."""
        return self if not self.parts else RowSum.of(self.total(jnp.float32), self.max_parts)

    def array(self) -> jax.Array:
        """The float32 sum as one array."""
        return self.total(jnp.float32)
