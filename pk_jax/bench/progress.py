"""A one-line progress bar for sweeps (stderr, no dependencies)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str):
        self.total, self.label, self.done, self.t0 = total, label, 0, time.perf_counter()

    def step(self, what: str = "") -> None:
        self.done += 1
        width = 30
        filled = width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:5.0f}s {what:<40.40}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
