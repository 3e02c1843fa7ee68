"""Where a persistent kernel's per-task cost goes, from two Nsight Compute source CSVs of the same build at two
lengths (e.g. the attention forward at S 4096 and S 16384 with the same number of tasks):

    python3 scripts/ncu_per_task.py short.csv long.csv [--min-samples 150]

An instruction whose execution count grows with the length (ratio > 3) is loop code, one whose count does not (ratio
0.8-1.25) runs once per task (or per CTA). Prints the stall samples of each class at both lengths, then the runs of
consecutive instructions with the same execution counts (address range, counts, samples, the first instruction and
the main opcodes): the task-level runs with many samples are the per-task cost. Session 39 found the forward's this
way (work_of's divisions, finish_rows' IEEE reciprocal and logf). The reports need the SourceCounters section."""

from __future__ import annotations

import argparse
import collections

from ncu_loop_summary import EXECUTED, SAMPLES, number, opcode, read_rows


def kind(short_count: float, long_count: float) -> str:
    """loop, task or other, by how an instruction's execution count grows from the short run to the long one."""
    if short_count == 0 and long_count == 0:
        return "never"
    ratio = long_count / max(short_count, 1.0)
    return "loop" if ratio > 3.0 else "task" if 0.8 < ratio < 1.25 else "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("short")
    ap.add_argument("long")
    ap.add_argument("--min-samples", type=int, default=150, help="list runs with at least this many samples (short run)")
    a = ap.parse_args()
    short, long_by_address = read_rows(a.short), {r["Address"]: r for r in read_rows(a.long)}
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    runs: list[dict] = []
    for r in short:
        other = long_by_address.get(r["Address"])
        if other is None:
            raise SystemExit(f"{a.long} has no instruction at {r['Address']}: profile the same build at both lengths")
        counts = (number(r[EXECUTED]), number(other[EXECUTED]))
        samples = (number(r[SAMPLES]), number(other[SAMPLES]))
        k = kind(*counts)
        totals[k][0] += samples[0]
        totals[k][1] += samples[1]
        if runs and runs[-1]["counts"] == counts:
            run = runs[-1]
        else:
            run = {"counts": counts, "kind": k, "first": r["Source"].strip(), "start": r["Address"], "samples": [0.0, 0.0],
                   "ops": collections.Counter()}
            runs.append(run)
        run["end"] = r["Address"]
        run["samples"][0] += samples[0]
        run["samples"][1] += samples[1]
        run["ops"][opcode(r["Source"])] += 1
    all_short, all_long = sum(t[0] for t in totals.values()), sum(t[1] for t in totals.values())
    for k, (s0, s1) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"{k:6s} samples {s0:10.0f} ({s0 / all_short:6.1%})  {s1:10.0f} ({s1 / all_long:6.1%})")
    print()
    for run in runs:
        if run["samples"][0] < a.min_samples or run["counts"][0] == 0:
            continue
        ops = ", ".join(f"{op} {n}" for op, n in run["ops"].most_common(4))
        print(f"{run['kind']:5s} {run['start'][-6:]}-{run['end'][-6:]} executed {run['counts'][0]:>11.0f} {run['counts'][1]:>11.0f}"
              f"  samples {run['samples'][0]:8.0f} {run['samples'][1]:8.0f}  {run['first'][:44]:44s} [{ops}]")


if __name__ == "__main__":
    main()
