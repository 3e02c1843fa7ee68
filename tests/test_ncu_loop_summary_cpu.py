"""scripts/ncu_loop_summary.py on a small Nsight Compute source CSV written here: it finds the loop by its wgmmas'
execution count, counts its opcodes per trip and attributes samples without a stall column to "unlisted";
scripts/ncu_top_stalls.py reads the same CSV through its parsing; scripts/ncu_per_task.py classes two such CSVs."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_loop_summary.py"
spec = importlib.util.spec_from_file_location("ncu_loop_summary", SCRIPT)
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
          "stall_barrier", "stall_wait (Not Issued)"]
# (address, SASS, samples, executed, wait, barrier): a peeled block run once per task (100 times) with more
# wgmmas than the loop body, which runs 1,000 times and holds most samples.
INSTRUCTIONS = [
    ("0x10", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ", 5, 100, 5, 0),
    ("0x20", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", 5, 100, 5, 0),
    ("0x30", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", 5, 100, 5, 0),
    ("0x40", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", 300, 1000, 20, 0),
    ("0x50", "@!P0 LOP3.LUT R2, R2, 0x3fff0, RZ, 0xc0, !PT", 50, 1010, 50, 0),
    ("0x60", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 400, 990, 0, 400),
    ("0x70", "MUFU.EX2 R3, R3", 45, 1000, 45, 0),
    ("0x80", "MUFU.EX2 R4, R4", 0, 1000, 0, 0),
]


def write_csv(path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "kernel"])
        w.writerow(HEADER)
        for addr, src, samples, executed, wait, barrier in INSTRUCTIONS:
            w.writerow([addr, "      " + src, samples, executed, wait, barrier, 0])


def test_loop_found_by_samples_and_summarized(tmp_path):
    path = tmp_path / "src.csv"
    write_csv(path)
    rows = summary.read_rows(str(path))
    assert len(rows) == len(INSTRUCTIONS)
    assert summary.loop_count(rows) == 1000  # not 100, which has more HGMMAs but fewer samples
    text = summary.summarize(rows, 1000, top=3)
    total = sum(i[2] for i in INSTRUCTIONS)
    loop_samples = 300 + 50 + 400 + 45 + 0
    assert f"loop: 5 instructions executed ~1000 times, {loop_samples / total:.1%} of all samples" in text
    assert "MUFU.EX2 2" in text and "LOP3.LUT 1" in text  # the predicate is not taken for the opcode
    # The first wgmma's 280 samples without a column of their own are "unlisted"; it is the second most sampled.
    lines = text.splitlines()
    assert "unlisted 280" in next(line for line in lines if "  0x40  " in line)
    share = {line.split()[0]: line.split()[1] for line in lines if line.startswith("  stall_") or "  unlisted " in line[:12]}
    assert share["stall_barrier"] == f"{400 / loop_samples:.1%}" and share["unlisted"] == f"{280 / loop_samples:.1%}"


def test_opcode_skips_predicates():
    assert summary.opcode("@!P1  BRA 0x10") == "BRA"
    assert summary.opcode("  FFMA R1, R2, R3, R4") == "FFMA"
    assert summary.opcode("") == ""


def test_top_stalls_reads_the_same_csv(tmp_path, capsys, monkeypatch):
    """scripts/ncu_top_stalls.py parses with this module's read_rows: the most sampled instruction comes first."""
    path = tmp_path / "src.csv"
    write_csv(path)
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    top_spec = importlib.util.spec_from_file_location("ncu_top_stalls", SCRIPT.parent / "ncu_top_stalls.py")
    top = importlib.util.module_from_spec(top_spec)
    top_spec.loader.exec_module(top)
    monkeypatch.setattr("sys.argv", ["ncu_top_stalls.py", str(path), "2"])
    top.main()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "0x60" in lines[0] and "WARPGROUP.DEPBAR" in lines[0] and "0x40" in lines[1]


def test_per_task_classes_instructions_by_count_growth(tmp_path, capsys, monkeypatch):
    """scripts/ncu_per_task.py: the long run's loop counts grow (x4 here), the per-task ones do not; the task run with
    many samples is listed, its samples summed over its instructions."""
    short, long = tmp_path / "short.csv", tmp_path / "long.csv"
    write_csv(short)
    with open(short) as f:
        rows = list(csv.reader(f))
    for r in rows[2:]:
        if int(r[3]) >= 990:  # the loop body: 4x the executions and samples at the longer length
            r[2], r[3] = str(4 * int(r[2])), str(4 * int(r[3]))
    with open(long, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec_task = importlib.util.spec_from_file_location("ncu_per_task", SCRIPT.parent / "ncu_per_task.py")
    per_task = importlib.util.module_from_spec(spec_task)
    spec_task.loader.exec_module(per_task)
    assert per_task.kind(100, 100) == "task" and per_task.kind(1000, 4000) == "loop" and per_task.kind(0, 0) == "never"
    monkeypatch.setattr("sys.argv", ["ncu_per_task.py", str(short), str(long), "--min-samples", "10"])
    per_task.main()
    out = capsys.readouterr().out.splitlines()
    classes = {line.split()[0]: line.split()[2] for line in out[:2]}
    assert classes == {"loop": "795", "task": "15"}  # 300 + 50 + 400 + 45 + 0 in the loop, 3 x 5 once per task
    task_run = next(line for line in out if line.startswith("task ") and "executed" in line)
    assert "0x10-0x30" in task_run and "executed         100         100" in task_run and "samples       15       15" in task_run
