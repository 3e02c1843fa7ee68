"""SASS bytes of every kernel in one CUDA source (no cuobjdump on the dev machines).

Usage: python scripts/sass_size.py attention [--build build/c] [--base other.cubin] [--keep out.cubin]
Compiles kernels/<name>.cu with the build's own nvcc command (ptxas_report.compile_command) into a cubin, reads each
kernel's `.text.<kernel>` section size from the ELF, and prints them largest first. --base compares against a cubin kept
earlier (--keep), e.g. from another branch's build: the session 47 note on the half-wide block used it to show what a
second copy of a pipeline costs in code.
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ptxas_report import compile_command, short_kernel_names  # noqa: E402


def kernel_sizes(cubin: Path) -> dict[str, int]:
    """{mangled kernel name: bytes of its .text section} from an ELF64 cubin."""
    b = cubin.read_bytes()
    if b[:4] != b"\x7fELF" or b[4] != 2:
        sys.exit(f"{cubin}: not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(offset: int) -> str:
        start = names_at + offset
        return b[start:b.index(b"\0", start)].decode()

    return {name(h[0])[len(".text."):]: h[5] for h in headers if name(h[0]).startswith(".text.")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="kernels/<name>.cu, e.g. attention (a path to the file works too)")
    ap.add_argument("--build", type=Path, default=Path("build/lead"), help="the CMake (ninja) build directory")
    ap.add_argument("--base", type=Path, help="a cubin to compare against (kept earlier with --keep)")
    ap.add_argument("--keep", type=Path, help="also write the cubin here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        name = Path(a.name).name.removesuffix(".cu")
        cubin = Path(a.keep.resolve() if a.keep else Path(tmp) / "k.cubin")
        cmd = [x for x in compile_command(a.build.resolve(), name, str(cubin)) if x not in ("-Xptxas", "-v")]
        cmd[cmd.index("-c")] = "-cubin"
        log = subprocess.run(cmd, cwd=a.build, capture_output=True, text=True)
        if log.returncode:
            sys.exit(log.stderr[-4000:])
        sizes = kernel_sizes(cubin)
    base = kernel_sizes(a.base) if a.base else {}
    for (mangled, size), short in sorted(zip(sizes.items(), short_kernel_names(list(sizes))), key=lambda x: -x[0][1]):
        was = f"  base {base[mangled]:>8} ({size / base[mangled]:.2f}x)" if mangled in base else ""
        print(f"{size:>8} B{was}  {short[:150]}")
    print(f"{len(sizes)} kernels, {sum(sizes.values())} B", file=sys.stderr)


if __name__ == "__main__":
    main()
