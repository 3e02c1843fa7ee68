"""What a kernel's hot loop spends its issue time on, from Nsight Compute's per-instruction source CSV:

    ncu -i report.ncu-rep --page source --csv --print-source sass > src.csv
    python3 scripts/ncu_loop_summary.py src.csv [--count N] [--top 25]

The loop is every instruction executed N times (within 3 %); without --count, N is the HGMMA execution count whose
instructions hold the most samples (the consumers' per-block wgmmas in our attention and GEMM kernels). Prints the loop's
share of all stall samples, its stall reasons, its opcode histogram (what runs per trip) and the most sampled loop
instructions with their three main stall reasons. Session 35 compared our attention forward with cuDNN's this way.
The report needs the SourceCounters section."""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path: str) -> list[dict[str, str]]:
    """The CSV's instruction rows as dicts keyed by its header (the row holding "Address" and "Source")."""
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    names = rows[head]
    return [dict(zip(names, r)) for r in rows[head + 1:] if len(r) == len(names)]


def opcode(source: str) -> str:
    """The SASS opcode of one instruction (a leading predicate such as `@!P0` skipped)."""
    words = source.split()
    if not words:
        return ""
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def in_loop(rows: list[dict[str, str]], count: float) -> list[dict[str, str]]:
    """The instructions executed `count` times, within 3 %."""
    return [r for r in rows if count and abs(number(r[EXECUTED]) - count) <= 0.03 * count]


def loop_count(rows: list[dict[str, str]]) -> float:
    """Of the HGMMA instructions' execution counts, the one whose instructions hold the most stall samples: the
    consumers' loop (one trip per warp and key block), not a task's peeled first or last block."""
    counts = {number(r[EXECUTED]) for r in rows if opcode(r["Source"]).startswith("HGMMA")}
    if not counts:
        raise SystemExit("no HGMMA instruction in the CSV: pass --count (the loop's execution count)")
    return max(counts, key=lambda c: sum(number(r[SAMPLES]) for r in in_loop(rows, c)))


def summarize(rows: list[dict[str, str]], count: float, top: int) -> str:
    stalls = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k] if rows else []
    loop = in_loop(rows, count)
    total = sum(number(r[SAMPLES]) for r in rows) or 1.0
    loop_samples = sum(number(r[SAMPLES]) for r in loop)
    out = [f"loop: {len(loop)} instructions executed ~{count:.0f} times, {loop_samples / total:.1%} of all samples"]
    reasons = collections.Counter()
    for r in loop:
        for k in stalls:
            reasons[k] += number(r[k])
        # Samples whose reason has no column of its own (HGMMA issue, seen in session 35) count as "unlisted".
        reasons["unlisted"] += max(0.0, number(r[SAMPLES]) - sum(number(r[k]) for k in stalls))
    reason_total = sum(reasons.values()) or 1.0
    out += [f"  {k:28s} {v / reason_total:6.1%}" for k, v in reasons.most_common(10)]
    ops = collections.Counter(opcode(r["Source"]) for r in loop)
    out.append("opcodes per trip: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(30)))
    for r in sorted(loop, key=lambda r: -number(r[SAMPLES]))[:top]:
        unlisted = number(r[SAMPLES]) - sum(number(r[k]) for k in stalls)
        main = sorted([(number(r[k]), k[len("stall_"):]) for k in stalls] + [(unlisted, "unlisted")], reverse=True)[:3]
        why = ", ".join(f"{name} {n:.0f}" for n, name in main if n > 0)
        out.append(f"  {number(r[SAMPLES]) / total:5.1%}  {r['Address'][-6:]}  {r['Source'].strip()[:64]:64s}  {why}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--count", type=float, default=None, help="the loop's execution count (default: the HGMMAs')")
    ap.add_argument("--top", type=int, default=25, help="how many of the loop's most sampled instructions to list")
    a = ap.parse_args()
    rows = read_rows(a.csv)
    print(summarize(rows, a.count if a.count else loop_count(rows), a.top))


if __name__ == "__main__":
    main()
