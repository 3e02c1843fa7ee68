"""The context bench's compute floor (issue 26: a ring member's compute with communication off within 5% of our
attention kernel on the same blocks) on CPU devices: plumbing and the blocks' coverage of the member's work."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pk_jax.bench import context


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", True), ("contiguous", False)])
@pytest.mark.parametrize("g", [2, 4, 8])
def test_member_blocks_are_the_members_query_rows_and_visible_keys(g, layout, causal):
    c = context.Case("ring_attention", 1, 16 * g, 2, 8, causal, layout, False)
    t = c.s // g
    for rank in range(g):
        pos = np.asarray(context._positions(c, g, rank))
        blocks = context._member_blocks(c, g, rank)
        assert sum(rows for _, rows, _ in blocks) == t and blocks[0][0] == 0
        for start, rows, keys in blocks:
            q = pos[start:start + rows]
            assert np.array_equal(q, np.arange(q[0], q[0] + rows)), "a block's rows are consecutive positions"
            assert keys == (q[-1] + 1 if causal else c.s), "keys up to the block's last row (all when not causal)"


def test_compute_floor_columns():
    rows = context.run(small=True, reps=1, only="ring_attention", names=["fwd_causal_zigzag", "fwd_bwd_contiguous"],
                       compute_floor=True)
    assert len(rows) == 2 and all(r["group"] == len(jax.devices()) for r in rows)
    for r in rows:
        e = r["extra"]
        assert e["compute_only_ms"] > 0 and e["kernel_floor_ms"] > 0, e
        assert e["compute_over_floor"] == pytest.approx(e["compute_only_ms"] / e["kernel_floor_ms"], rel=1e-3)
        assert r["extra"]["check"].startswith("ok")
