"""Device 0's kernels of one attention call, ours (pk_jax.attention, implementation="pk") and cuDNN's
(jax.nn.dot_product_attention), each traced with jax.profiler, then summed per kernel name: where a fwd+bwd row's
time goes beyond the two main kernels (the backward's pre- and post-kernels, XLA's glue).

    python3 scripts/attention_timeline.py --batch 4 --seq 16384 --heads 16 --head-dim 128 --causal --grads

Inputs (B, S, N, D) bf16, fresh normal values (--count sets, one call each in one program, as the bench rotates
them); --grads times jax.vjp's forward and the gradients from a random cotangent, as `pk_jax.bench attention`'s
fwd_bwd rows do. Prints each side's events of at least --min-us in time order, then per kernel name: count and total
microseconds."""

from __future__ import annotations

import argparse
import collections

import jax

import pk_jax
from pk_jax.bench import attention as bench_attention
from timeline import print_timeline, trace_events


def program(impl: str, causal: bool, grads: bool):
    """A jitted [(q, k, v, d_out), ...] -> [outputs, ...] for `impl` ("pk" or "cudnn"): one call per input set, as
    `pk_jax.bench attention` times them (its _runner and _with_grads)."""
    if impl == "pk":
        fn = lambda q, k, v: pk_jax.attention(q, k, v, causal=causal, implementation="pk")
    else:
        fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    one = bench_attention._with_grads(fn) if grads else (lambda q, k, v, d_out: fn(q, k, v))
    return jax.jit(lambda sets: [one(*t) for t in sets])


def input_sets(shape: tuple[int, int, int, int], count: int) -> list[tuple[jax.Array, ...]]:
    """`count` fresh (q, k, v, d_out) sets of normal bf16 values, as the bench makes them."""
    b, s, n, d = shape
    return bench_attention._inputs(b, s, n, n, d, count, seed=0, grads=True)


def per_kernel(evs: list[tuple[str, str, float, float]]) -> list[tuple[str, int, float]]:
    """(name, count, total us) per event name, longest total first."""
    tot: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for _, name, _, dur in evs:
        tot[name][0] += 1
        tot[name][1] += dur
    return sorted(((n, int(c), t) for n, (c, t) in tot.items()), key=lambda r: -r[2])


def add_program_arguments(ap: argparse.ArgumentParser) -> None:
    """The shape (B, S, N, D), mask, gradients and input sets of the programs (shared with attention_power.py)."""
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--grads", action="store_true")
    ap.add_argument("--count", type=int, default=1, help="input sets (calls) per program, as the bench rotates them")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_program_arguments(ap)
    ap.add_argument("--min-us", type=float, default=5.0)
    a = ap.parse_args()
    shape = (a.batch, a.seq, a.heads, a.head_dim)
    sets = input_sets(shape, a.count)
    for impl in ("pk", "cudnn"):
        fn = program(impl, a.causal, a.grads)
        evs = trace_events(lambda: jax.block_until_ready(fn(sets)))
        label = f"{impl} {list(shape)} causal={a.causal} grads={a.grads} count={a.count}"
        print_timeline(label, evs, a.min_us)
        print(f"-- {label}: per kernel")
        for name, count, total in per_kernel(evs):
            print(f"  {total:10.1f} us  x{count:<3d} {name[:110]}")


if __name__ == "__main__":
    main()
