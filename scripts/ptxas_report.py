"""Registers and spills of every kernel in one CUDA source, from ptxas -v (no cuobjdump on the dev machines).

Usage: python scripts/ptxas_report.py grouped_gemm [--build build/lead] [--all]   (or kernels/grouped_gemm.cu)
Recompiles kernels/<name>.cu with the build's own nvcc command (ninja -t commands) plus -Xptxas -v into a
temporary object, then prints each kernel (demangled, shortened) that spills or whose wgmmas ptxas serialized;
--all prints every kernel. Exit status 1 when any kernel spills. Takes as long as that file's build (~1.5 min for
grouped_gemm.cu on 2 cores).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path


def compile_command(build: Path, name: str, obj: str) -> list[str]:
    cmds = subprocess.run(["ninja", "-C", str(build), "-t", "commands"], check=True, capture_output=True,
                          text=True).stdout.splitlines()
    line = next((c for c in cmds if f"kernels/{name}.cu" in c and " -c " in c), None)
    if line is None:
        sys.exit(f"no compile command for kernels/{name}.cu in {build}: pass --build <your cmake build directory>")
    args = shlex.split(line)
    out = args.index("-o")
    args[out + 1] = obj
    drop = {"-MD", "-MT", "-MF"}  # dependency files would be written beside the build's
    kept, skip = [], 0
    for a in args:
        if skip:
            skip -= 1
        elif a in drop:
            skip = 0 if a == "-MD" else 1
        else:
            kept.append(a)
    return kept + ["-Xptxas", "-v"]


def short_kernel_names(mangled: list[str]) -> list[str]:
    """Demangled names (c++filt), a pk::lcsc::kernel<K> shortened to K, in the order given."""
    names = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True).stdout.splitlines()
    return [re.sub(r"^void pk::lcsc::kernel<(.*)>\(.*$", r"\1", n).strip() for n in names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="kernels/<name>.cu, e.g. grouped_gemm (a path to the file works too)")
    ap.add_argument("--build", type=Path, default=Path("build/lead"), help="the CMake (ninja) build directory")
    ap.add_argument("--all", action="store_true", help="print every kernel, not only those that spill")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        name = Path(a.name).name.removesuffix(".cu")  # grouped_gemm, grouped_gemm.cu, kernels/grouped_gemm.cu
        cmd = compile_command(a.build.resolve(), name, str(Path(tmp) / "k.o"))
        log = subprocess.run(cmd, cwd=a.build, capture_output=True, text=True)
    if log.returncode:
        sys.exit(log.stderr[-4000:])
    kernel, stats, serialized = None, {}, set()
    for line in log.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            kernel = m.group(1)
        elif m := re.search(r"wgmma.*serialized.*function '(\S+)'", line):
            serialized.add(m.group(1))
        elif kernel and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            stats.setdefault(kernel, {})["spill"] = (int(m.group(1)), int(m.group(2)))
        elif kernel and (m := re.search(r"Used (\d+) registers", line)):
            stats.setdefault(kernel, {})["regs"] = int(m.group(1))
    spills = 0
    for (mangled, st), short in zip(stats.items(), short_kernel_names(list(stats))):
        stores, loads = st.get("spill", (0, 0))
        spills += stores + loads > 0
        if a.all or stores + loads or mangled in serialized:
            print(f"{st.get('regs', '?'):>4} regs  spill {stores:>5} / {loads:>5} B"
                  f"{'  WGMMA SERIALIZED' if mangled in serialized else ''}  {short[:150]}")
    print(f"{len(stats)} kernels, {spills} with spills", file=sys.stderr)
    sys.exit(1 if spills else 0)


if __name__ == "__main__":
    main()
