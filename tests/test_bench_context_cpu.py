"""The context bench's compute floor (issue 26: a ring member's compute with communication off within 5% of our
attention kernel on the same blocks) on CPU devices: plumbing and the blocks' coverage of the member's work."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pk_jax.bench import compile_ahead, context
from tests.compile_ahead_probe import record_taken


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


@pytest.mark.parametrize("backward", [False, True])
def test_kernel_floor_program_has_no_collectives(backward):
    """The floor is one member's own work: no all-reduce of the replicated K/V's gradients, no permute."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    g = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), (context.AX,))
    c = context.Case("ring_attention", 2, 32 * g, 4, 16, True, "zigzag", backward)
    make = lambda i: jax.device_put(jax.random.normal(jax.random.key(i), (c.b, c.s, c.n, c.d)),
                                    NamedSharding(mesh, P(None, context.AX)))
    program, floor_args = context._kernel_floor(c, g, mesh, [make(0), make(1), make(2)])
    hlo = program.lower(*floor_args).compile().as_text()
    for op in ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter"):
        assert op not in hlo, f"{op} in the floor program"


@pytest.mark.parametrize("backward", [False, True])
def test_communication_off_removes_every_transfer(monkeypatch, backward):
    """The ring with communication off (under either transport setting) moves nothing between devices."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    monkeypatch.setenv("PK_JAX_RING_TRANSPORT", "xla")  # the floor compiles the "pk" schedule regardless
    g = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), (context.AX,))
    c = context.Case("ring_attention", 2, 32 * g, 4, 16, True, "zigzag", backward)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (c.b, c.s, c.n, c.d)),
                       NamedSharding(mesh, P(None, context.AX)))
    with context._transport("pk"), context._communication_off():
        hlo = context._program(context._ours(c), mesh, backward).lower(x, x, x).compile().as_text()
    permutes = [line for line in hlo.splitlines() if "collective-permute" in line]
    assert not permutes, permutes[:3]
    # The only all-reduce: the scalar loss of value_and_grad over the sharded output (ours has it too).
    assert all(" f32[] all-reduce(" in line for line in hlo.splitlines() if "= " in line and " all-reduce(" in line)
    from pk_jax.context import ring_overlap, ring_shift
    assert ring_overlap.shift_start is ring_shift.shift_start, "the shifts are restored afterwards"


def test_suite_reports_write_a_ratio_plot(tmp_path):
    """Every suite's results file gets a PNG beside it (pk_jax.bench._report -> results.plot_file), bounds drawn
    where the rows carry them; `python -m pk_jax.bench plot FILE.json` redraws it."""
    pytest.importorskip("matplotlib")
    from pk_jax.bench import results
    from pk_jax.bench.__main__ import main

    rows = [{"op": "ring_attention", "case": "fwd_causal_zigzag", "shape": [1, 64, 2, 8], "group": 4, "ours_ms": 1.0,
             "baseline": "all_gather K/V + cuDNN", "baseline_ms": 2.0, "ratio": 2.0,
             "extra": {"attention_alone_ms": 0.5}},
            {"op": "ring_attention", "case": "fwd_contiguous", "shape": [1, 64, 2, 8], "group": 4, "ours_ms": 2.0,
             "baseline": "all_gather K/V + cuDNN", "baseline_ms": 1.0, "ratio": 0.5, "extra": {}}]
    assert results._bound_ratio(rows[0]) == 4.0 and results._bound_ratio(rows[1]) is None
    rows += [dict(rows[1]), {"op": "sync", "case": "x", "shape": None, "ratio": 1.5, "extra": None}]  # same label; odd row
    path = tmp_path / "r.json"
    results.write(str(path), "context", rows)
    assert main(["plot", str(path)]) == 0
    png = tmp_path / "r.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()
    (tmp_path / "bad.json").write_text("not json")
    assert main(["plot", str(tmp_path / "bad.json"), str(path)]) == 1  # the bad file is named, the next one drawn
    assert png.exists()


@pytest.mark.parametrize("backward", [False, True])
def test_communication_off_keeps_every_steps_attention(backward):
    """Non-causal, every step of the ring with communication off attends the same blocks; XLA must not merge those
    steps into one (CSE: a compute_only time below one kernel's). Each step's dots survive: as many as in the ring
    with communication on, whose steps differ by the blocks that arrive."""
    import re

    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    g = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()), (context.AX,))
    c = context.Case("ring_attention", 2, 32 * g, 4, 16, False, "contiguous", backward)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (c.b, c.s, c.n, c.d)),
                       NamedSharding(mesh, P(None, context.AX)))
    dots = lambda: len(re.findall(r" dot\(", context._program(context._ours(c), mesh, backward)
                                  .lower(x, x, x).compile().as_text()))
    with context._transport("pk"):
        on = dots()
        with context._communication_off():
            off = dots()
    assert on >= 2 * g, f"{on} dots for {g} steps"  # at least QK^T and PV per step
    assert off == on, f"communication off: {off} dots, on: {on} (steps merged)"


def test_programs_compiled_ahead_are_the_ones_timed(monkeypatch):
    """compile_ahead.CompileAhead ($PK_JAX_BENCH_COMPILE_WORKERS): the suite's programs compiled on 2 workers before any timing
    give the rows one-at-a-time compiles give (checks, peak bytes), and the rows take them (ours and alone; no cuDNN
    baseline on CPU); 1 worker compiles nothing ahead."""
    run = lambda: context.run(small=True, reps=1, only="ring_attention", names=["fwd_causal_zigzag", "fwd_bwd_contiguous"])
    monkeypatch.setenv(compile_ahead.WORKERS_VAR, "1")
    assert compile_ahead.CompileAhead().pool is None
    serial = run()
    monkeypatch.setenv(compile_ahead.WORKERS_VAR, "2")
    used = record_taken(monkeypatch)
    ahead = run()
    assert [r["case"] for r in ahead] == [r["case"] for r in serial]
    for a, b in zip(ahead, serial):
        assert a["extra"]["check"] == b["extra"]["check"] and a["extra"]["peak_bytes"] == b["extra"]["peak_bytes"]
    assert {kind for _, kind in used} == {"ours", "alone"}  # no cuDNN baseline on CPU


def test_ring_transport_names_match_the_cli():
    """Every transport the bench knows is a --ring-transports choice, and no choice is unknown to it."""
    from pk_jax.bench.__main__ import build_parser
    from pk_jax.bench.context import TRANSPORTS

    action = next(a for a in build_parser()._actions if a.dest == "ring_transports")
    assert set(action.choices) == set(TRANSPORTS)
    assert TRANSPORTS["default"] == {} and TRANSPORTS["direct"] == {"PK_JAX_RING_MERGE": "dq-direct"}
    assert TRANSPORTS["split"] == {"PK_JAX_RING_LOCAL": "cudnn-split"}
    assert TRANSPORTS["whole"] == {"PK_JAX_RING_LOCAL": "cudnn-whole"}
    assert TRANSPORTS["pk-direct"] == {"PK_JAX_RING_LOCAL": "pk", "PK_JAX_RING_MERGE": "dq-direct"}
