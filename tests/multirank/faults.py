"""A rank that dies or skips an op: the others must get an error naming the op and the missing rank
within PK_JAX_TIMEOUT_MS (2000 here) plus slack, and every process must exit.

    python tests/multirank/faults.py --mode kill|skip|shots [--ranks N] [--ranks-per-gpu auto|K] [--out rows.json]

It starts its ranks itself (tests/multirank/spawn.py: the launcher would end the job when rank 1 dies).
kill: after a few good all_gathers rank 1 calls os._exit(9); the others run one more all_gather.
skip: rank 1 skips that all_gather and runs an all_reduce, which the others never reach.
shots: rank 1 runs the LL128 all_reduce two-shot (PK_JAX_AR_LL128_SHOTS=2), the others one-shot: every rank, rank 1
too, must get the kernel mismatch (an error naming small_ll128 and PK_JAX_AR_LL128_SHOTS) instead of wrong sums.
The others print `FAULT-OK <elapsed s>` when the op or pk_jax.runtime.check() raised an error naming
"all_gather" and "rank 1" in time. The driver prints one PASS/FAIL line per mode. With --cpu it says
SKIP: the jax.lax fallback has no bounded waits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import harness
    from jax.sharding import Mesh

TIMEOUT_MS = 2000
SLACK_S = 10.0   # the error reaches Python at the op's end or at runtime.check(); start-up skew between ranks
GOOD_OPS = 3
DEAD = 1         # the rank that dies, skips, or picks the other LL128 kernel
SHOTS_VAR = "PK_JAX_AR_LL128_SHOTS"


def attempt(fn: Callable[[], object]) -> tuple[str, float]:
    """Runs fn(); returns (the error it raised as "Type: message", "" if none; seconds taken)."""
    t0 = time.perf_counter()
    try:
        fn()
        msg = ""
    except Exception as e:  # noqa: BLE001 - the RuntimeError/XlaRuntimeError under test
        msg = f"{type(e).__name__}: {e}"
    return msg, time.perf_counter() - t0


def report(msg: str, elapsed: float, named: bool, what: str, survivors: Sequence[int]) -> NoReturn:
    """Prints FAULT-OK when `msg` is an error that `named` what it must (`what`, for the failure line) in time, else
    FAULT-FAIL with the reason; then exits this rank (harness.exit_now over `survivors`)."""
    import harness  # noqa: I001

    if msg and named and elapsed <= TIMEOUT_MS / 1000 + SLACK_S:
        print(f"FAULT-OK {elapsed:.2f} {msg[:400]}", flush=True)
        harness.exit_now(0, survivors)
    why = "no error" if not msg else (f"the error does not name {what}" if not named else "too late")
    print(f"FAULT-FAIL {elapsed:.2f} {why}: {msg[:400]}", flush=True)
    harness.exit_now(1, survivors)


def shots_worker(job: harness.Job, mesh: Mesh) -> NoReturn:
    """Mode shots: one all_reduce "small_ll128" of 64 KiB per member (547 lines, so the two-shot serves it), rank
    DEAD two-shot and the others one-shot. Every rank prints FAULT-OK when it raised the mismatch, naming the peer's
    kernel and the knob, in time."""
    import harness  # noqa: I001
    import cases
    import numpy as np
    import pk_jax

    os.environ[SHOTS_VAR] = "2" if job.rank == DEAD else "1"  # read by the extension at its first LL128 launch
    case = cases.Case("all_reduce", "small_ll128", "float32", "reduce", ((64, 256),), (1.0,),
                      lambda ax, x: (pk_jax.all_reduce(x, ax, algorithm="small_ll128"),),
                      lambda blocks, pos: [sum(np.asarray(b, np.float32) for b in blocks[0])], (64, 256))
    run = harness.case_runner(mesh, "x", case)
    msg, elapsed = attempt(lambda: run(0))
    theirs = "one-shot" if job.rank == DEAD else "two-shot"  # the peer kernel the error must name
    named = f"(small_ll128, {theirs})" in msg and SHOTS_VAR in msg
    report(msg, elapsed, named, f"small_ll128's {theirs} and {SHOTS_VAR}", list(range(job.ranks)))


def worker(mode: str) -> None:
    import harness  # noqa: I001 - puts the checkout on sys.path first
    import cases
    from jax.sharding import Mesh
    import jax
    import numpy as np

    job = harness.start_job()
    print(f"STARTUP {job.startup_s:.3f}", flush=True)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    if mode == "shots":
        shots_worker(job, mesh)
    g = mesh.shape["x"]
    by_name = {f"{c.op}/{c.case}": c for c in cases.collective_cases(g, "float32", quick=True)}
    gather = harness.case_runner(mesh, "x", by_name["all_gather/axis0_tiled"])
    reduce = harness.case_runner(mesh, "x", by_name["all_reduce/auto_small"])
    for i in range(GOOD_OPS):
        ok, err = gather(i)
        ok2, err2 = reduce(i)
        if not (ok and ok2):
            print(f"FAULT-FAIL good op {i} wrong: max_err {err}, {err2}", flush=True)
            harness.exit_now(1)
    survivors = [r for r in range(job.ranks) if not (mode == "kill" and r == DEAD)]
    if mode == "kill" and job.rank == DEAD:
        os._exit(9)

    def last_ops() -> None:
        if not (mode == "skip" and job.rank == DEAD):
            gather(GOOD_OPS)
        reduce(GOOD_OPS)

    msg, elapsed = attempt(last_ops)
    if job.rank == DEAD:  # skip mode: its all_reduce meets nobody; any outcome, as long as it ends
        print(f"SKIPPER-DONE {elapsed:.2f} {msg[:300]}", flush=True)
        harness.exit_now(0, survivors)
    report(msg, elapsed, "all_gather" in msg and f"rank {DEAD}" in msg, f"all_gather and rank {DEAD}", survivors)


def judge(mode: str, results: list[tuple[int | None, str]]) -> tuple[bool, str, float | None]:
    """(ok, why, worst elapsed) from every rank's exit code and output."""
    if any(code is None for code, _ in results):
        return False, "ranks left running: " + str([r for r, (c, _) in enumerate(results) if c is None]), None
    elapsed = []
    for r, (code, out) in enumerate(results):
        if r == DEAD and mode != "shots":
            if mode == "kill" and code != 9:
                return False, f"rank {DEAD} exited {code}, not 9", None
            continue
        m = re.search(r"^FAULT-OK (\S+)", out, re.M)
        if code != 0 or not m:
            return False, f"rank {r} exited {code} without FAULT-OK", None
        elapsed.append(float(m.group(1)))
    return True, "", max(elapsed)


