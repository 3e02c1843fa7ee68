"""Runs the ranks of a job: forwards their output, ends the job on the first failure, a signal or a
timeout, and leaves no rank process behind (each rank leads its own process group; groups are killed)."""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import BinaryIO

TAIL_LINES = 20
EXIT_TIMEOUT = 124
_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class RankSpec:
    argv: list[str]
    env: dict[str, str]


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128 + signal for a rank killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} ({-returncode})"
    return f"exit code {returncode}"


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies, even by SIGKILL (Linux only)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # start_new_session: the group id is the rank's pid
    except (ProcessLookupError, PermissionError):
        pass


class _Forwarder(threading.Thread):
    """Copies one pipe of one rank to our stream line by line, prefixed, and keeps the rank's last lines."""

    def __init__(self, pipe: BinaryIO, out: BinaryIO, prefix: bytes, tail: collections.deque, lock: threading.Lock):
        super().__init__(daemon=True)
        self._pipe, self._out, self._prefix, self._tail, self._lock = pipe, out, prefix, tail, lock

    def run(self) -> None:
        with self._pipe:
            for line in iter(self._pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self._lock:
                    self._tail.append(line.decode(errors="replace").rstrip("\n"))
                    try:
                        self._out.write(self._prefix + line)
                        self._out.flush()
                    except (OSError, ValueError):  # our stdout closed: keep draining the rank's pipe
                        pass


class Supervisor:
    """Starts every rank, then waits. `run()` returns the launcher's exit code: 0 when every rank exited
    0, the first failed rank's code, 124 on timeout, 128 + signal when the launcher got SIGINT/SIGTERM."""

    def __init__(self, ranks: Sequence[RankSpec], grace_s: float = 10.0, timeout_s: float | None = None,
                 out: BinaryIO | None = None, err: BinaryIO | None = None):
        self._specs = list(ranks)
        self._grace_s, self._timeout_s = grace_s, timeout_s
        self._out = out if out is not None else sys.stdout.buffer
        self._err = err if err is not None else sys.stderr.buffer
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        # Per rank and stream: two pipes are read by two threads, so their relative order is lost.
        self._tails = [{name: collections.deque(maxlen=TAIL_LINES) for name in ("stdout", "stderr")}
                       for _ in self._specs]
        self._forwarders: list[_Forwarder] = []
        self._signals: list[int] = []

    def _say(self, text: str) -> None:
        with self._lock:
            self._err.write(f"pk_jax.launch: {text}\n".encode())
            self._err.flush()

    def _on_signal(self, signum: int, _frame) -> None:
        self._signals.append(signum)
        if len(self._signals) > 1:  # asked twice: no grace
            for p in self._procs:
                _signal_group(p.pid, signal.SIGKILL)

    def run(self) -> int:
        in_main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
        try:
            self._start()
            return self._wait()
        finally:
            self._stop(grace_s=self._grace_s)
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _start(self) -> None:
        # Every rank is forked before any forwarder thread exists (preexec_fn runs in the forked child).
        for spec in self._specs:
            if self._signals:
                break
            self._procs.append(subprocess.Popen(
                spec.argv, env=spec.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=_die_with_parent))
        for rank, p in enumerate(self._procs):
            prefix = f"[rank {rank}] ".encode()
            for pipe, stream, name in ((p.stdout, self._out, "stdout"), (p.stderr, self._err, "stderr")):
                fwd = _Forwarder(pipe, stream, prefix, self._tails[rank][name], self._lock)
                fwd.start()
                self._forwarders.append(fwd)

    def _wait(self) -> int:
        deadline = None if self._timeout_s is None else time.monotonic() + self._timeout_s
        while True:
            if self._signals:
                sig = self._signals[0]
                self._stop(grace_s=self._grace_s)
                self._say(f"got {signal.Signals(sig).name}: stopped all {len(self._procs)} ranks")
                return 128 + sig
            failed = next((r for r, p in enumerate(self._procs) if p.poll() not in (None, 0)), None)
            if failed is not None:
                return self._fail(failed)
            if len(self._procs) == len(self._specs) and all(p.returncode == 0 for p in self._procs):
                self._stop(grace_s=0)  # anything the ranks left running in their groups
                return 0
            if deadline is not None and time.monotonic() > deadline:
                self._stop(grace_s=self._grace_s)
                self._say(f"timed out after {self._timeout_s:g} s (--timeout): stopped all {len(self._procs)} ranks")
                return EXIT_TIMEOUT
            time.sleep(_POLL_S)

    def _fail(self, rank: int) -> int:
        p = self._procs[rank]
        rc = p.returncode
        others = [r for r, q in enumerate(self._procs) if q.returncode is None]
        self._stop(grace_s=self._grace_s)
        stopped = f"; stopped ranks {', '.join(map(str, others))}" if others else ""
        report = [f"rank {rank} (pid {p.pid}) failed: {describe(rc)}{stopped}"]
        for name, lines in self._tails[rank].items():
            if lines:
                report.append(f"last {len(lines)} lines of rank {rank}'s {name}:\n" +
                              "\n".join(f"  | {line}" for line in lines))
        if len(report) == 1:
            report.append(f"rank {rank} wrote no output")
        self._say("\npk_jax.launch: ".join(report))
        return exit_code(rc)

    def _stop(self, grace_s: float) -> None:
        """SIGTERM to every rank's group, SIGKILL to the groups after `grace_s`; then reaps the ranks and
        drains their output."""
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            _signal_group(p.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline and len(self._signals) < 2:
            time.sleep(_POLL_S)
        for p in self._procs:  # also members a finished rank left in its group
            _signal_group(p.pid, signal.SIGKILL)
        for p in self._procs:
            p.wait()
        for fwd in self._forwarders:
            fwd.join(timeout=2)
