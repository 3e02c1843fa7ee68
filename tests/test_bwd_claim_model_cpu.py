"""scripts/bwd_claim_model.py: every task claimed once in each order, and the makespans it reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bwd_claim_model as m  # noqa: E402


@pytest.mark.parametrize("tail", [0, 3, 8])
def test_claim_order_covers_every_task_once(tail):
    order = m.claim_order(8, 5, tail)
    assert sorted(order) == [(p, b) for p in range(8) for b in range(5)]
    assert order[: (8 - tail) * 5] == [(p, b) for p in range(8 - tail) for b in range(5)]  # pair order first
    assert [b for _, b in order[(8 - tail) * 5:]] == sorted(b for _, b in order[(8 - tail) * 5:])  # then block slowest


def test_makespan_of_pair_order_and_heaviest_first():
    # Causal GQA 8:1 at B16 S 4096 (32 pairs of 32 key blocks): the last pairs' heavy tasks come late in pair order.
    assert m.makespan_ratio(16, 4096, 16, 2, 128, 132, tail=0) == pytest.approx(1.1406, abs=1e-4)
    assert m.makespan_ratio(16, 4096, 16, 2, 128, 132, tail=32) == pytest.approx(1.0078, abs=1e-4)
    # Four pairs of tasks of 4 and 2 block pairs split evenly over two CTAs.
    assert m.makespan_ratio(1, 256, 4, 4, 128, 2, tail=0) == pytest.approx(1.0)
    assert m.tail_pairs_auto(32, 32, 132) == 17


def test_head_split_shortens_the_tail():
    # Each pair's 8 query heads over 2 or 8 units: the last heavy tasks 2x / 8x shorter; one head per unit balances as
    # the same shape without GQA (B16 S 4096 N16: 1.0176).
    assert m.makespan_ratio(16, 4096, 16, 2, 128, 132, tail=0, split=1) == pytest.approx(1.1406, abs=1e-4)
    assert m.makespan_ratio(16, 4096, 16, 2, 128, 132, tail=0, split=2) == pytest.approx(1.0703, abs=1e-4)
    assert m.makespan_ratio(16, 4096, 16, 2, 128, 132, tail=0, split=8) == pytest.approx(
        m.makespan_ratio(16, 4096, 16, 16, 128, 132, tail=0), abs=1e-4)

