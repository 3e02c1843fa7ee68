"""Partial attention results merged by their log-sum-exp in one pass at the end instead of one pass per block.

The ring's forward merges each block pair's (out, lse) into a float32 state as it comes: each merge reads and
writes the whole float32 state (about 10 bytes per element with a 16-bit block). Kept as parts (in the dtype the
attention wrote them) at static query rows, G blocks cost one read each and one write of the result, fused by XLA
into one loop over row segments (row_sum.row_segments):

    s = LseParts.empty(out_shape=(B, T, N, H))
    s = s.add(o_a, l_a, start=0).add(o_b, l_b, start=0)       # nothing computed yet
    out, lse = s.result()                                     # float32 out (B, T, N, H), lse (B, T, N)

At most `max_parts` parts wait (more are merged into a float32 base first). A row no part covers comes out as
out 0, lse -inf, as the ring's initial state. Used by the ring's forward with $PK_JAX_RING_SUMS=deferred (the default).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pk_jax.context._varying import full_varying
from pk_jax.context.online_softmax import merge_many
from pk_jax.context.row_sum import MAX_PARTS, row_segments, static_start


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LseParts:
    """base (out float32, lse) or None, plus parts (out_i, lse_i) at query rows starts[i] (axis 1)."""
    base: tuple[jax.Array, jax.Array] | None
    parts: tuple[tuple[jax.Array, jax.Array], ...]
    starts: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    max_parts: int = dataclasses.field(default=MAX_PARTS, metadata=dict(static=True))

    @staticmethod
    def empty(out_shape: tuple[int, ...], max_parts: int = MAX_PARTS) -> LseParts:
        return LseParts(None, (), (), tuple(out_shape), max_parts)

    def add(self, out: jax.Array, lse: jax.Array, start: int) -> LseParts:
        """These parts plus a block's (out (B, Tq, N, H), lse (B, Tq, N)) at query rows [start, start + Tq)."""
        start = static_start(start, out.shape[1], self.shape[1], "LseParts.add")
        if start is None:
            raise TypeError("LseParts.add: a static row start (merge a traced one into the state instead)")
        if out.shape[0] != self.shape[0] or out.shape[2:] != self.shape[2:] or lse.shape != out.shape[:3]:
            raise ValueError(f"LseParts.add: block {out.shape} / lse {lse.shape} does not fit rows of {self.shape}")
        s = self if len(self.parts) < self.max_parts else self.flush()
        return LseParts(s.base, (*s.parts, (out, lse)), (*s.starts, start), self.shape, self.max_parts)

    def result(self) -> tuple[jax.Array, jax.Array]:
        """(out float32 (B, T, N, H), lse (B, T, N)) of every part and the base: one expression."""
        rows = self.shape[1]
        if not self.parts and self.base is not None:
            return self.base
        if self.base is None and len(self.parts) == 1 and self.parts[0][0].shape == self.shape:
            out, lse = self.parts[0]
            return out.astype(jnp.float32), lse.astype(jnp.float32)  # one block covering every row
        spans = [(a, a + o.shape[1]) for (o, _), a in zip(self.parts, self.starts)]
        outs, lses = [], []
        for a, b, covering in row_segments(rows, spans):
            terms = [] if self.base is None else [(self.base[0][:, a:b], self.base[1][:, a:b])]
            terms += [(self.parts[i][0][:, a - self.starts[i]:b - self.starts[i]],
                       self.parts[i][1][:, a - self.starts[i]:b - self.starts[i]]) for i in covering]
            if not terms:
                like = [x for part in self.parts for x in part]
                seg_shape = (self.shape[0], b - a, *self.shape[2:])
                terms = [(full_varying(seg_shape, 0.0, jnp.float32, like=like),
                          full_varying(seg_shape[:3], -jnp.inf, jnp.float32, like=like))]
            o, l = merge_many([t[0] for t in terms], [t[1] for t in terms])
            outs.append(o)
            lses.append(l)
        cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)
        return cat(outs), cat(lses)

    def flush(self) -> LseParts:
        """The parts merged into a float32 base (one pass)."""
        return self if not self.parts else LseParts(self.result(), (), (), self.shape, self.max_parts)
