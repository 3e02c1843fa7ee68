"""The loops of one kernel in `cuobjdump -sass` output, with an instruction count per opcode class: where a kernel's
per-iteration instructions go (e.g. the attention forward's key-block loop) without a GPU.

    python scripts/sass_loops.py sass.txt "attention::Kernel<__nv_bfloat16, 128, 2, pk::attention::NoRing, false, 4, false>"

The pattern is a regular expression matched against the demangled names of the `pk::lcsc::kernel` functions (the
first match is read). A loop is a backward branch; only loops holding an HGMMA are listed, innermost last in
address order. cuobjdump and nvdisasm need no GPU: `pip download --no-deps nvidia-cuda-cuobjdump` and unzip the wheel
(nvidia/cu13/bin/cuobjdump) where the CUDA toolkit has none."""

from __future__ import annotations

import collections
import re
import subprocess
import sys

CLASSES = ("HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "IMAD", "ISETP", "R2UR", "UIADD3", "UMOV", "BSSY",
           "SYNCS", "BAR", "LDS", "STS")


def kernel_sass(path: str, pattern: str) -> tuple[str, list[tuple[int, str]]]:
    """(demangled name, [(address, instruction)]) of the first lcsc kernel whose name matches `pattern`."""
    text = open(path, errors="replace").read()
    for part in re.split(r"\n\s*Function : ", text)[1:]:
        name = part.split("\n", 1)[0].strip()
        demangled = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
        if "lcsc::kernel" in demangled and re.search(pattern, demangled):
            rows = [(int(m.group(1), 16), m.group(2).strip())
                    for m in re.finditer(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", part, re.M)]
            return demangled, rows
    raise SystemExit(f"no pk::lcsc::kernel matches {pattern!r} in {path}")


def opcode(instruction: str) -> str:
    """The opcode class: predicate and modifiers dropped (`@!P0 HGMMA.64x160x16.F32.BF16 ...` -> HGMMA)."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def main(path: str, pattern: str) -> None:
    name, rows = kernel_sass(path, pattern)
    index = {address: i for i, (address, _) in enumerate(rows)}
    print(name[:160])
    for i, (address, instruction) in enumerate(rows):
        target = re.search(r"BRA (0x[0-9a-f]+)", instruction)
        if not target or int(target.group(1), 16) >= address:
            continue
        body = rows[index[int(target.group(1), 16)]:i + 1]
        counts = collections.Counter(opcode(x) for _, x in body)
        if counts["HGMMA"]:
            print(f"{target.group(1)} -> {address:#x}: {len(body)} instructions, "
                  + " ".join(f"{c} {counts[c]}" for c in CLASSES if counts[c]))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
