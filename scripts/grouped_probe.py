"""Where the grouped GEMM's forward loses to a dense GEMM of the same FLOPs (issue 27's 0.9x target).

At one (m, k, n) it times, in the same turns: jnp.dot (m, k) x (k, n); our kernel with one group (the dense
problem through the grouped path); E groups of exactly m / E rows (no partial row tile: only the weight traffic
differs from one group); E groups with multinomial counts (uniform routing: partial last tiles too); and E groups
with counts rounded to 64-row multiples (a partial tile never has more than one 64-row slice to compute).

    python3 scripts/grouped_probe.py [--rows 32768 --k 7168 --n 2048 --experts 64] [--variants pair] [--once NAME]

--variants: kernel schedule variants (PK_JAX_GROUPED_VARIANT, set while each contender traces) timed beside the
default for one group and E groups with multinomial counts (--variant-kinds: other group-size kinds too).

--modes dgrad wgrad: also the backward's two GEMMs at E groups with multinomial counts (and each variant), each
beside jnp.dot of the same shapes: the input grad dy (m, n) x w^T (n, k) and the weight grad x^T (k, m) x dy (m, n)
(per group: E outputs of (k, n), against one for the dense GEMM).

--once NAME runs that contender twice (compile, then once more) and exits: for Nsight Compute."""

from __future__ import annotations

import argparse
import importlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax.bench.timing import time_interleaved

gm = importlib.import_module("pk_jax.moe.grouped_matmul")


