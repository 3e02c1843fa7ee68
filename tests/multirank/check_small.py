"""The small-message path (issue 25) across processes: a size sweep of every small op against NumPy.

Run under the launcher, e.g. `python -m pk_jax.launch -n 4 --ranks-per-gpu 4 tests/multirank/check_small.py --out rows.json`
(the issue's mode: ranks sharing one GPU under MPS), or `--cpu` (the jax.lax fallbacks over gloo: values
and the API's choice only). Meshes as check_ops.py: 1-D ("x",) over all devices and, from 4 devices,
each axis of 2 x (n/2) ("dp", "tp"). Per mesh axis, dtype (float32, bfloat16, float16) and size, one
program holds ten ops, each on its own fresh random input (x per member):

  all_reduce      small_one_shot (x 3-D), small_two_shot (2-D), small (1-D: the API picks by size and G),
                  small_chunked (2-D), small_pipelined (2-D), small_ll128 (2-D)
  all_gather      axis0_tiled (x 2-D, blocks along axis 0), last_tiled (x (1, n), blocks along the last axis)
  reduce_scatter  dim0 (x (G a, b): block (a, b)), last (x (1, G n): block (1, n))

Sizes (small_cases.SIZES, bytes of x per member; reduce_scatter: of one block): 4, 6, 10, 12, 30, 1002,
1004, 4096, 65534, 65536, 262148, 1 MiB - 2, 1 MiB, 1 MiB + 4, 1 MiB + 6, 8 MiB. bfloat16/float16 run all
16; float32 the 9 that are whole float32 elements (4, 12, 1004, 4096, 65536, 262148, 1 MiB, 1 MiB + 4,
8 MiB). --quick: 4, 6, 1004, 1 MiB + 4.

The small path is forced (algorithm="small_one_shot" / "small_two_shot" / "small_chunked" / "small_pipelined" /
"small_ll128" / "small"), never
left to auto. Where the API refuses it (payload above 1 MiB on the LL lines, above 8 MiB by chunk flags;
two-shot with x's 4-byte words not divisible by G) the
row records the API's ValueError message under `refused` and runs the op with algorithm="auto" (with
PK_JAX_SMALL_PATH=1, so auto's own small/bulk rule is checked too); a refusal the limits do not predict,
or a size served that they say is refused, fails the row. Every row checks that its op lowered to the
variant it must (the small kernel's, or bulk where refused): in the jaxpr (the API's choice) everywhere
and, on GPU, by counting the pk_collective custom calls of each (op, variant) in the compiled HLO, so a
silent fallback to jax.lax or to the bulk kernel fails. Values: gathers exact, sums within
harness.TOLERANCES["reduce"] of a float32 rank-order reference of the rounded inputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable

os.environ["PK_JAX_SMALL_PATH"] = "1"  # auto may take the small path: the refused rows check its rule

import harness  # noqa: E402,I001 - puts the checkout on sys.path first
import small_cases  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402


def add_args(p) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="bytes per member (default: small_cases.SIZES, or QUICK_SIZES with --quick)")


def refusal_of(mesh: Mesh, axis: str, dtype) -> Callable[[Callable, tuple[int, ...]], str]:
    """refusal(fn, shape): the API's ValueError message for fn on a member's x of `shape`, "" if none
    (traced only: nothing runs)."""
    spec = P(tuple(mesh.axis_names))

    def refusal(fn, shape: tuple[int, ...]) -> str:
        f = jax.shard_map(lambda b: fn(axis, b[0])[None], mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
        try:
            jax.make_jaxpr(f)(jax.ShapeDtypeStruct((mesh.devices.size, *shape), dtype))
        except ValueError as e:
            return str(e)
        return ""
    return refusal


def check_program(mesh: Mesh, axis: str, ops: list[small_cases.SmallOp], dtype: str, nbytes: int,
                  seed: int, on_gpu: bool) -> list[tuple[bool, float, dict]]:
    """Runs the ops as one program on fresh stacked inputs (members, *op.shape); one result per op."""
    members = mesh.devices.size
    inputs = [harness.random_inputs(seed, f"small/{o.op}/{o.case}/{nbytes}/{axis}", [(members, *o.shape)], dtype)[0]
              for o in ops]
    prog = harness.members_program(mesh, lambda *xs: tuple(o.fn(axis, x) for o, x in zip(ops, xs)), len(ops))
    args = [harness.stacked_array(mesh, a) for a in inputs]
    traced = prog.trace(*args)
    found = small_cases.jaxpr_variants(traced.jaxpr.jaxpr)
    compiled = traced.lower().compile()
    hlo = compiled.as_text() if on_gpu else None  # on CPU the ops are jax.lax: no custom calls to count
    problems = small_cases.variant_problems([(o.op, o.want) for o in ops], found, hlo)
    outs = jax.block_until_ready(compiled(*args))
    pk_jax.runtime.check()  # a peer that failed or never arrived (GPU) is an error here, not a hang
    results = []
    for i, o in enumerate(ops):
        def ref(member: int, o=o, a=inputs[i]) -> list[np.ndarray]:
            group = harness.group_of(mesh, axis, member)
            return [o.ref([a[m] for m in group], group.index(member))]
        ok, err = harness.compare([outs[i]], ref, o.kind, dtype)
        problem = "; ".join(p for p in (problems[i], o.refused if o.refused.startswith("MISMATCH") else "") if p)
        extra = {"bytes": nbytes, "algorithm": o.algorithm, "variant": "bulk" if o.want < 0 else o.want}
        if o.refused:
            extra["refused"] = o.refused[:300]
        if problem:
            extra["error"] = problem[:400]
        results.append((ok and not problem, err, extra))
    return results


def main() -> int:
    args = harness.parse_args(__doc__, add_args)
    job = harness.start_job()
    rows = harness.Rows(job, "check_small")
    sizes = args.sizes or (small_cases.QUICK_SIZES if args.quick else small_cases.SIZES)
    for mesh, axis in harness.meshes(job):
        g = mesh.shape[axis]
        where = harness.where(mesh, axis)
        for dtype in args.dtypes:
            refusal = refusal_of(mesh, axis, harness.DTYPES[dtype])
            for nbytes in sizes:
                try:
                    ops = small_cases.small_ops(g, nbytes, harness.DTYPES[dtype], refusal)
                except Exception as e:  # noqa: BLE001 - tracing an op failed other than by refusing: a failed row
                    rows.add("small_ops", f"{nbytes}B{where}", [nbytes], dtype, g, False, float("inf"),
                             error=f"{type(e).__name__}: {str(e)[:400]}")
                    continue
                if not ops:
                    continue  # not a whole number of elements of this dtype
                labels = [(o.op, f"{o.case}/{nbytes}B{where}", o.shape, dtype, g) for o in ops]
                rows.run_group(labels, lambda ops=ops, dtype=dtype, nbytes=nbytes: check_program(
                    mesh, axis, ops, dtype, nbytes, args.seed, job.on_gpu))
    return rows.finish(args.out)


if __name__ == "__main__":
    harness.exit_now(main())
