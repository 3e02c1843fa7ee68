"""Plain-jit users across processes: a two-layer MLP written with NamedShardings and
with_sharding_constraint only (no shard_map) compiles to our fused `pk_tp_gemm` calls through
`pk_jax.sharding.matmul`, forward and gradients, and matches a float32 NumPy reference on every
addressable shard. No XLA collective may remain: with ranks sharing a GPU, NCCL would refuse it.

Run under the launcher, e.g. `python -m pk_jax.launch -n 2 --share-gpu tests/multirank/check_jit.py`,
or `--cpu` (the jax.lax fallbacks over gloo: values only, no custom calls to count).
"""

from __future__ import annotations

import os

os.environ["PK_JAX_AUTOTUNE"] = "0"  # the partitioner takes the untimed default schedule

import harness  # noqa: E402,I001 - puts the checkout on sys.path first
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import pk_jax.sharding as pks  # noqa: E402

D, F, TOKENS_PER_MEMBER = 512, 2048, 512
FWD_TOL, GRAD_TOL = 2e-2, 6e-2  # max abs error / max |reference|; bf16 intermediates


def gelu(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """jax.nn.gelu (tanh form) and its derivative, float32."""
    c = np.float32(np.sqrt(2 / np.pi))
    t = np.tanh(c * (a + 0.044715 * a ** 3))
    return 0.5 * a * (1 + t), 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * c * (1 + 3 * 0.044715 * a * a)


def reference(x, w1, w2):
    """y = gelu(x w1) w2 and the gradients of sum(y^2) by x, w1, w2, in float32."""
    x, w1, w2 = (np.asarray(a, np.float32) for a in (x, w1, w2))
    a = x @ w1
    h, dh_da = gelu(a)
    y = h @ w2
    dy = 2 * y
    da = (dy @ w2.T) * dh_da
    return y, (da @ w1.T, x.T @ da, h.T @ dy)


def rel(got: jax.Array, want: np.ndarray) -> float:
    scale = float(np.max(np.abs(want)))
    return max(float(np.max(np.abs(np.asarray(s.data, np.float32) - want[s.index]))) for s in got.addressable_shards) / scale


def check(mesh: Mesh, grads: bool) -> tuple[bool, float, str]:
    tokens = TOKENS_PER_MEMBER * mesh.devices.size
    rng = np.random.default_rng([mesh.shape["data"], mesh.shape["tp"], int(grads)])
    bf16 = lambda shape, scale: (rng.standard_normal(shape, dtype=np.float32) * scale).astype(jnp.bfloat16)
    x, w1, w2 = bf16((tokens, D), 1.0), bf16((D, F), D ** -0.5), bf16((F, D), F ** -0.5)
    x_spec = NamedSharding(mesh, P(("data", "tp"), None))  # sequence parallel (and data parallel)
    h_spec = NamedSharding(mesh, P("data", "tp"))          # column-parallel hidden
    specs = (x_spec, NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P("tp", None)))
    args = [jax.make_array_from_callback(a.shape, s, lambda i, a=a: a[i]) for a, s in zip((x, w1, w2), specs)]

    def mlp(x, w1, w2):
        h = jax.lax.with_sharding_constraint(pks.matmul(x, w1), h_spec)
        return jax.lax.with_sharding_constraint(pks.matmul(jax.nn.gelu(h), w2), x_spec)

    loss = lambda *a: jnp.sum(mlp(*a).astype(jnp.float32) ** 2)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)) if grads else mlp, in_shardings=specs)
    pks.decisions.clear()
    compiled = fn.lower(*args).compile().as_text()
    calls = compiled.count('"pk_tp_gemm"')
    lax_left = harness.xla_collectives(compiled)
    out = fn(*args)
    y, g = reference(x, w1, w2)
    err = max(rel(o, r) for o, r in zip(out, g)) if grads else rel(out, y)
    on_gpu = jax.devices()[0].platform == "gpu"
    want_calls = 4 if grads else 2
    problems = []
    if on_gpu and calls < want_calls:
        problems.append(f"{calls} pk_tp_gemm calls (want >= {want_calls})")
    if on_gpu and lax_left:
        problems.append(f"XLA collectives left: {lax_left}")
    names = sorted({d.name for _, d in pks.decisions})
    ok = not problems and err < (GRAD_TOL if grads else FWD_TOL)
    return ok, err, f"pk_tp_gemm calls {calls}, lowerings {names}" + (f"; {'; '.join(problems)}" if problems else "")


def main() -> int:
    args = harness.parse_args(__doc__)
    job = harness.start_job()
    rows = harness.Rows(job, "check_jit")
    n = len(jax.devices())
    shapes = [(1, n)] + ([(2, n // 2)] if n >= 4 and n % 2 == 0 else [])
    for data, tp in shapes:
        mesh = Mesh(np.array(jax.devices()).reshape(data, tp), ("data", "tp"), axis_types=(AxisType.Auto,) * 2)
        for grads in (False, True):
            if grads and data > 1:
                continue  # the gradients' rule cases are the 1 x n ones; 2 x n/2 checks the data axis forward

            def run(mesh=mesh, grads=grads) -> tuple[bool, float]:
                ok, err, detail = check(mesh, grads)
                print(f"rank {job.rank}: {'grads' if grads else 'fwd'} {data}x{tp}: {detail}, err {err:.2e}", flush=True)
                return ok, err
            rows.run("jit_mlp", f"{'fwd_bwd' if grads else 'fwd'}@{data}x{tp}", (TOKENS_PER_MEMBER * n, D, F),
                     "bfloat16", tp, run)
    return rows.finish(args.out)


if __name__ == "__main__":
    harness.exit_now(main())