def driver(args: argparse.Namespace) -> int:
    import spawn

    if args.cpu:
        print(f"SKIP faults --mode {args.mode}: the CPU fallback (jax.lax over gloo) has no bounded waits", flush=True)
        return 0
    per_gpu = spawn.ranks_per_gpu(args.ranks, args.ranks_per_gpu)
    t0 = time.perf_counter()
    results = spawn.run_ranks([os.path.abspath(__file__), "--worker", "--mode", args.mode], args.ranks,
                              per_gpu=per_gpu, timeout_s=240, extra_env={"PK_JAX_TIMEOUT_MS": str(TIMEOUT_MS)})
    for r, (code, out) in enumerate(results):
        for line in out.splitlines():
            print(f"[rank {r}] {line}")
        print(f"[rank {r}] exit {code}", flush=True)
    ok, why, worst = judge(args.mode, results)
    startup = [float(m.group(1)) for _, out in results for m in [re.search(r"^STARTUP (\S+)", out, re.M)] if m]
    print(f"{'PASS' if ok else 'FAIL'} fault {args.mode} group={args.ranks} ranks_per_gpu={per_gpu} "
          f"worst_elapsed={worst} (limit {TIMEOUT_MS / 1000 + SLACK_S:.0f} s) {why} [{time.perf_counter() - t0:.0f} s]",
          flush=True)
    if args.out:
        row = {"op": "fault", "case": args.mode, "shape": [], "dtype": "float32", "group": args.ranks,
               "extra": {"ok": ok, "max_err": 0.0 if ok else None, "ranks_per_gpu": per_gpu,
                         "startup_s": max(startup) if startup else None, "elapsed_s": worst, "timeout_ms": TIMEOUT_MS,
                         **({"error": why} if why else {})}}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump([row], f, indent=1)
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["kill", "skip", "shots"], required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ranks-per-gpu", default="auto", help="'auto': ceil(ranks / GPUs); or an int")
    p.add_argument("--cpu", action="store_true", help="a CPU job: says SKIP (no bounded waits there)")
    p.add_argument("--out", default=None, help="the row (JSON list) for the results file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.mode)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
