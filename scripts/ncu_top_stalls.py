"""The instructions where a kernel's warps were sampled most (Nsight Compute's per-PC stall sampling).

    ncu -i report.ncu-rep --page source --csv --print-source sass > src.csv
    python3 scripts/ncu_top_stalls.py src.csv [N]

Prints the N (default 14) most sampled SASS instructions with their share of all samples and how often they ran.
The report needs the SourceCounters section (the `ncustalls` stage's NCU_SECTIONS)."""

from __future__ import annotations

import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    rows = list(csv.reader(open(sys.argv[1])))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 14
    head = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    h = rows[head]
    samples, address, source, executed = (h.index(k) for k in (
        "Warp Stall Sampling (All Samples)", "Address", "Source", "Instructions Executed"))
    body = [r for r in rows[head + 1:] if len(r) > samples]
    total = sum(number(r[samples]) for r in body) or 1.0
    for r in sorted(body, key=lambda r: -number(r[samples]))[:top]:
        print(f"{100 * number(r[samples]) / total:5.1f}%  {r[address]}  {r[executed]:>10}  {r[source][:100]}")


if __name__ == "__main__":
    main()
