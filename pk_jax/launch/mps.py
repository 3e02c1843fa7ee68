"""The CUDA MPS daemon of one pk_jax.launch job (ranks sharing a GPU run concurrently only under MPS)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

from pk_jax.launch.rank_env import MPS_LOG_DIR, MPS_PIPE_DIR, LaunchError

CONTROL = "nvidia-cuda-mps-control"
_CALL_TIMEOUT_S = 30
_QUIT_WAIT_S = 5  # for the daemon to exit (its control pipe goes) before its directory is removed


def running_daemon(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(pipe, log) dirs of a daemon the caller already runs for this job (CUDA_MPS_PIPE_DIRECTORY holding
    the daemon's `control` pipe), else None."""
    pipe = environ.get(MPS_PIPE_DIR)
    if pipe and os.path.exists(os.path.join(pipe, "control")):
        return pipe, environ.get(MPS_LOG_DIR, "")
    return None


class MpsDaemon:
    """Starts `nvidia-cuda-mps-control -d` with pipe and log dirs in a private (0700) temporary dir;
    `stop()` sends it `quit` and removes the dir. `dirs` is what the ranks must see as
    CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY."""

    def __init__(self, environ: Mapping[str, str]):
        self._binary = shutil.which(CONTROL, path=environ.get("PATH"))
        if self._binary is None:
            raise LaunchError(f"--ranks-per-gpu > 1 runs the ranks under CUDA MPS, but {CONTROL} is not on PATH: "
                              f"install the NVIDIA driver utilities, or run one rank per GPU (--ranks-per-gpu 1)")
        self._root = tempfile.mkdtemp(prefix="pk_jax_mps_")  # mode 0700, a fresh name per job
        self.dirs = (os.path.join(self._root, "pipe"), os.path.join(self._root, "log"))
        for d in self.dirs:
            os.mkdir(d, 0o700)
        self._env = dict(environ)
        self._env[MPS_PIPE_DIR], self._env[MPS_LOG_DIR] = self.dirs
        self._started = False

    def start(self) -> None:
        # The daemon forks and keeps whatever it inherits open: give it files, never our pipes.
        err_path = os.path.join(self._root, "start.err")
        with open(err_path, "wb") as err:
            rc = subprocess.run([self._binary, "-d"], env=self._env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, timeout=_CALL_TIMEOUT_S).returncode
        if rc != 0:
            with open(err_path, errors="replace") as f:
                why = f.read().strip()
            self._remove()
            raise LaunchError(f"{CONTROL} -d failed (exit {rc}): {why or 'no message'}")
        self._started = True

    def stop(self) -> None:
        """Quits the daemon (waits up to 5 s for its control pipe to go) and removes the job's dir."""
        if self._started:
            self._started = False
            try:
                subprocess.run([self._binary], input=b"quit\n", env=self._env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=_CALL_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as e:
                print(f"pk_jax.launch: stopping the MPS daemon ({self.dirs[0]}) failed: {e}", file=sys.stderr)
            control = os.path.join(self.dirs[0], "control")
            deadline = time.monotonic() + _QUIT_WAIT_S
            while os.path.exists(control) and time.monotonic() < deadline:
                time.sleep(0.1)
            if os.path.exists(control):
                print(f"pk_jax.launch: the MPS daemon's control pipe was still there {_QUIT_WAIT_S} s after quit; "
                      f"removing {self._root} anyway", file=sys.stderr)
        self._remove()

    def _remove(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
