"""SM clock, power and throttle reasons while one attention program runs back to back, ours (pk_jax.attention) and
cuDNN's, read with nvidia-smi (queries only: the card's settings are left alone). Under a sustained load the H200
holds its power limit by lowering the SM clock, so a kernel that spends more energy per FLOP runs at a lower clock
than in a one-call trace: this shows whether that is where a bench row's gap comes from.

    python3 scripts/attention_power.py --batch 4 --seq 16384 --causal --grads --seconds 6

Per side: milliseconds per op (--count input sets per program, as the bench rotates them), the median / min SM clock
(MHz), median power (W), temperature and the throttle reasons seen, sampled every 50 ms after a 1 s settle; the two
sides alternate --turns times."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import jax

from attention_timeline import add_program_arguments, input_sets, program


def query_fields() -> str:
    """The nvidia-smi fields to sample: the throttle reasons under their newer name where the driver knows it."""
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        fields = f"clocks.sm,power.draw,temperature.gpu,{reasons}"
        probe = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={fields}", "--format=csv,noheader"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return fields
    raise SystemExit(f"nvidia-smi refused the queries: {probe.stdout} {probe.stderr}")


def sample(run, seconds: float, fields: str) -> dict:
    """Run `run` back to back for `seconds` (after a 1 s settle) while nvidia-smi samples GPU 0."""
    end = time.time() + 1.0
    while time.time() < end:  # settle: the clock reaches its sustained level
        jax.block_until_ready(run())
    smi = subprocess.Popen(["nvidia-smi", "-i", "0", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    calls, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        out = run()
        calls += 1
        if calls % 4 == 0:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    elapsed = time.time() - t0
    smi.terminate()
    lines = [l.split(",") for l in smi.communicate()[0].strip().splitlines() if l.count(",") == 3]
    clocks = [float(l[0]) for l in lines]
    power = [float(l[1]) for l in lines]
    temps = [float(l[2]) for l in lines]
    reasons = sorted({l[3].strip() for l in lines})
    return {"ms_per_call": 1e3 * elapsed / calls, "clock_med": statistics.median(clocks), "clock_min": min(clocks),
            "power_med": statistics.median(power), "temp_max": max(temps), "reasons": reasons, "samples": len(lines)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_program_arguments(ap)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--turns", type=int, default=2)
    a = ap.parse_args()
    shape = (a.batch, a.seq, a.heads, a.head_dim)
    sets = input_sets(shape, a.count)
    fields = query_fields()
    fns = {impl: program(impl, a.causal, a.grads) for impl in ("pk", "cudnn")}
    for fn in fns.values():
        jax.block_until_ready(fn(sets))
    print(f"{list(shape)} causal={a.causal} grads={a.grads} count={a.count}")
    for turn in range(a.turns):
        for impl, fn in fns.items():
            r = sample(lambda fn=fn: fn(sets), a.seconds, fields)
            print(f"  turn {turn} {impl:5s} {r['ms_per_call'] / a.count:8.3f} ms/op  "
                  f"SM clock median {r['clock_med']:6.0f} min {r['clock_min']:6.0f} MHz  power {r['power_med']:5.0f} W  "
                  f"temp max {r['temp_max']:3.0f} C  "
                  f"reasons {r['reasons']}  ({r['samples']} samples)", flush=True)


if __name__ == "__main__":
    main()
