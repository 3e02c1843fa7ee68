"""pk_jax benchmarks: `python -m pk_jax.bench {demo,collectives,gemm,tp_gemm,transfer,sync,model,context,moe,
attention,multirank} [--quick] [--out FILE]`. Suites write FILE (JSON, benchmarks/results format) and, beside it,
a PNG of every row's ratio (with the overlap bound where the row has one); `python -m pk_jax.bench plot
FILE.json...` redraws those PNGs from results files. context, moe and attention keep the rows finished so far in
FILE without .json + .partial.json ("partial": true), rewritten after every row and removed once FILE is written:
what a run killed by `timeout N` leaves.

On GPUs it uses every visible GPU as one group; without GPUs it runs on 8 virtual CPU devices
(small sizes; semantics and plumbing only, the timings mean nothing there).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import sys
from collections.abc import Callable


# Without GPUs, XLA gets 8 virtual CPU devices. XLA's combiners would merge the K independent
# baseline collectives of one timed call into a few large ones; a model's single op is not merged,
# so the baseline is timed per op with combining off.
_XLA_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_gpu_all_reduce_combine_threshold_bytes=0",
              "--xla_gpu_all_gather_combine_threshold_bytes=0",
              "--xla_gpu_reduce_scatter_combine_threshold_bytes=0")


def _ensure_flags() -> None:
    """Must run before jax initializes its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    for f in _XLA_FLAGS:
        if f.split("=")[0] not in flags:
            flags += " " + f
    os.environ["XLA_FLAGS"] = flags.strip()


def _exit_on_sigterm(signum: int, frame) -> None:
    """SIGTERM (e.g. from `timeout N`) as SystemExit: the suite's finally blocks run on the way out. Python runs it
    only when the main thread is back in the interpreter: a call hung in C (a kernel that never ends) outlives the
    SIGTERM, so wrap runs in `timeout -k SECONDS N` (SIGKILL after the grace)."""
    raise SystemExit(128 + signum)


def _run_keeping_rows(out: str, suite: str, run: Callable[[], list[dict]]) -> list[dict]:
    """run() of a suite that hands each finished row to results.add_partial: the rows are kept in
    results.partial_path(out) as they finish (a run killed by a timeout, or failing, leaves them there; _report
    removes the file once `out` holds every row). SIGTERM raises SystemExit while it runs; the partial file does
    not depend on that: it is whole after every row."""
    from pk_jax.bench import results

    results.start_partial(out, suite)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return run()
    finally:  # main() may run in a longer-lived process (tests): leave no handler, no file kept open for rows
        signal.signal(signal.SIGTERM, previous)
        results.stop_partial()


