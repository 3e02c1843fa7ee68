"""Per-kernel instruction summary of `cuobjdump -sass` output: HGMMA / HMMA counts and local-memory
(spill) traffic for the GEMM kernels. Usage: python scripts/sass_summary.py sass.txt"""

import re
import sys
from collections import defaultdict


def main(path: str) -> None:
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    name = None
    for line in open(path, errors="replace"):
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            continue
        if name is None or "lcsc6kernel" not in name:
            continue
        for op in ("HGMMA", "HMMA", "LDL", "STL", "UTMALDG", "UTMASTG", "STSM", "SYNCS"):
            if re.search(rf"\b{op}\b", line):
                counts[name][op] += 1
    for n, c in counts.items():
        print(f"{n[:110]:<110} " + " ".join(f"{k}={v}" for k, v in sorted(c.items())))


if __name__ == "__main__":
    main(sys.argv[1])
