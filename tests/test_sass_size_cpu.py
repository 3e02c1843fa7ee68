"""scripts/sass_size.py on CPU: the per-kernel .text sizes it reads from a cubin that nvcc builds here (skipped where
no nvcc is installed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import sass_size  # noqa: E402

SOURCE = """
extern "C" __global__ void small(float* x) { x[threadIdx.x] += 1.0f; }
extern "C" __global__ void large(float* x, int n) {
  float a = x[threadIdx.x];
#pragma unroll
  for (int i = 0; i < 64; ++i) a = a * x[i * n + threadIdx.x] + 1.0f;
  x[threadIdx.x] = a;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_kernel_sizes_from_a_real_cubin(tmp_path):
    src, cubin = tmp_path / "k.cu", tmp_path / "k.cubin"
    src.write_text(SOURCE)
    subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-O3", "-o", str(cubin), str(src)], check=True)
    sizes = sass_size.kernel_sizes(cubin)
    assert set(sizes) == {"small", "large"}
    assert 0 < sizes["small"] < sizes["large"]
    assert all(size % 16 == 0 for size in sizes.values())  # whole 128-bit SASS instructions


def test_not_a_cubin_is_refused(tmp_path):
    path = tmp_path / "k.cubin"
    path.write_bytes(b"not an elf file at all")
    with pytest.raises(SystemExit, match="not an ELF64 cubin"):
        sass_size.kernel_sizes(path)
