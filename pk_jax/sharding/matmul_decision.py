"""Which lowering a sharded `a @ b` gets, from the shardings the partitioner chose (plain jit).

`a` is (rows..., k), `b` is (k, n). The partitioner (Shardy) hands us the operands' shardings and the
result sharding it wants; from those we pick, as Megatron would by hand:

- `all_gather_matmul` over axes G: a row dim of `a` ends with G and `b`'s n dim is sharded on G
  (column-parallel layer with a sequence-parallel input: gather the rows, multiply by local columns);
- `matmul_reduce_scatter` over G: k is sharded on G and the wanted result has a row dim ending with G
  (row-parallel layer with a sequence-parallel output);
- `matmul_all_reduce` over G: k is sharded on G otherwise;
- `matmul`: nothing to communicate (e.g. data-parallel rows, column-parallel weights).

When only one operand's k is sharded on some axes that the other operand uses elsewhere (the weight
gradient x^T @ dy of a sequence-parallel layer), that operand's k is gathered first (`gather_a_k` /
`gather_b_k`). Everything here works on PartitionSpec entries only, so it is tested without devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

Axes = tuple[Hashable, ...]  # one spec entry as a tuple of mesh axis names, major first; () = replicated


@dataclasses.dataclass(frozen=True)
class MatmulDecision:
    """The lowering of one sharded matmul and the shardings (as Axes per dim) it runs on."""
    op: str                 # "matmul" | "all_gather_matmul" | "matmul_reduce_scatter" | "matmul_all_reduce"
    group: Axes             # mesh axes of the fused op's group (() for "matmul")
    row_dim: int | None     # the row dim of `a` gathered (AG) or of the result scattered (RS)
    gather_a_k: Axes        # axes over which a's k dim is all-gathered before the op
    gather_b_k: Axes        # axes over which b's k dim is all-gathered before the op
    a_spec: tuple[Axes, ...]    # shardings the per-shard code expects
    b_spec: tuple[Axes, ...]
    out_spec: tuple[Axes, ...]

    @property
    def name(self) -> str:
        """E.g. 'matmul_reduce_scatter', or 'all_gather_k+matmul_all_reduce' when k is gathered first."""
        return ("all_gather_k+" if self.gather_a_k or self.gather_b_k else "") + self.op


def entry_axes(entry) -> Axes:
    """A PartitionSpec entry (None, 'tp' or ('data', 'tp')) as a tuple of axis names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _without(entry: Axes, axes: Sequence[Hashable]) -> Axes:
    return tuple(a for a in entry if a not in axes)


def _ends_with(entry: Axes, group: Axes) -> bool:
    return bool(group) and entry[len(entry) - len(group):] == group


def _common_prefix(p: Axes, q: Axes) -> Axes:
    n = 0
    while n < min(len(p), len(q)) and p[n] == q[n]:
        n += 1
    return p[:n]


def _contraction(a_rows, a_k: Axes, b_k: Axes, b_n: Axes) -> tuple[Axes, Axes, Axes]:
    """(group, gather_a_k, gather_b_k): the axes k stays sharded on (summed over after the GEMM) and
    the axes each operand's k is gathered over first. An operand with extra k axes that the other
    operand does not use elsewhere keeps them: the other is sliced to match (a local slice)."""
    common = _common_prefix(a_k, b_k)
    extra_a, extra_b = a_k[len(common):], b_k[len(common):]
    a_used = {x for e in a_rows for x in e}
    if extra_a and not extra_b and not set(extra_a) & set(b_n):
        return a_k, (), ()
    if extra_b and not extra_a and not set(extra_b) & a_used:
        return b_k, (), ()
    return common, extra_a, extra_b


def decide(a_spec: Sequence, b_spec: Sequence, out_spec: Sequence, row_sizes: Sequence[int],
           axis_sizes: dict[Hashable, int]) -> MatmulDecision:
    """Picks the lowering of a (rows..., k) @ b (k, n).

    Args:
      a_spec, b_spec: the operands' PartitionSpec entries (padded to their ranks).
      out_spec: the result sharding wanted (rows..., n).
      row_sizes: global sizes of a's row dims (a scatter needs its dim divisible by the group).
      axis_sizes: mesh axis name -> size.
    """
    a_rows = [entry_axes(e) for e in a_spec[:-1]]
    a_k, b_k, b_n = entry_axes(a_spec[-1]), entry_axes(b_spec[0]), entry_axes(b_spec[1])
    o_rows = [entry_axes(e) for e in out_spec[:-1]]
    group, gather_a, gather_b = _contraction(a_rows, a_k, b_k, b_n)
    if group:  # k stays sharded: every member holds a partial sum
        rows = [_without(e, group) for e in a_rows]
        n = _without(b_n, group + tuple(x for e in rows for x in e))
        size = _prod(axis_sizes, group)
        for j, (mine, want) in enumerate(zip(rows, o_rows)):
            per_shard = row_sizes[j] // _prod(axis_sizes, mine)
            if want == mine + group and per_shard % size == 0:
                out_rows = [e + group if i == j else e for i, e in enumerate(rows)]
                return MatmulDecision("matmul_reduce_scatter", group, j, gather_a, gather_b,
                                      (*rows, group + gather_a), (group + gather_b, n), (*out_rows, n))
        return MatmulDecision("matmul_all_reduce", group, None, gather_a, gather_b,
                              (*rows, group + gather_a), (group + gather_b, n), (*rows, n))
    for j, entry in enumerate(a_rows):
        if _ends_with(entry, b_n):  # sequence-parallel rows meet column-parallel weights
            out_rows = [e[:len(e) - len(b_n)] if i == j else e for i, e in enumerate(a_rows)]
            return MatmulDecision("all_gather_matmul", b_n, j, gather_a, gather_b,
                                  (*a_rows, a_k), (b_k, b_n), (*out_rows, b_n))
    n = _without(b_n, [x for e in a_rows for x in e])
    return MatmulDecision("matmul", (), None, gather_a, gather_b, (*a_rows, a_k), (b_k, n),
                          (*a_rows, n))


def _prod(axis_sizes: dict[Hashable, int], axes: Axes) -> int:
    size = 1
    for ax in axes:
        size *= axis_sizes[ax]
    return size
