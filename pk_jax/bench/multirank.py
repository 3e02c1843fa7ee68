"""`python -m pk_jax.bench multirank --ranks 2 4 [--ranks-per-gpu auto|K] [--cpu] [--out FILE]`: the
multi-rank correctness suite (tests/multirank/) at each rank count.

Per rank count: check_ops.py, check_training.py, check_jit.py, check_small.py (the small-message path's
size sweep), check_small_replay.py (its 1,000 command-buffer replays; 20 with --quick), check_small_chain.py
(chains of 64 dependent small all_reduces, exact: the LL / LL128 lines' stress test), check_moe.py and
soak.py under `python -m pk_jax.launch` (on one GPU the ranks share it under MPS; on several, `auto` puts one rank per
GPU), then faults.py --mode kill, skip and shots (which start their ranks themselves). Merges every script's
rows into one results file (suite "multirank") with a log beside it, and exits non-zero if any case
failed. This process never touches a GPU (the ranks need all of it), so it imports no jax backend.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from pk_jax.bench import results
from pk_jax.launch.rank_env import local_gpus

STEP_TIMEOUT_S = 600  # a step past this has hung (kernels give up on a peer after PK_JAX_TIMEOUT_MS)


def scripts_dir() -> Path:
    d = Path(__file__).resolve().parents[2] / "tests" / "multirank"
    if not (d / "check_ops.py").exists():
        raise FileNotFoundError(f"pk_jax.bench multirank: {d} is missing; run it from a source checkout of pk_jax")
    return d


def gpu_names() -> list[str]:
    """Names of the visible GPUs, from nvidia-smi (no CUDA context in this process)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    names = [n.strip() for n in out.splitlines() if n.strip()]
    vis = local_gpus()
    return names[: len(vis)] if vis and os.environ.get("CUDA_VISIBLE_DEVICES") is not None else names


def device_labels(cpu: bool) -> tuple[str, str]:
    """(results "device", file-name kind): ("1x NVIDIA H200", "nvidia-h200"), ("2x ...", "...-x2"), or cpu."""
    names = [] if cpu else gpu_names()
    if not names:
        return "cpu", "cpu"
    kind = re.sub(r"[^A-Za-z0-9]+", "-", names[0]).strip("-").lower()
    return f"{len(names)}x {names[0]}", kind + (f"-x{len(names)}" if len(names) > 1 else "")


def per_gpu(n: int, requested: str, cpu: bool) -> int:
    if cpu:
        return 1
    if requested != "auto":
        return int(requested)
    gpus = len(local_gpus())
    return max(-(-n // gpus), 1) if gpus else 1


def _run_step(cmd: list[str], log, env: dict[str, str]) -> int:
    """Runs one step, streaming its output to stdout and the log."""
    line = "$ " + " ".join(cmd)
    print(line, flush=True)
    log.write(line + "\n")
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as p:
        for out in p.stdout:
            sys.stdout.write(out)
            log.write(out)
        try:
            rc = p.wait(timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
    msg = f"-> exit {rc} after {time.perf_counter() - t0:.0f} s"
    print(msg, flush=True)
    log.write(msg + "\n")
    log.flush()
    return rc


def run(ranks: Sequence[int], ranks_per_gpu: str, cpu: bool, quick: bool, calls: int, out: str | None,
        only: Sequence[str] | None = None) -> int:
    """Every step at each rank count (only: the steps named, e.g. check_small faults_kill)."""
    sdir = scripts_dir()
    device, kind = device_labels(cpu)
    out = out or os.path.join("benchmarks", "results", f"{datetime.date.today().isoformat()}-multirank-{kind}.json")
    log_path = os.path.splitext(out)[0] + ".log"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the bench's own virtual-device flags are not the ranks'
    py = sys.executable
    rows: list[dict] = []
    failed_steps: list[str] = []
    with open(log_path, "w", buffering=1) as log, tempfile.TemporaryDirectory(prefix="pk_jax_multirank_") as tmp:
        for n in ranks:
            k = per_gpu(n, ranks_per_gpu, cpu)
            launch = [py, "-m", "pk_jax.launch", "-n", str(n), "--timeout", str(STEP_TIMEOUT_S - 60)]
            launch += ["--cpu"] if cpu else ["--ranks-per-gpu", str(k)]
            extra = (["--quick", "--dtypes", "float32"] if quick else [])
            steps = [
                ("check_ops", launch + [str(sdir / "check_ops.py"), *extra]),
                ("check_training", launch + [str(sdir / "check_training.py"), *extra]),
                ("check_jit", launch + [str(sdir / "check_jit.py"), *extra]),
                ("check_small", launch + [str(sdir / "check_small.py"), *extra]),
                ("check_small_replay", launch + [str(sdir / "check_small_replay.py"), *extra]),
                ("check_small_chain", launch + [str(sdir / "check_small_chain.py"), *extra]),
                ("check_moe", launch + [str(sdir / "check_moe.py"), *extra]),
                ("check_ring", launch + [str(sdir / "check_ring.py"), *extra]),
                ("soak", launch + [str(sdir / "soak.py"), "--calls", str(calls), *extra]),
            ] + [(f"faults_{m}", [py, str(sdir / "faults.py"), "--mode", m, "--ranks", str(n),
                                  "--ranks-per-gpu", str(k)] + (["--cpu"] if cpu else []))
                 for m in ("kill", "skip", "shots")]
            if only:
                unknown = sorted(set(only) - {name for name, _ in steps})
                if unknown:
                    raise SystemExit(f"pk_jax.bench multirank: unknown --steps {unknown}; "
                                     f"known: {[name for name, _ in steps]}")
                steps = [st for st in steps if st[0] in only]
            for name, cmd in steps:
                rows_path = os.path.join(tmp, f"{name}-{n}.json")
                rc = _run_step(cmd + ["--out", rows_path], log, env)
                got = json.load(open(rows_path)) if os.path.exists(rows_path) else []
                for r in got:
                    r["case"] = f"{name}:{r['case']}" if name == "soak" else r["case"]
                rows += got
                skipped = name.startswith("faults") and cpu
                if rc != 0 or (not got and not skipped):
                    failed_steps.append(f"{name} at {n} ranks (exit {rc})")
                    rows.append({"op": name, "case": "step", "shape": [], "dtype": "", "group": n,
                                 "extra": {"ok": False, "max_err": None, "ranks_per_gpu": k, "startup_s": None,
                                           "error": f"exit {rc}; {len(got)} rows"}})
        results.write(out, "multirank", rows, device=device)
        bad = [r for r in rows if not r["extra"]["ok"]]
        summary = (f"multirank: {len(rows) - len(bad)}/{len(rows)} rows passed on {device} at ranks {list(ranks)}"
                   + (f"; failed steps: {', '.join(failed_steps)}" if failed_steps else ""))
        print(summary, flush=True)
        log.write(summary + "\n")
    print(f"wrote {out} and {log_path}")
    return 1 if bad or failed_steps else 0
