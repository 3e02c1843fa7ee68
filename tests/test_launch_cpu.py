"""`python -m pk_jax.launch` on CPU: a real 2-process jax.distributed job (the pk_jax collectives and a fused
op against jax.lax, the key-value store), a failing rank, SIGINT/SIGTERM, --timeout, and --ranks-per-gpu
with a fake MPS control binary. Every launcher run is bounded (--timeout and a subprocess timeout)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pk_jax.launch.cli import main, split_argv
from pk_jax.launch.rank_env import JobPlan, LaunchError, local_gpus, plan_job, rank_env

ROOT = Path(__file__).parent.parent
SCRIPTS = Path(__file__).parent / "launch_scripts"
LAUNCH = [sys.executable, "-m", "pk_jax.launch"]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), **extra)


def _launch(args: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(LAUNCH + args, env=env or _env(), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def _pids(stdout: str) -> dict[int, int]:
    return {int(r): int(p) for r, p in re.findall(r"^\[rank \d+\] PID (\d+) (\d+)$", stdout, re.M)}


def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone: orphans wait for whatever reaps in this container)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # vanished since os.kill
        return False


def _assert_gone(pids, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s  # ranks are the launcher's children: reaped before it exits
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)]


def test_collectives_fused_op_and_kv_store_across_two_cpu_processes():
    # XLA_FLAGS from conftest asks for 8 CPU devices; --cpu-devices 2 must win (4 global devices).
    res = _launch(["--cpu", "-n", "2", "--cpu-devices", "2", "--timeout", "150",
                   str(SCRIPTS / "collectives_across_processes.py")], timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for r in range(2):
        assert f"[rank {r}] OK init rank {r} of 2, 2 local of 4 devices" in res.stdout
        for check in ("all_gather", "all_reduce", "all_reduce_vs_numpy", "reduce_scatter", "all_to_all",
                      "matmul_reduce_scatter"):
            assert f"[rank {r}] OK {check} rank {r}\n" in res.stdout, (check, res.stdout)
        assert f"[rank {r}] OK kv_store rank {r} read 'hello from {1 - r}'" in res.stdout


@pytest.mark.parametrize("code, expect_rc, expect_text", [(3, 3, "exit code 3"), (-9, 137, "killed by SIGKILL (9)")])
def test_failing_rank_ends_the_job_with_its_code(code, expect_rc, expect_text):
    res = _launch(["-n", "3", "--grace", "5", "--timeout", "40", str(SCRIPTS / "fail_or_sleep.py"), "1", str(code)])
    assert res.returncode == expect_rc, res.stderr
    pids = _pids(res.stdout)
    assert sorted(pids) == [0, 1, 2]
    assert f"rank 1 (pid {pids[1]}) failed: {expect_text}; stopped ranks 0, 2" in res.stderr
    report = res.stderr.split(f"failed: {expect_text}", 1)[1]
    assert "pk_jax.launch: last 20 lines of rank 1's stdout:\n  | line 5 of rank 1\n" in report
    assert "  | line 24 of rank 1" in report and "  | line 4 of rank 1" not in report
    assert "pk_jax.launch: last 1 lines of rank 1's stderr:\n  | about to fail" in report
    assert "[rank 1] line 0 of rank 1" in res.stdout  # forwarded, prefixed
    _assert_gone(pids.values())


def _sleeping_job() -> tuple[subprocess.Popen, dict[int, int]]:
    """A launcher with 2 sleeping ranks, once both printed their pids."""
    proc = subprocess.Popen(LAUNCH + ["-n", "2", "--timeout", "60", str(SCRIPTS / "fail_or_sleep.py"), "-1", "0"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 40
    while len(_pids("".join(lines))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    pids = _pids("".join(lines))
    if len(pids) != 2:
        proc.kill()
        pytest.fail(f"the ranks did not start: {''.join(lines)}")
    return proc, pids


@pytest.mark.parametrize("sig, expect_rc", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_launcher_stops_every_rank(sig, expect_rc):
    proc, pids = _sleeping_job()
    try:
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=20)
        assert rc == expect_rc and time.monotonic() - t0 < 10
        assert f"got {sig.name}: stopped all 2 ranks" in proc.stderr.read()
        _assert_gone(pids.values())
    finally:
        proc.kill()
        proc.wait()


def test_ranks_die_with_a_killed_launcher():
    proc, pids = _sleeping_job()
    proc.kill()  # SIGKILL: no handler runs; the ranks' parent-death signal ends them
    proc.wait()
    _assert_gone(pids.values())


def test_timeout_ends_the_job_with_124():
    res = _launch(["-n", "2", "--timeout", "1.5", str(SCRIPTS / "fail_or_sleep.py"), "-1", "0"])
    assert res.returncode == 124 and "timed out after 1.5 s" in res.stderr
    _assert_gone(_pids(res.stdout).values())


def _fake_mps_path(tmp_path: Path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(SCRIPTS / "fake-mps-control", bin_dir / "nvidia-cuda-mps-control")
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def _rank_envs(stdout: str) -> dict[int, dict[str, str]]:
    envs: dict[int, dict[str, str]] = {}
    for r, k, v in re.findall(r"^\[rank (\d+)\] ENV (\w+)=(.*)$", stdout, re.M):
        envs.setdefault(int(r), {})[k] = v
    return envs


def test_shared_gpu_runs_a_private_mps_daemon_for_the_job(tmp_path):
    log = tmp_path / "mps.log"
    env = _env(PATH=_fake_mps_path(tmp_path), FAKE_MPS_LOG=str(log), CUDA_VISIBLE_DEVICES="3")
    for v in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
              "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        env.pop(v, None)
    res = _launch(["--share-gpu", "--timeout", "40", str(SCRIPTS / "print_env.py")], env=env)
    assert res.returncode == 0, res.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 2, calls
    start = re.fullmatch(r"args=\[-d\] pipe=(\S+) log=(\S+) stdin=\[\]", calls[0])
    assert start, calls
    pipe, mps_log = start.groups()
    root = os.path.dirname(pipe)
    assert os.path.dirname(mps_log) == root and pipe != mps_log and os.path.basename(root).startswith("pk_jax_mps_")
    assert calls[1] == f"args=[] pipe={pipe} log={mps_log} stdin=[quit]"
    assert not os.path.exists(root)  # removed at the end
    envs = _rank_envs(res.stdout)
    assert sorted(envs) == [0, 1]  # 1 GPU x 2 ranks
    for r, e in envs.items():
        assert e["JAX_PROCESS_ID"] == e["PK_JAX_LOCAL_RANK"] == str(r)
        assert e["JAX_NUM_PROCESSES"] == e["PK_JAX_LOCAL_WORLD"] == "2"
        assert re.fullmatch(r"127\.0\.0\.1:\d+", e["JAX_COORDINATOR_ADDRESS"])
        assert e["CUDA_VISIBLE_DEVICES"] == "3" and e["PYTHONUNBUFFERED"] == "1" and e["PK_JAX_RANKS_PER_GPU"] == "2"
        assert (e["CUDA_MPS_PIPE_DIRECTORY"], e["CUDA_MPS_LOG_DIRECTORY"]) == (pipe, mps_log)
        assert e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50" and e["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.400"
        assert e["pipe_dir_exists"] == "True" and e["mps_root_mode"] == "0o700"


def test_ranks_per_gpu_maps_ranks_to_gpus_and_keeps_user_settings(tmp_path):
    env = _env(PATH=_fake_mps_path(tmp_path), FAKE_MPS_LOG=str(tmp_path / "mps.log"), CUDA_VISIBLE_DEVICES="4,6",
               XLA_PYTHON_CLIENT_MEM_FRACTION="0.3", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="40")
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    res = _launch(["--ranks-per-gpu", "2", "--timeout", "40", str(SCRIPTS / "print_env.py")], env=env)
    assert res.returncode == 0, res.stderr
    envs = _rank_envs(res.stdout)
    assert [envs[r]["CUDA_VISIBLE_DEVICES"] for r in range(4)] == ["4", "4", "6", "6"]
    assert {e["XLA_PYTHON_CLIENT_MEM_FRACTION"] for e in envs.values()} == {"0.3"}
    assert {e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for e in envs.values()} == {"40"}


def test_shared_gpu_without_mps_binary_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control there
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    assert main(["--share-gpu", str(SCRIPTS / "print_env.py")]) == 2  # before any rank starts
    assert "nvidia-cuda-mps-control is not on PATH" in capsys.readouterr().err


def test_split_argv_gives_everything_from_the_script_on_to_the_ranks():
    assert split_argv(["-n", "4", "s.py", "-n", "2"]) == (["-n", "4"], ["s.py", "-n", "2"])
    assert split_argv(["--cpu", "-m", "pkg.mod", "--x"]) == (["--cpu"], ["-m", "pkg.mod", "--x"])
    assert split_argv(["--timeout=5", "-n2", "s.py"]) == (["--timeout=5", "-n2"], ["s.py"])
    assert split_argv(["--cpu", "--", "-weird.py"]) == (["--cpu"], ["-weird.py"])


def test_local_gpus_reads_cuda_visible_devices_like_cuda():
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ("2", "5")
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d"}) == ("GPU-1a2b", "GPU-3c4d")
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ("1",)
    assert local_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()


def test_plan_job_counts_ranks_and_names_bad_options():
    assert plan_job(None, ("0", "1"), 1, False, 1, "c").ranks == 2
    assert plan_job(None, ("0",), 2, False, 1, "c").ranks == 2
    assert plan_job(3, ("0", "1", "2", "3"), 2, False, 1, "c").gpus == ("0", "1")
    with pytest.raises(LaunchError, match="pass -n N"):
        plan_job(None, (), 1, False, 1, "c")
    with pytest.raises(LaunchError, match="-n 5 needs 3 GPUs"):
        plan_job(5, ("0", "1"), 2, False, 1, "c")
    with pytest.raises(LaunchError, match="--cpu needs -n"):
        plan_job(None, (), 1, True, 1, "c")


def test_cpu_rank_env_selects_gloo_and_the_device_count():
    env = rank_env(JobPlan(2, (), 1, True, 3, "127.0.0.1:1"), 1, {"HOME": "/h"})
    assert env["JAX_PLATFORMS"] == "cpu" and env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    assert env["JAX_NUM_CPU_DEVICES"] == "3" and env["JAX_PROCESS_ID"] == "1" and env["HOME"] == "/h"
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_initialize_from_env_names_the_missing_variables(monkeypatch):
    from pk_jax.launch import initialize_from_env

    for v in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(RuntimeError, match="JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID not set"):
        initialize_from_env()
