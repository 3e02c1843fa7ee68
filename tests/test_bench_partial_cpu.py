"""Partial results (pk_jax.bench.results.start_partial / add_partial): a suite killed by `timeout N` leaves every
row it finished in <out>.partial.json; a finished run leaves only <out>.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pk_jax.bench import results

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_partial_file_holds_each_row_as_added(tmp_path):
    out = tmp_path / "r.json"
    partial = Path(results.partial_path(str(out)))
    assert partial == tmp_path / "r.partial.json"
    rows = [{"op": "x", "case": f"c{i}", "extra": {"i": i}} for i in range(3)]
    results.start_partial(str(out), "context")
    try:
        assert not partial.exists(), "nothing written before the first row"
        for i, row in enumerate(rows):
            results.add_partial(row)
            doc = _load(partial)
            assert doc["partial"] is True and doc["suite"] == "context" and doc["rows"] == rows[:i + 1]
    finally:
        results.stop_partial()
    results.add_partial({"op": "late"})  # after stop_partial: not kept
    assert _load(partial)["rows"] == rows
    final = results.write(str(out), "context", rows)
    assert set(_load(partial)) == set(final) | {"partial"}, "the partial file has the results file's shape"
    assert "partial" not in _load(out)
    results.discard_partial(str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"], "no partial, no temporary files left"
    results.discard_partial(str(out))  # none there: nothing to do


@pytest.mark.parametrize("argv", [
    ["attention", "--reps", "1", "--cases", "fwd", "fwd_causal", "--seqs", "256"],
    ["context", "--small", "--reps", "1", "--op", "ring_attention", "--cases", "fwd_contiguous"],
    ["moe", "--small", "--reps", "1", "--op", "grouped_matmul", "--cases", "uniform_fwd", "skewed_fwd"],
], ids=lambda a: a[0])
def test_suite_hands_each_finished_row_to_the_partial_file(tmp_path, monkeypatch, argv):
    """Each row is in the partial file as soon as it is finished; once the results file is written, the partial
    file is gone and the results file holds the same rows."""
    from pk_jax.bench.__main__ import main

    out = tmp_path / "r.json"
    partial = Path(results.partial_path(str(out)))
    kept = []
    add = results.add_partial

    def spy(row: dict) -> None:
        add(row)
        kept.append(row)
        assert _load(partial)["rows"] == json.loads(json.dumps(kept))

    monkeypatch.setattr(results, "add_partial", spy)
    handler = signal.getsignal(signal.SIGTERM)
    assert main([*argv, "--out", str(out)]) == 0
    assert kept and not partial.exists()
    assert _load(out)["rows"] == json.loads(json.dumps(kept))
    assert signal.getsignal(signal.SIGTERM) is handler, "the suite run's SIGTERM handler is put back"


def test_sigterm_leaves_the_finished_rows(tmp_path):
    """The context suite killed (SIGTERM, as `timeout N` sends) once its first row is printed: the rows finished
    by then are in the partial file (a row is kept before its line is printed), no results file."""
    out = tmp_path / "r.json"
    cases = ["fwd_contiguous", "fwd_causal_zigzag", "fwd_causal_contiguous"]
    cmd = [sys.executable, "-m", "pk_jax.bench", "context", "--small", "--reps", "1", "--op", "ring_attention",
           "--cases", *cases, "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("  ring_attention"):
                proc.send_signal(signal.SIGTERM)
                break
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 128 + signal.SIGTERM, "SIGTERM raised SystemExit"
    doc = _load(Path(results.partial_path(str(out))))
    assert doc["partial"] is True and doc["suite"] == "context"
    assert 1 <= len(doc["rows"]) < len(cases) and doc["rows"][0]["case"] == cases[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.partial.json"], "no results file, no temporary file"
