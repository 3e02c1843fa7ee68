"""Many mixed pk_jax calls across processes, every result checked against NumPy.

A pool of programs (every collective in every dtype and the fused TP GEMMs in each schedule, over each
mesh axis of harness.meshes) is compiled once; then `--calls` calls (default 1000)
pick programs in a random order that every rank draws from the shared seed, each on fresh inputs.
Rank 0 prints one PASS/FAIL line per program (all its calls) and writes the rows to --out.
"""

from __future__ import annotations

import time

import numpy as np

import harness  # noqa: I001 - puts the checkout on sys.path first
import cases


def main() -> int:
    args = harness.parse_args(__doc__, lambda p: p.add_argument("--calls", type=int, default=1000))
    job = harness.start_job()
    rows = harness.Rows(job, "soak")
    fused_dtype = "bfloat16" if "bfloat16" in args.dtypes else args.dtypes[0]
    pool = []
    for mesh, axis in harness.meshes(job):
        g = mesh.shape[axis]
        todo = [c for d in args.dtypes for c in cases.collective_cases(g, d, args.quick)]
        todo += cases.fused_cases(g, fused_dtype, grads=False)  # gradients: check_ops
        pool += [(axis, g, c, harness.case_runner(mesh, axis, c)) for c in todo]
    order = np.random.default_rng(args.seed).integers(len(pool), size=args.calls)
    seen: dict[int, dict] = {}
    t0 = time.perf_counter()
    for call, i in enumerate(order):
        axis, g, c, run = pool[int(i)]
        s = seen.setdefault(int(i), {"ok": True, "max_err": 0.0, "calls": 0})
        try:
            ok, err = run(args.seed * 1_000_003 + call)
        except Exception as e:  # noqa: BLE001 - recorded against the program; the soak goes on
            ok, err = False, float("inf")
            s.setdefault("error", f"call {call}: {type(e).__name__}: {str(e)[:300]}")
            if "runtime is stopped" in str(e):  # every later call would only time out
                s["ok"], s["calls"] = False, s["calls"] + 1
                print(f"soak: stopped at call {call}: the pk_jax runtime stopped", flush=True)
                break
        s["ok"] &= ok
        s["max_err"] = max(s["max_err"], err)
        s["calls"] += 1
        if (call + 1) % 100 == 0 and job.rank == 0:
            print(f"soak: {call + 1}/{args.calls} calls, {time.perf_counter() - t0:.1f} s", flush=True)
    if sum(s["calls"] for s in seen.values()) < args.calls:
        rows.add("soak", "all_calls", [args.calls], "mixed", job.ranks, False, float("inf"),
                 error=f"only {sum(s['calls'] for s in seen.values())} of {args.calls} calls ran")
    for i, s in sorted(seen.items()):
        axis, g, c, _ = pool[i]
        extra = {"calls": s["calls"], **({"error": s["error"]} if "error" in s else {})}
        rows.add(c.op, f"{c.case}@{axis}", c.shape, c.dtype, g if c.grouped else 1, s["ok"], s["max_err"], **extra)
    return rows.finish(args.out)


if __name__ == "__main__":
    harness.exit_now(main())
