"""The fused ops' backward across processes: for each fused TP GEMM (w as stored and transposed), the
compiled training step (y and jax.vjp's dx, dw of a jitted shard_map, check_vma on) holds no float32
GEMM and calls our fused kernels in the Megatron pairing (hlo_checks.FUSED_VJP; on GPU), and y, dx, dw
equal a float32 NumPy reference of the whole (global) product on every addressable shard.

Run under the launcher, e.g. `python -m pk_jax.launch -n 2 --share-gpu tests/multirank/check_training.py`
(GPU ranks sharing one GPU are the issue's test mode) or `--cpu` (the jax.lax fallbacks over gloo: only
the gradients and the StableHLO's GEMM dtypes are checked there). Autotuning is off with an empty cache,
so the schedule is the fused starting point and the kernel kinds are known.
"""

from __future__ import annotations

import os
import tempfile

os.environ["PK_JAX_AUTOTUNE"] = "0"
os.environ["PK_JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="pk_jax_tune_")

import harness  # noqa: E402,I001 - puts the checkout on sys.path first
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax.bench import hlo_checks  # noqa: E402

M, K, N = 256, 512, 384  # per member: x (M, K) rows / w (K, N) columns (AG), as the GPU training test
REL_TOL = 1e-2           # bf16 operands and outputs, float32 accumulation


def problem(op: str, transpose_w: bool, g: int):
    """(fn, specs, out spec, global x, w as stored, product of the global arrays)."""
    rng = np.random.default_rng([g, len(op), int(transpose_w)])
    bf16 = lambda shape, scale=1.0: (rng.standard_normal(shape, dtype=np.float32) * scale).astype(jnp.bfloat16)
    stored = lambda rows, cols: (cols, rows) if transpose_w else (rows, cols)
    w_cols = P("x") if transpose_w else P(None, "x")
    w_rows = P(None, "x") if transpose_w else P("x")
    if op == "all_gather_matmul":
        x, w = bf16((g * M, K)), bf16(stored(K, g * N), K ** -0.5)
        fn = lambda a, b: pk_jax.all_gather_matmul(a, b, "x", transpose_w=transpose_w)
        return fn, (P("x"), w_cols), P(None, "x"), x, w
    rows = 128 * g  # RS/AR: the kernels need 128-row multiples of output rows per member
    x, w = bf16((rows, g * K)), bf16(stored(g * K, N), (g * K) ** -0.5)
    if op == "matmul_reduce_scatter":
        fn = lambda a, b: pk_jax.matmul_reduce_scatter(a, b, "x", transpose_w=transpose_w)
        return fn, (P(None, "x"), w_rows), P("x"), x, w
    fn = lambda a, b: pk_jax.matmul_all_reduce(a, b, "x", transpose_w=transpose_w)
    return fn, (P(None, "x"), w_rows), P(), x, w


def shard_errors(got: jax.Array, ref: np.ndarray) -> float:
    """Largest relative (Frobenius) error over this process's shards of `got` against `ref`'s slices."""
    worst = 0.0
    for s in got.addressable_shards:
        a, b = np.asarray(s.data, np.float32), ref[s.index]
        worst = max(worst, float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
    return worst


def check(mesh: Mesh, op: str, transpose_w: bool, on_gpu: bool) -> tuple[bool, float, str]:
    g = mesh.shape["x"]
    fn, specs, out_spec, x, w = problem(op, transpose_w, g)
    f = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=True)
    put = lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])
    xf, wf = np.asarray(x, np.float32), np.asarray(w, np.float32)
    weight = wf.T if transpose_w else wf
    rng = np.random.default_rng(7)
    ct = rng.standard_normal((xf.shape[0], weight.shape[1]), dtype=np.float32).astype(jnp.bfloat16)

    def step(a, b, c):  # a training step uses y (the loss) and the gradients: the forward stays live
        y, vjp = jax.vjp(f, a, b)
        return y, *vjp(c)

    step = jax.jit(step)
    args = (put(x, specs[0]), put(w, specs[1]), put(ct, out_spec))
    lowered = step.lower(*args)
    if on_gpu:
        problems = hlo_checks.fused_vjp_problems(lowered.compile().as_text(), op)
    else:  # the lax fallback: XLA's CPU passes may widen bf16 dots, so check what we emit
        bad = hlo_checks.float32_gemms(hlo_checks.gemms(lowered.as_text()), results_too=False)
        problems = ["float32 GEMMs:\n" + hlo_checks.describe(bad)] if bad else []
    y, dx, dw = step(*args)
    pk_jax.runtime.check()
    ctf = np.asarray(ct, np.float32)
    ref_dx = ctf @ weight.T
    ref_dweight = xf.T @ ctf
    ref_dw = ref_dweight.T if transpose_w else ref_dweight
    err = max(shard_errors(y, xf @ weight), shard_errors(dx, ref_dx), shard_errors(dw, ref_dw))
    return not problems and err < REL_TOL, err, "; ".join(problems)[:400]


def main() -> int:
    args = harness.parse_args(__doc__)
    job = harness.start_job()
    rows = harness.Rows(job, "check_training")
    mesh = Mesh(np.array(jax.devices()), ("x",))
    g = mesh.shape["x"]
    for op in hlo_checks.FUSED_VJP:
        for transpose_w in (False, True):
            def run(op=op, transpose_w=transpose_w) -> tuple[bool, float]:
                ok, err, why = check(mesh, op, transpose_w, job.on_gpu)
                if why:
                    print(f"rank {job.rank}: {op} transpose_w={transpose_w}: {why}", flush=True)
                return ok, err
            shape = (g * M, K, g * N) if op == "all_gather_matmul" else (128 * g, g * K, N)
            rows.run(f"{op}_vjp", f"transpose_w={transpose_w}", shape, "bfloat16", g, run)
    return rows.finish(args.out)


if __name__ == "__main__":
    harness.exit_now(main())
