"""A quick multi-process check of the runtime: N ranks share GPU 0 under MPS (or one per GPU with
--per-gpu), run each collective and fused op once against NumPy, then a skipped op. Developer tool:
the full suite is `python -m pk_jax.bench multirank`.
Usage: python scripts/mp_smoke.py --spawn N [--per-gpu]"""

import os
import subprocess
import sys
import tempfile
import time


def spawn(n: int, per_gpu: bool) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PK_JAX_TIMEOUT_MS="3000")
    mps = None
    if not per_gpu:
        mps = tempfile.mkdtemp(prefix="pk-mps-")
        env.update(CUDA_MPS_PIPE_DIRECTORY=mps, CUDA_MPS_LOG_DIRECTORY=mps, CUDA_VISIBLE_DEVICES="0",
                   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(100 // n), XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.8 / n:.3f}")
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
    port = 23456 + os.getpid() % 1000
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(n), str(port)] + (["--per-gpu"] if per_gpu else []),
                              env=env) for r in range(n)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if mps:
            subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=env)
    print("exit codes", codes, flush=True)
    return max(abs(c) for c in codes)


def rank_main(rank: int, n: int, port: int, per_gpu: bool) -> None:
    import jax
    import numpy as np

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=rank,
                               local_device_ids=[rank] if per_gpu else None)
    import jax.numpy as jnp
    import pk_jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    info = pk_jax.initialize()
    print(f"[{rank}] {info}", flush=True)
    mesh = jax.make_mesh((n,), ("x",))
    rng = np.random.default_rng(0)

    def global_array(a: np.ndarray, spec):
        sh = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(a.shape, sh, lambda idx: a[idx])

    def check(name, out, ref, tol):
        err = 0.0
        for s in out.addressable_shards:
            got = np.asarray(s.data, np.float32)
            err = max(err, float(np.max(np.abs(got - ref[s.index]))) if got.size else 0.0)
        print(f"[{rank}] {'PASS' if err <= tol else 'FAIL'} {name} max_err={err:.3g}", flush=True)

    def run(f, ins, in_specs, out_spec):
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec))
        return g(*[global_array(a, s) for a, s in zip(ins, in_specs)])

    t0 = time.perf_counter()
    x = rng.standard_normal((n * 256, 512)).astype(np.float32)
    out = run(lambda a: pk_jax.all_gather(a, "x", axis=0, tiled=True), [x], [P("x")], P())
    check("all_gather f32", out, x, 0)
    xs = rng.standard_normal((n, 1024, 256)).astype(np.float32)  # per-rank inputs stacked
    out = run(lambda a: pk_jax.all_reduce(a[0], "x")[None], [xs], [P("x")], P("x"))
    check("all_reduce f32", out, np.broadcast_to(xs.sum(0), xs.shape), 1e-3)
    out = run(lambda a: pk_jax.reduce_scatter(a[0], "x", scatter_dimension=0, tiled=True), [xs], [P("x")], P("x"))
    check("reduce_scatter f32", out, xs.sum(0), 1e-3)
    xb = rng.standard_normal((n * 256, 512)).astype(np.float32)
    w = (rng.standard_normal((512, 384)) / 16).astype(np.float32)
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)
    ref = bf(xb) @ bf(w)
    out = run(lambda a, b: pk_jax.all_gather_matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), "x"),
              [xb, w], [P("x"), P()], P())
    check("all_gather_matmul bf16", out, ref, 0.05)
    wr = (rng.standard_normal((n * 128, 384)) / 16).astype(np.float32)
    xr = rng.standard_normal((256, n * 128)).astype(np.float32)
    for sched, det in (("pull", True), ("store_add", False)):
        out = run(lambda a, b: pk_jax.matmul_reduce_scatter(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), "x",
                                                            schedule=sched, deterministic=det),
                  [xr, wr], [P(None, "x"), P("x")], P("x"))
        check(f"matmul_reduce_scatter {sched}", out, bf(xr) @ bf(wr), 0.05)
        out = run(lambda a, b: pk_jax.matmul_all_reduce(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), "x",
                                                        schedule=sched, deterministic=det),
                  [xr, wr], [P(None, "x"), P("x")], P())
        check(f"matmul_all_reduce {sched}", out, bf(xr) @ bf(wr), 0.05)
    print(f"[{rank}] ops took {time.perf_counter() - t0:.1f} s, stats {pk_jax.runtime.stats()}", flush=True)

    # Fault: rank 1 skips an all_gather the others run, then runs an all_reduce.
    f_ag = jax.jit(jax.shard_map(lambda a: pk_jax.all_gather(a, "x", axis=0, tiled=True), mesh=mesh,
                                 in_specs=P("x"), out_specs=P()))
    f_ar = jax.jit(jax.shard_map(lambda a: pk_jax.all_reduce(a[0], "x")[None], mesh=mesh, in_specs=P("x"),
                                 out_specs=P("x")))
    gx, gxs = global_array(x, P("x")), global_array(xs, P("x"))
    jax.block_until_ready(f_ag(gx)), jax.block_until_ready(f_ar(gxs))  # compiled and run on all ranks
    t0 = time.perf_counter()
    try:
        if rank != 1:
            jax.block_until_ready(f_ag(gx))
        jax.block_until_ready(f_ar(gxs))
        pk_jax.runtime.check()
        print(f"[{rank}] FAIL fault: no error", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"[{rank}] FAULT-OK after {time.perf_counter() - t0:.1f} s: {str(e)[:300]}", flush=True)
    os._exit(0)  # peers may still be mapped; skip teardown


if __name__ == "__main__":
    if sys.argv[1] == "--spawn":
        sys.exit(spawn(int(sys.argv[2]), "--per-gpu" in sys.argv))
    rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), "--per-gpu" in sys.argv)
