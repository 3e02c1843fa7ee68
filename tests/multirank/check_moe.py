"""Expert parallelism across processes (issue 27's test mode: 2 and 4 ranks sharing one GPU): pk_jax.moe's
dispatch and combine in every routing case of tests/moe_model.py against its NumPy model, and moe_mlp's
output and gradients against a float32 reference. Every exchange (rows, expert counts, the weight
gradients' sum over a data axis) is a pk_jax collective: no XLA collective may run (on GPU the compiled
programs are checked for them).

Run under the launcher, e.g. `python -m pk_jax.launch -n 4 --ranks-per-gpu 4 tests/multirank/check_moe.py
--out rows.json`, or `--cpu` (the jax.lax fallbacks over gloo). Rows (results-format, suite "multirank"):
- dispatch / combine, case `<routing>_fwd` / `<routing>_fwd_bwd`, routing = kind_k<top_k>[_cap<C>][_recv<R>]
  (moe_routing.ROUTINGS), shape [T, H, E, K] with T tokens per member, group G = all members:
  dispatch_fwd: received rows in the model's order, zero rows after them, counts per local expert, rows
  sent to each member (exact); dispatch_fwd_bwd: dispatch's VJP of a random row cotangent (each row back
  to its token once); combine_fwd: each row scaled by 1 + its expert id and combined (every arrived choice
  counted once, weighted once, dropped choices zero); combine_fwd_bwd: that pipeline's d x and
  d topk_weights. One program per routing computes all four.
- moe_mlp, case `<routing>_fwd` / `<routing>_fwd_bwd` (output; output and the five gradients, one program),
  float32 and bfloat16, on a 1-D ("ep",) mesh and (even rank counts) a (dp=2, ep=G/2) mesh with the experts
  replicated over dp, whose weight gradients are summed over dp by pk_jax.all_reduce (case suffix
  @dp2xep<G/2>), shape [T, H, E, K].
--quick (CPU CI): routings idle_member_k2 and skewed_k2_cap2; moe_mlp skewed_k2_cap<T/4> and skewed_k2@dp2.
On GPUs every program runs pk_jax.moe's fused kernels (PK_JAX_MOE_DISPATCH=auto; each routing program is
checked to hold their custom calls), and the quick routings run once more on the reference exchange (case
suffix @reference) and on the fused kernels before deduplication (PK_JAX_MOE_DEDUP=0, suffix @nodedup).
On GPUs one more moe_mlp row runs dispatch and the gate/up grouped GEMMs fused (PK_JAX_MOE_OVERLAP=1, bfloat16,
case suffix @overlap: pk_jax/moe/overlap.py's kernel across processes).
--smoke: routings uniform_k2 and skewed_k2_cap2 on the default path only (no moe_mlp): the
first run of a new build, under a short timeout.
"""

from __future__ import annotations

import harness  # noqa: I001 - puts the checkout on sys.path first
import moe_routing  # noqa: E402
import moe_mlp_case  # noqa: E402


def main() -> int:
    args = harness.parse_args(__doc__, lambda p: p.add_argument(
        "--smoke", action="store_true", help="two routings on the default path, no moe_mlp"))
    job = harness.start_job()
    rows = harness.Rows(job, "check_moe")
    for routing in moe_routing.routings(args.quick, args.smoke):
        moe_routing.add_rows(rows, routing, args.seed, job.on_gpu)
    if args.smoke:
        return rows.finish(args.out)
    if job.on_gpu:  # the reference exchange stays covered (PK_JAX_MOE_DISPATCH=reference)
        for routing in moe_routing.routings(True):
            moe_routing.add_rows(rows, routing, args.seed, job.on_gpu, impl="reference")
            moe_routing.add_rows(rows, routing, args.seed, job.on_gpu, dedup=False)  # the kernels before dedup
    dtypes = [d for d in args.dtypes if d in ("float32", "bfloat16")] or ["float32"]
    for case in moe_mlp_case.cases(args.quick, dtypes):
        moe_mlp_case.add_rows(rows, case, args.seed, job.on_gpu)
    if job.on_gpu:  # dispatch + the first grouped GEMM as one kernel (PK_JAX_MOE_OVERLAP=1), case suffix @overlap
        moe_mlp_case.add_rows(rows, moe_mlp_case.overlap_case(args.quick), args.seed, job.on_gpu)
    return rows.finish(args.out)


if __name__ == "__main__":
    harness.exit_now(main())
