"""Every pk_jax op across processes, checked against NumPy float32 references.

Run under the launcher, e.g. `python -m pk_jax.launch -n 4 --ranks-per-gpu 4 tests/multirank/check_ops.py --out rows.json`
(or `--cpu` for the jax.lax fallbacks over gloo). Meshes: 1-D ("x",) over all devices and, from 4 devices,
2 x (n/2) ("dp", "tp") with the ops over each axis. Per mesh axis: the collectives in every dtype, the
three fused TP GEMMs in each schedule (bf16) and their gradients; pk_jax.matmul once (local). Rank 0
prints one PASS/FAIL line per case and writes the merged rows (results-format, suite "multirank").
"""

from __future__ import annotations

import harness  # noqa: I001 - puts the checkout on sys.path first
import cases


def main() -> int:
    args = harness.parse_args(__doc__)
    job = harness.start_job()
    rows = harness.Rows(job, "check_ops")
    fused_dtype = "bfloat16" if "bfloat16" in args.dtypes else args.dtypes[0]
    for i, (mesh, axis) in enumerate(harness.meshes(job)):
        g = mesh.shape[axis]
        todo = [c for d in args.dtypes for c in cases.collective_cases(g, d, args.quick)]
        todo += cases.fused_cases(g, fused_dtype, grads=not args.quick)
        if i == 0:
            todo += [c for d in args.dtypes for c in cases.matmul_cases(d)]
        where = harness.where(mesh, axis)
        for c in todo:
            label = f"{c.case}{where}"
            run = harness.case_runner(mesh, axis, c)
            rows.run(c.op, label, c.shape, c.dtype, g if c.grouped else 1, lambda: run(args.seed))
    return rows.finish(args.out)


if __name__ == "__main__":
    harness.exit_now(main())
