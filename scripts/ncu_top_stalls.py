"""The instructions where a kernel's warps were sampled most (Nsight Compute's per-PC stall sampling).

    ncu -i report.ncu-rep --page source --csv --print-source sass > src.csv
    python3 scripts/ncu_top_stalls.py src.csv [N]

Prints the N (default 14) most sampled SASS instructions with their share of all samples and how often they ran.
The report needs the SourceCounters section (the `ncustalls` stage's NCU_SECTIONS)."""

from __future__ import annotations

import sys

from ncu_loop_summary import EXECUTED, SAMPLES, number, read_rows  # the CSV's parsing, shared


def main() -> None:
    rows = read_rows(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 14
    total = sum(number(r[SAMPLES]) for r in rows) or 1.0
    for r in sorted(rows, key=lambda r: -number(r[SAMPLES]))[:top]:
        print(f"{100 * number(r[SAMPLES]) / total:5.1f}%  {r['Address']}  {r[EXECUTED]:>10}  {r['Source'][:100]}")


if __name__ == "__main__":
    main()
