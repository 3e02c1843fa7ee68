"""Where a small all_reduce's per-op time goes (issue 25), on every visible GPU as one group.

For each op it times jitted chains of 16, 64 and 256 dependent calls (one sync per call) and reports
the per-op time of each chain and the slope (T256 - T64) / 192: the device time per op with the one
call's dispatch taken out. Ops: pk_jax small all_reduces (LL one-shot, chunk flags, pipelined chunk flags,
auto), jax.lax.psum, and an XLA-only chain (one elementwise kernel per step, no communication: the floor
of any op launched from this program).
It also says whether XLA put the custom calls into a command buffer (CUDA graph).
Run it under different XLA_FLAGS (one process each) to see what command buffers change:
  python scripts/latency_floor.py --tag default
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python scripts/latency_floor.py --tag no_cmdbuf
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax.bench import timing

AX = "x"
CHAINS = (16, 64, 256)


def program(mesh: Mesh, op, chain: int):
    def body(v):
        for _ in range(chain):
            v = op(v)
        return v

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX), out_specs=P(AX), check_vma=False))


def xla_step(v):
    # One kernel per step: the barrier keeps XLA from fusing the steps into one.
    return jax.lax.optimization_barrier(v * 0.5 + 1.0)


def profile_summary(run, label: str, calls: int = 3) -> list[str]:
    """Traces `calls` calls of run() (jax.profiler, CUPTI on GPUs) and returns one line per frequent event
    name per plane line: count, median duration and median start-to-start interval, in microseconds. The GPU
    lines show the kernels (duration = kernel time, interval - duration = the gap between kernels); the
    host lines show each thunk's host time."""
    from jax.profiler import ProfileData

    run()
    d = tempfile.mkdtemp(prefix="pk_floor_")
    jax.profiler.start_trace(d)
    for _ in range(calls):
        run()
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return [f"  profile {label}: no trace written"]
    out = []
    for plane in ProfileData.from_file(files[0]).planes:
        for line in plane.lines:
            by_name: dict[str, list[tuple[float, float]]] = {}
            for e in line.events:
                # Thunks are named per instruction (pk_collective.192): group them by their stem.
                by_name.setdefault(re.sub(r"\.\d+$", "", e.name), []).append((e.start_ns, e.duration_ns))
            for name, evs in sorted(by_name.items(), key=lambda kv: -len(kv[1]))[:3]:
                if len(evs) < 16:
                    continue
                evs.sort()
                dur = statistics.median(d for _, d in evs) / 1e3
                gaps = [b[0] - a[0] for a, b in zip(evs, evs[1:])]
                step = statistics.median(gaps) / 1e3 if gaps else float("nan")
                out.append(f"  profile {label}: {plane.name[:24]:<24} {line.name[:28]:<28} {name[:48]:<48} "
                           f"n={len(evs):<5} dur {dur:7.2f} us  start-to-start {step:7.2f} us")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="default")
    ap.add_argument("--bytes", type=int, nargs="+", default=[4096, 262144, 1 << 20])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--hlo-dir", default=None, help="write each chain-64 program's optimized HLO here")
    ap.add_argument("--ops", nargs="+", default=None, help="only these ops (default: all)")
    ap.add_argument("--profile", action="store_true", help="trace each op's chain-64 program at the first size")
    args = ap.parse_args()
    devices = jax.devices()
    g = len(devices)
    mesh = Mesh(np.array(devices), (AX,))
    ops = {"pk_small_one_shot": lambda v: pk_jax.all_reduce(v, AX, algorithm="small_one_shot"),
           "pk_small_two_shot": lambda v: pk_jax.all_reduce(v, AX, algorithm="small_two_shot"),
           "pk_small_chunked": lambda v: pk_jax.all_reduce(v, AX, algorithm="small_chunked"),
           "pk_small_pipelined": lambda v: pk_jax.all_reduce(v, AX, algorithm="small_pipelined"),
           "pk_small_ll128": lambda v: pk_jax.all_reduce(v, AX, algorithm="small_ll128"),
           "pk_auto": lambda v: pk_jax.all_reduce(v, AX),
           "psum": lambda v: jax.lax.psum(v, AX),
           "xla_elementwise": xla_step}
    if args.ops:
        ops = {k: v for k, v in ops.items() if k in args.ops}
    print(f"latency_floor [{args.tag}] G={g} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    rows = []
    for nbytes in args.bytes:
        local = nbytes // 2
        x = jax.jit(lambda k: jax.random.normal(k, (g * local,), jnp.float32).astype(jnp.bfloat16) * 1e-3,
                    out_shardings=NamedSharding(mesh, P(AX)))(jax.random.key(nbytes))
        for name, op in ops.items():
            progs = [program(mesh, op, c) for c in CHAINS]
            try:
                hlo = progs[1].lower(x).compile().as_text()
            except ValueError as e:  # a forced algorithm that cannot serve this size
                print(f"  {name:18s} {nbytes:9d} B  skipped: {str(e).splitlines()[0]}", flush=True)
                continue
            cmd = len(re.findall(r"command_buffer", hlo))
            if args.hlo_dir and nbytes == args.bytes[0]:
                with open(os.path.join(args.hlo_dir, f"{args.tag}-{name}.hlo.txt"), "w") as f:
                    f.write(hlo)
            calls = len(re.findall(r"custom-call\(|custom_call_target=", hlo))
            ms = timing.time_interleaved([lambda xs, p=p: p(xs[0]) for p in progs], [x], warmup=3, reps=args.reps,
                                         ops_per_call=1)
            per_op = {c: m * 1e3 / c for c, m in zip(CHAINS, ms)}
            slope = (ms[2] - ms[1]) * 1e3 / (CHAINS[2] - CHAINS[1])
            # A row of the collectives suite's latency sweep (results-format.md): ours_ms = the slope.
            row = {"op": "all_reduce", "case": f"floor_{name}", "shape": [nbytes], "dtype": "bfloat16", "group": g,
                   "ours_ms": round(slope / 1e3, 6), "baseline": None, "baseline_ms": None, "ratio": None,
                   "extra": {"tag": args.tag, "slope_us": round(slope, 2),
                             "us_per_op": {str(c): round(u, 2) for c, u in per_op.items()},
                             "hlo_command_buffer_mentions": cmd, "hlo_custom_call_mentions": calls}}
            if args.profile and nbytes == args.bytes[0]:
                for line in profile_summary(lambda p=progs[1]: jax.block_until_ready(p(x)), name):
                    print(line, flush=True)
            row["extra"]["env"] = {k: v for k, v in os.environ.items()
                                   if k.startswith(("PK_JAX_SMALL", "PK_JAX_AR_", "XLA_FLAGS"))}
            rows.append(row)
            print(f"  {name:<18} {nbytes:>8} B  per op (chain 16/64/256): "
                  + " / ".join(f"{per_op[c]:6.2f}" for c in CHAINS)
                  + f" us  slope {slope:6.2f} us  [command_buffer x{cmd}, custom-call x{calls}]", flush=True)
    if args.out:
        from pk_jax.bench import results

        results.write(args.out, "collectives", rows, command="python scripts/latency_floor.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