def _report(out: str, suite: str, rows: list[dict], print_table, bad=None) -> int:
    """Writes the results file, removes the partial one (_run_keeping_rows; or an earlier run's, killed, of the
    same name: the new file replaces it) and prints the table; the exit code is 1 when a row's check failed."""
    from pk_jax.bench import results

    bad = bad or (lambda r: "MISMATCH" in str(r.get("extra", {}).get("check", "")))
    results.write(out, suite, rows)
    results.discard_partial(out)
    print()
    print_table(rows)
    print(f"\nwrote {out}")
    try:  # the plot is a convenience: it never costs the run its exit code
        results.plot_file(out)
    except Exception as e:  # noqa: BLE001
        print(f"pk_jax.bench: no plot ({type(e).__name__}: {e})")
    return 1 if any(bad(r) for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:  # no device work: results files only
        from pk_jax.bench import results

        if len(argv) < 2:
            print("usage: python -m pk_jax.bench plot FILE.json [FILE.json ...]", file=sys.stderr)
            return 2
        ok = []
        for path in argv[1:]:
            try:
                ok.append(results.plot_file(path) is not None)
            except Exception as e:  # noqa: BLE001 - say which file, go on with the others
                print(f"pk_jax.bench plot: {path}: {type(e).__name__}: {e}", file=sys.stderr)
                ok.append(False)
        return 0 if all(ok) else 1
    args = build_parser().parse_args(argv)
    return run_suite(args)


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line (every suite's flags)."""
    p = argparse.ArgumentParser(prog="python -m pk_jax.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=["demo", "collectives", "gemm", "tp_gemm", "transfer", "sync", "model", "context",
                                     "moe", "attention", "multirank"],
                   help="which suite to run (demo: one row per op family, under two minutes; model: a Llama-style "
                        "layer's training step; context: ring/Ulysses attention; moe: expert parallelism; attention: "
                        "the one-GPU attention kernel vs cuDNN; multirank: the multi-process "
                        "correctness suite, tests/multirank)")
    p.add_argument("--quick", action="store_true", help="small sizes (default on CPU)")
    p.add_argument("--small", action="store_true", help="context, moe: tiny sizes (same as --quick; default on CPU)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed calls per case, median reported (default 20; transfer 5, sync 9)")
    p.add_argument("--op", default=None, help="only this op (e.g. all_reduce; moe: a comma-separated list, e.g. "
                                              "dispatch,combine)")
    p.add_argument("--cases", nargs="+", default=None,
                   help="attention: only these cases (fwd, fwd_causal, fwd_gqa, fwd_causal_gqa and their fwd_bwd* "
                        "forms: forward + backward); context: case names (fwd_contiguous, fwd_causal_zigzag, ...); "
                        "moe: only these (uniform_fwd, skewed_fwd_bwd, ...)")
    p.add_argument("--ring-transports", nargs="+", default=None,
                   choices=["pk", "pk-copy", "pk-acc", "pk-copy-acc", "pk-dq", "pk-copy-dq", "pk-copy-dq-cudnn",
                            "pk-copy-dq-cudnn-bf16hops", "pk-copy-dq-cudnn-deferred", "pk-copy-dq-cudnn-split",
                            "pk-copy-dq-cudnn-deferred-split", "default", "direct", "split", "whole", "pk-direct",
                            "cudnn-fwd", "cudnn-fwd-dq", "xla"],
                   help="context: ring rows timed with each transport in the same turns (the first is ours_ms; "
                        "default: the environment's settings; -copy: $PK_JAX_RING_SHIFT_ENGINE=copy, -acc: "
                        "$PK_JAX_RING_MERGE=kernel, -dq: =dq, -cudnn: $PK_JAX_RING_LOCAL=cudnn, without: =pk; "
                        "-bf16hops: $PK_JAX_RING_ACC_DTYPE=input, -deferred: $PK_JAX_RING_SUMS=deferred (the default; "
                        "without it the pk-* transports are eager), -split: "
                        "$PK_JAX_RING_LOCAL=cudnn-split; default: the settings as they are; direct / split / whole: "
                        "the defaults with $PK_JAX_RING_MERGE=dq-direct / $PK_JAX_RING_LOCAL=cudnn-split / "
                        "cudnn-whole; pk-direct: the defaults with $PK_JAX_RING_LOCAL=pk and dq-direct; cudnn-fwd(-dq): "
                        "$PK_JAX_RING_LOCAL=cudnn-fwd with dq-direct (dq)), e.g. "
                        "--ring-transports default whole split")
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="attention, context: only these sequence lengths")
    p.add_argument("--compute-floor", action="store_true",
                   help="context: ring rows also time the ring with communication off and our attention kernel on "
                        "each member's blocks (extra.compute_over_floor: issue 26's <= 1.05)")
    p.add_argument("--head-dims", type=int, nargs="+", default=None, help="attention: only these head dims")
    p.add_argument("--fwd-variants", nargs="*", default=None, metavar="VARIANT",
                   help="attention: time the forward kernel variants (base, l2order, pingpong, fa3n160, fa3n176; "
                        "or only the named ones) beside the default and cuDNN on the default shapes (--variants: the "
                        "full sweep, with the pipelined schedule too)")
    p.add_argument("--bwd-variants", nargs="*", default=None, metavar="VARIANT",
                   help="attention: on the fwd_bwd* rows also time the backward kernel variants (dqfirst, "
                        "l2order_dqfirst; or only the named ones) beside the default")
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="tp_gemm: only these N (default 4096..32768); moe: only these hidden sizes (e.g. 7168)")
    p.add_argument("--variants", action="store_true",
                   help="also time the non-default variants (collectives: pull transport; gemm: every tile; "
                        "attention: the full sweep, 64k..512k tokens, 16..128 heads; moe grouped_matmul: the "
                        "kernel's schedule variants, PK_JAX_GROUPED_VARIANT, without lax.ragged_dot)")
    p.add_argument("--group", type=int, default=None, help="model: mesh of the first G devices (default: all)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="model: T per step (default 8192 16384)")
    p.add_argument("--widths", nargs="+", default=None, choices=["llama3-8b", "llama3-70b"],
                   help="model: layer widths (default both)")
    p.add_argument("--blocks", nargs="+", default=None, choices=["transformer_layer", "mlp_block"],
                   help="model: what to time (default both)")
    p.add_argument("--mlp", default="gelu", choices=["gelu", "swiglu"], help="model: MLP of the layer (default gelu)")
    p.add_argument("--distributed", action="store_true",
                   help="model: join a jax.distributed job first (one process per GPU, or under pk_jax.launch; "
                        "process 0 writes)")
    p.add_argument("--layouts", action="store_true",
                   help="gemm: only the backward layouts' rows (NT, TN on the Llama-3-70B MLP backward shapes)")
    p.add_argument("--latency", action="store_true",
                   help="collectives: the all_reduce latency sweep (4 KiB..8 MiB, decode shapes; chains of 64 ops)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<date>-<suite>-<device>.json)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="multirank: process counts (default 2 4)")
    p.add_argument("--ranks-per-gpu", default="auto",
                   help="multirank: ranks sharing one GPU; auto: ceil(ranks / GPUs) (default)")
    p.add_argument("--cpu", action="store_true", help="multirank: CPU ranks (gloo; the jax.lax fallbacks)")
    p.add_argument("--calls", type=int, default=1000, help="multirank: calls of the soak (default 1000)")
    p.add_argument("--steps", nargs="+", default=None,
                   help="multirank: only these steps (check_ops check_training check_jit check_small "
                        "check_small_replay check_moe soak faults_kill faults_skip faults_shots; default all)")
    return p


def run_suite(args: argparse.Namespace) -> int:
    """Runs the suite `args` names (build_parser's flags)."""
    if args.suite == "multirank":  # before any jax backend starts here: the ranks need the GPUs
        from pk_jax.bench import multirank

        return multirank.run(args.ranks, args.ranks_per_gpu, args.cpu, args.quick, args.calls, args.out,
                             only=args.steps)
    _ensure_flags()
    import jax

    if args.distributed:
        import pk_jax

        if not os.environ.get("JAX_NUM_PROCESSES"):  # under pk_jax.launch, pk_jax.initialize() joins the job
            jax.distributed.initialize()  # coordinator, process count and id from the environment / cluster
        pk_jax.initialize()  # the kernels' cross-process memory (a no-op in one process)

    from pk_jax.bench import collectives, results

    slug = re.sub(r"[^A-Za-z0-9]+", "-", results.device_description()).strip("-").lower()
    out = args.out or os.path.join("benchmarks", "results",
                                   f"{datetime.date.today().isoformat()}-{args.suite}-{slug}.json")
    out_dir = os.path.dirname(os.path.abspath(out))
    os.makedirs(out_dir, exist_ok=True)
    if args.suite in ("transfer", "sync"):
        from pk_jax.bench import microbench

        microbench.require_gpus()
        print(f"pk_jax.bench {args.suite}: {results.device_description()}", flush=True)
        if args.suite == "transfer":
            rows = microbench.run_transfer(args.quick, args.reps or 5, out_dir)
            sat = {m: microbench.saturation_sms(rows, m) for m in microbench.DEVICE_MECHANISMS}
            print("SMs to reach 90% of each mechanism's best bandwidth:", sat)
        else:
            rows = microbench.run_sync(args.reps or 9)
        results.write(out, args.suite, rows)
        results.print_micro_table(rows)
        print(f"\nwrote {out}")
        return 0

    on_gpu = jax.devices()[0].platform == "gpu"
    if args.suite == "demo":
        from pk_jax.bench import demo

        print(f"pk_jax.bench demo: {results.device_description()}", flush=True)
        if not on_gpu:
            print("  (no GPU: tiny sizes, pk_jax ops run their jax.lax fallback; timings only exercise the plumbing)")
        rows = demo.run(reps=args.reps or 10)
        results.write(out, args.suite, [r for r in rows if "skipped" not in r])
        print()
        demo.print_summary(rows)
        demo.plot(rows, os.path.splitext(out)[0] + ".png")
        print(f"\nwrote {out}")
        return 1 if any(r.get("extra", {}).get("check") == "MISMATCH" for r in rows) else 0
    if args.suite == "model":
        from pk_jax.bench import model

        args.out = out
        return model.main(args)
    if args.suite == "gemm":
        from pk_jax.bench import gemm

        reps = args.reps or 20
        print(f"pk_jax.bench gemm: {results.device_description()} (uses GPU 0), {reps} reps", flush=True)
        if not on_gpu:
            print("  (no GPU: pk_jax.matmul runs jnp.dot here; timings only exercise the plumbing)")
        rows = gemm.run(quick=args.quick, reps=reps, tiles=args.variants, plain=not args.layouts)
        return _report(out, args.suite, rows, lambda r: (results.print_gemm_table(r), results.print_layout_table(r)))
    if args.suite == "tp_gemm":
        from pk_jax.bench import tp_gemm

        reps = args.reps or 20
        print(f"pk_jax.bench tp_gemm: {results.device_description()}, {reps} reps", flush=True)
        if len(jax.devices()) < 2:
            print("pk_jax.bench: needs at least 2 devices (GPUs, or virtual CPU devices)", file=sys.stderr)
            return 2
        rows = tp_gemm.run(quick=args.quick, reps=reps, only=args.op, out_dir=out_dir, sizes=args.sizes)
        return _report(out, args.suite, rows, results.print_tp_table)
    if args.suite == "attention":
        from pk_jax.bench import attention

        reps = args.reps or 10
        print(f"pk_jax.bench attention: {results.device_description()} (uses GPU 0), {reps} reps", flush=True)
        if not on_gpu:
            print("  (no GPU: both sides run XLA at tiny sizes; timings only exercise the plumbing)")
        rows = _run_keeping_rows(out, args.suite, lambda: attention.run(
            quick=args.quick, reps=reps, full=args.variants, cases=args.cases, seqs=args.seqs,
            head_dims=args.head_dims, fwd_variants=args.fwd_variants, bwd_variants=args.bwd_variants))
        return _report(out, args.suite, rows, attention.print_table, bad=attention.bad_row)
    if args.suite in ("context", "moe"):  # both run at group 1 too
        import importlib

        suite = importlib.import_module(f"pk_jax.bench.{args.suite}")
        reps = args.reps or 20
        small = args.small or args.quick or not on_gpu
        print(f"pk_jax.bench {args.suite}: {results.device_description()}, {'small' if small else 'full'} sizes, "
              f"{reps} reps", flush=True)
        if not on_gpu:
            print("  (no GPU: timings only exercise the plumbing)")
        kw = (dict(cases=args.cases, hidden=args.sizes, variants=args.variants) if args.suite == "moe"
              else dict(names=args.cases, seqs=args.seqs, transports=args.ring_transports,
                        compute_floor=args.compute_floor))
        rows = _run_keeping_rows(out, args.suite, lambda: suite.run(small=small, reps=reps, only=args.op, **kw))
        return _report(out, args.suite, rows, suite.print_table)
    if len(jax.devices()) < 2:
        print("pk_jax.bench: needs at least 2 devices (GPUs, or virtual CPU devices)", file=sys.stderr)
        return 2
    quick = args.quick or not on_gpu
    reps = args.reps or 20
    print(f"pk_jax.bench {args.suite}: {results.device_description()}, "
          f"{'quick sizes' if quick else 'full sizes'}, {reps} reps", flush=True)
    if not on_gpu:
        print("  (no GPU: pk_jax ops run their jax.lax fallback here; timings only exercise the plumbing)")
    if args.latency:
        from pk_jax.bench import latency

        if args.out is None:
            out = out[:-len(".json")] + "-latency.json"  # a side run of the collectives suite: tag after the device
        rows = latency.run(reps=reps, variants=args.variants, quick=quick)
        return _report(out, args.suite, rows, latency.print_table)
    rows = collectives.run(quick=quick, reps=reps, only=args.op, variants=args.variants)
    return _report(out, args.suite, rows, results.print_table)


if __name__ == "__main__":
    sys.exit(main())
