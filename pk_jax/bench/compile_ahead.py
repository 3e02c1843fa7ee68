"""A suite's programs compiled on a thread pool before any of its rows is timed.

Compiling one program at a time took about half of a suite's wall time on a device (4-GPU context suite, session 19:
24 rows x 3 programs of a few seconds each; the attention suite's 64 rows did not fit a 600 s call). Programs are
traced and lowered by the caller's thread, from abstract inputs (no device memory): the settings a lowering reads
come from the environment, which is process-wide, so only XLA's compile runs on the workers. wait() returns once
every compile has finished, and the caller times nothing before it, so no compile runs beside a measurement.

    ahead = CompileAhead()
    ahead.add(key, jax.jit(f), specs)          # lowered now, compiled on a worker
    ahead.wait()
    compiled = ahead.get(key).result()         # or compile where it is timed when get() returns None

Workers: $PK_JAX_BENCH_COMPILE_WORKERS (default min(8, CPUs); 1: nothing is compiled ahead).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Hashable

WORKERS_VAR = "PK_JAX_BENCH_COMPILE_WORKERS"


class CompileAhead:
    def __init__(self):
        workers = int(os.environ.get(WORKERS_VAR, "") or min(8, os.cpu_count() or 1))
        self.pool = concurrent.futures.ThreadPoolExecutor(workers) if workers > 1 else None
        self.futures: dict[Hashable, concurrent.futures.Future] = {}

    def add(self, key: Hashable, program: Callable, specs, lower: Callable | None = None) -> None:
        """program.lower(*specs) now (or lower(), which returns a Lowered), its compile on a worker. A program that
        fails to lower is left to the caller, which compiles it (and reports its error) where it is timed."""
        if self.pool is None:
            return
        try:
            lowered = lower() if lower is not None else program.lower(*specs)
        except Exception:  # noqa: BLE001
            return
        self.futures[key] = self.pool.submit(lowered.compile)

    def get(self, key: Hashable) -> concurrent.futures.Future | None:
        """The compile of `key` (taken: a second get returns None), or None where none was started."""
        return self.futures.pop(key, None)

    def wait(self) -> None:
        if self.pool is not None:
            concurrent.futures.wait(list(self.futures.values()))
            self.pool.shutdown(wait=True)