def counts(kind: str, rows: int, e: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "even":
        c = np.full(e, rows // e)
    elif kind == "uniform":
        c = rng.multinomial(rows, np.full(e, 1.0 / e))
    elif kind == "round64":  # each count cut down to a multiple of 64 (fewer rows: FLOPs counted per row)
        c = rng.multinomial(rows, np.full(e, 1.0 / e)) // 64 * 64
    elif kind == "shift64":  # even, but every group after the first starts 64 rows off the 128-row grid
        c = np.full(e, rows // e)
        c[0] -= 64
        c[-1] += 64
    elif kind == "half448":  # every group 3.5 row tiles (a half tile each; odd groups start off the grid)
        c = np.full(e, 448)
    else:
        raise ValueError(kind)
    return c.astype(np.int32)


def add_backward_mode(contenders: dict, variant_of: dict, mode: str, e: int, w, w1, gs, rows: int, m: int,
                      variants: list[str]) -> None:
    """The backward GEMM `mode` ("dgrad" or "wgrad") at E groups `gs` (ours on `rows` rows, per variant) and its
    dense contender (m rows). Their inputs come from the rotated x (m, k): dy is x's first n columns (m, n)."""
    n = w.shape[2]
    dense = f"jnp.dot {mode}"
    if mode == "dgrad":  # dx = dy w^T: (m, n) x (n, k)
        f_dense = jax.jit(lambda xs, w: [jnp.dot(x[:, :n], w[0].T) for x in xs])
        contenders.setdefault(dense, (lambda xs: f_dense(xs, w1), m, dense))

        def ours_jit():  # its own jit per contender: the variant is fixed when it traces
            f = jax.jit(lambda xs, w, gs: [gm._input_grad(x[:, :n], w, gs, x.dtype, gm.TILE_ROWS, True, gm._variant())
                                           for x in xs])
            return lambda xs: f(xs, w, gs)
    else:  # dw[e] = x_e^T dy_e: (k, m_e) x (m_e, n)
        f_dense = jax.jit(lambda xs: [jnp.dot(x.T, x[:, :n]) for x in xs])
        contenders.setdefault(dense, (f_dense, m, dense))

        def ours_jit():
            f = jax.jit(lambda xs, gs: [gm._weight_grad(x, x[:, :n], gs, w.dtype, gm.TILE_ROWS, True, gm._variant())
                                        for x in xs])
            return lambda xs: f(xs, gs)
    contenders[f"ours {mode} E{e} uniform"] = (ours_jit(), rows, dense)
    for v in variants:
        name = f"ours {mode} E{e} uniform [{v}]"
        contenders[name] = (ours_jit(), rows, dense)
        variant_of[name] = v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--experts", type=int, nargs="*", default=[64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--once", default=None)
    ap.add_argument("--variants", nargs="*", default=[])
    ap.add_argument("--modes", nargs="*", default=[], choices=["dgrad", "wgrad"])
    ap.add_argument("--variant-kinds", nargs="*", default=["uniform"], help="group-size kinds timed per variant")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    m, k, n = a.rows, a.k, a.n
    xs = [jax.random.normal(jax.random.key(i), (m, k), jnp.float32).astype(jnp.bfloat16) for i in range(4)]
    w1 = jax.random.normal(jax.random.key(9), (1, k, n), jnp.float32).astype(jnp.bfloat16) * 0.02
    # Operands are arguments, never closed over: a captured (E, k, n) array becomes an HLO constant (a 1.9 GB
    # literal took a minute to compile).
    dense_jit = jax.jit(lambda xs, w: [jnp.dot(x, w[0]) for x in xs])
    grouped_jit = jax.jit(lambda xs, w, gs: [gm.grouped_matmul(x, w, gs) for x in xs])

    def grouped(w, gs):
        return lambda xs: grouped_jit(xs, w, gs)

    def grouped_variant(w, gs):  # its own jit: the variant is fixed when it traces
        f = jax.jit(lambda xs, w, gs: [gm.grouped_matmul(x, w, gs) for x in xs])
        return lambda xs: f(xs, w, gs)

    # name -> (fn, rows in use, the dense contender it is compared with)
    contenders = {"jnp.dot": (lambda xs: dense_jit(xs, w1), m, "jnp.dot")}
    variant_of = {}  # contender -> PK_JAX_GROUPED_VARIANT while it traces
    one = jnp.array([m], jnp.int32)
    contenders["ours E1"] = (grouped(w1, one), m, "jnp.dot")
    for e in a.experts:
        w = jax.random.normal(jax.random.key(e), (e, k, n), jnp.float32).astype(jnp.bfloat16) * 0.02
        for kind in ("even", "uniform", "round64", "shift64", "half448"):
            c = counts(kind, m, e, rng)
            gs = jnp.asarray(c)
            contenders[f"ours E{e} {kind}"] = (grouped(w, gs), int(c.sum()), "jnp.dot")
            if kind in a.variant_kinds:
                for v in a.variants:
                    name = f"ours E{e} {kind} [{v}]"
                    contenders[name] = (grouped_variant(w, gs), int(c.sum()), "jnp.dot")
                    variant_of[name] = v
            if kind == "uniform":
                for mode in a.modes:
                    add_backward_mode(contenders, variant_of, mode, e, w, w1, gs, int(c.sum()), m, a.variants)
    for v in a.variants:
        contenders[f"ours E1 [{v}]"] = (grouped_variant(w1, one), m, "jnp.dot")
        variant_of[f"ours E1 [{v}]"] = v

    def first_call(name, inputs):  # traces under the contender's variant
        os.environ[gm.VARIANT_ENV] = variant_of.get(name, "")
        try:
            return jax.block_until_ready(contenders[name][0](inputs))
        finally:
            os.environ.pop(gm.VARIANT_ENV, None)

    if a.once:
        f = contenders[a.once][0]
        first_call(a.once, xs[:1])
        print(f"== {a.once}", flush=True)
        jax.block_until_ready(f(xs[:1]))
        return
    names = list(contenders)
    for nm in names:  # compile and first run, timed apart (the timing below is warm)
        t0 = time.perf_counter()
        first_call(nm, xs)
        print(f"# {nm}: first call {time.perf_counter() - t0:.1f} s", flush=True)
    ms = time_interleaved([contenders[nm][0] for nm in names], xs, reps=a.reps, min_sample_ms=20.0)
    ms_of = dict(zip(names, ms))
    print(f"m {m} k {k} n {n} (bf16), ms per op, TFLOP/s on the rows in use, vs its dense contender per row")
    for nm, t in zip(names, ms):
        rows, base_name = contenders[nm][1], contenders[nm][2]
        base = ms_of[base_name] / contenders[base_name][1]  # the dense contender's ms per row
        tf = 2.0 * rows * k * n / (t * 1e-3) / 1e12
        print(f"{nm:32s} {t:8.3f} ms  rows {rows:6d}  {tf:6.1f} TFLOP/s  {base * rows / t:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
