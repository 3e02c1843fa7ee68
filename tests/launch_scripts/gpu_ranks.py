"""A rank of the launcher's GPU check (run by the lead on a GPU machine; not collected by pytest):

    python -m pk_jax.launch --share-gpu -n 2 --timeout 300 tests/launch_scripts/gpu_ranks.py   # 2 ranks, GPU 0, MPS
    python -m pk_jax.launch -n 2 --timeout 300 tests/launch_scripts/gpu_ranks.py               # one rank per GPU

jax.distributed from the launcher's environment, pk_jax.initialize(), then each collective and a fused op
across the ranks against NumPy (jax.lax cannot run across ranks sharing a GPU). Prints `PASS <op>` /
`FAIL <op>` per check and `ALL PASS rank r` at the end; exits 1 on any failure.

XLA's memory must be shared with the peers (CUDA IPC, or POSIX fd for XLA's virtual-memory allocator),
and then no op may copy an ordinary jitted buffer through the staging heap
(pk_jax.runtime.stats()["staged_buffers"] == 0). PK_JAX_EXPECT_SHARING=posix_fd|cuda_ipc demands that
method; PK_JAX_EXPECT_SHARING=staging accepts unshared memory (e.g. with PK_JAX_FD_SHARING=0)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import pk_jax
from pk_jax.launch import initialize_from_env

initialize_from_env(initialization_timeout=120)
rank, ranks = jax.process_index(), jax.process_count()
info = pk_jax.initialize()
print(f"info {info}", flush=True)
print(f"env CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
      f"MPS%={os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE')} "
      f"mem={os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION')}", flush=True)
failures = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        failures.append(name)


check("init", info.ranks == ranks and info.rank == rank and info.kernels
      and info.ranks_per_gpu == int(os.environ["PK_JAX_RANKS_PER_GPU"]), str(info))
expect_sharing = os.environ.get("PK_JAX_EXPECT_SHARING", "")
print(f"sharing rank {rank}: {info.sharing or 'none (staging)'}", flush=True)
want = {"": ("cuda_ipc", "posix_fd"), "staging": ("",)}.get(expect_sharing, (expect_sharing,))
check("xla memory sharing", info.sharing in want and info.staging == (info.sharing == ""),
      f"sharing={info.sharing!r} staging={info.staging} (expected {' or '.join(w or 'staging' for w in want)})")
staged_at_start = pk_jax.runtime.stats()["staged_buffers"]
mesh = jax.make_mesh((ranks,), ("x",))
rng = np.random.default_rng(0)  # same inputs on every rank


def global_array(a: np.ndarray, spec: P) -> jax.Array:
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])


def run(f, ins, in_specs, out_spec):
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_spec))
    return g(*[global_array(a, s) for a, s in zip(ins, in_specs)])


def compare(name: str, out: jax.Array, ref: np.ndarray, tol: float) -> None:
    err = max(float(np.max(np.abs(np.asarray(s.data, np.float32) - ref[s.index]), initial=0.0))
              for s in out.addressable_shards)
    check(name, err <= tol, f"max_err={err:.3g}")


try:
    x = rng.standard_normal((ranks * 256, 512)).astype(np.float32)
    # Every rank's result stacked along axis 0 (out_specs P("x")): x once per rank.
    compare("all_gather f32", run(lambda a: pk_jax.all_gather(a, "x", axis=0, tiled=True), [x], [P("x")], P("x")),
            np.tile(x, (ranks, 1)), 0)
    xs = rng.standard_normal((ranks, 1024, 256)).astype(np.float32)  # rank r's input is xs[r]
    compare("all_reduce f32", run(lambda a: pk_jax.all_reduce(a[0], "x")[None], [xs], [P("x")], P("x")),
            np.broadcast_to(xs.sum(0), xs.shape), 1e-3)
    compare("reduce_scatter f32",
            run(lambda a: pk_jax.reduce_scatter(a[0], "x", scatter_dimension=0, tiled=True), [xs], [P("x")], P("x")),
            xs.sum(0), 1e-3)
    # all_to_all: rank r's block j of rows goes to rank j, which lays the blocks out along axis 1 by source.
    xa = rng.standard_normal((ranks, ranks * 64, 128)).astype(np.float32)
    want = np.stack([np.concatenate([xa[s, r * 64:(r + 1) * 64] for s in range(ranks)], axis=1) for r in range(ranks)])
    compare("all_to_all f32", run(lambda a: pk_jax.all_to_all(a[0], "x", 0, 1, tiled=True)[None], [xa], [P("x")],
                                  P("x")), want, 0)
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)  # noqa: E731
    xr = rng.standard_normal((256, ranks * 128)).astype(np.float32)
    wr = (rng.standard_normal((ranks * 128, 384)) / 16).astype(np.float32)
    compare("matmul_reduce_scatter bf16",
            run(lambda a, b: pk_jax.matmul_reduce_scatter(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), "x",
                                                          deterministic=True),
                [xr, wr], [P(None, "x"), P("x")], P("x")), bf(xr) @ bf(wr), 0.05)
    pk_jax.runtime.check()
    staged = pk_jax.runtime.stats()["staged_buffers"] - staged_at_start
    if not info.staging:  # every jitted buffer lies in XLA's shared region: nothing may be staged
        check("no staging copies", staged == 0, f"staged_buffers={staged}")
    else:
        print(f"staged_buffers {staged} (XLA's memory is not shared)", flush=True)
except Exception as e:  # noqa: BLE001 - report and fail this rank; the launcher stops the others
    check("no exception", False, f"{type(e).__name__}: {str(e)[:400]}")
if not failures:
    print(f"ALL PASS rank {rank}", flush=True)
sys.stdout.flush()
os._exit(1 if failures else 0)  # peers may still map our memory: skip jax's teardown
