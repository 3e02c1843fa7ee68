"""The asynchronous ring shift and ring attention across processes (issue 26; ranks sharing one GPU under MPS
is the mode that runs on one GPU): `python -m pk_jax.launch -n 2 --ranks-per-gpu 2 tests/multirank/check_ring.py`.

Per mesh axis (harness.meshes):
  ring_shift       two buffers (f32, bf16) one member on: exact, against the stacked inputs rolled in the group
  shift+collective a shift in flight while pk_jax.all_reduce runs on XLA's stream (separate protocol channels)
  ring_attention   forward and gradients (causal, contiguous layout; bf16 D 64: our attention kernels), against a
                   float32 whole-sequence reference computed on the host CPU
On GPU a compiled program holding an XLA collective fails the row (NCCL refuses ranks that share a GPU): the
ring's transport must be the shift kernel.
"""

from __future__ import annotations

import harness  # noqa: I001 - puts the checkout on sys.path first
import jax
import jax.numpy as jnp
import numpy as np

import pk_jax
from pk_jax.context.ring_shift import after_token, shift_done, shift_start


def no_xla_collectives(mesh, fn, inputs, on_gpu: bool) -> None:
    if not on_gpu:
        return
    hlo = harness.members_program(mesh, fn, len(inputs)).lower(
        *[harness.stacked_array(mesh, a) for a in inputs]).compile().as_text()
    if left := harness.xla_collectives(hlo):
        raise AssertionError(f"XLA collectives in the compiled program: {left}")


def pred_ref(mesh, axis, inputs):
    def ref(m: int):
        group = harness.group_of(mesh, axis, m)
        p = group[(harness.position(mesh, axis, m) - 1) % len(group)]
        return [a[p] for a in inputs]
    return ref


def check_shift(mesh, axis, seed, on_gpu):
    inputs = harness.random_inputs(seed, f"shift@{axis}", [(mesh.size, 64, 96)], "float32")
    inputs.append(harness.random_inputs(seed, f"shift2@{axis}", [(mesh.size, 1000)], "bfloat16")[0])

    def fn(a, b):
        ys, token = shift_start((a, b), (axis,))
        return shift_done(ys, token, keep_alive=(a, b))

    no_xla_collectives(mesh, fn, inputs, on_gpu)
    outs = harness.run_members(mesh, fn, inputs)(*inputs)
    return harness.compare(outs, pred_ref(mesh, axis, inputs), "exact", "float32")


def check_shift_with_collective(mesh, axis, seed, on_gpu):
    inputs = harness.random_inputs(seed, f"shiftar@{axis}", [(mesh.size, 512, 256), (mesh.size, 32, 128)], "float32")

    def fn(a, z):
        ys, token = shift_start((a,), (axis,))
        r = pk_jax.all_reduce(after_token(z, token), axis, algorithm="one_shot")
        (y,) = shift_done(ys, token, keep_alive=a, after=r)
        return y, r

    def ref(m: int):
        group = harness.group_of(mesh, axis, m)
        return [pred_ref(mesh, axis, inputs[:1])(m)[0], sum(inputs[1][i] for i in group)]

    no_xla_collectives(mesh, fn, inputs, on_gpu)
    outs = harness.run_members(mesh, fn, inputs)(*inputs)
    return harness.compare(outs, ref, "reduce", "float32")


def check_ring_attention(mesh, axis, seed, on_gpu):
    t, n, d = 96, 4, 64
    shapes = [(mesh.size, 1, t, n, d)] * 4
    q, k, v, dout = harness.random_inputs(seed, f"ring@{axis}", shapes, "bfloat16")

    def fn(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: pk_jax.ring_attention(q, k, v, axis, causal=True, layout="contiguous"),
                           q, k, v)
        return (out, *vjp(dout))

    def ref(m: int):
        group = harness.group_of(mesh, axis, m)
        pos = harness.position(mesh, axis, m)
        whole = lambda x: jnp.asarray(np.concatenate([x[i] for i in group], axis=1), jnp.float32)
        cpu = jax.local_devices(backend="cpu")[0]
        with jax.default_device(cpu):
            f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
            out, vjp = jax.vjp(f, whole(q), whole(k), whole(v))
            grads = vjp(whole(dout))
            sl = lambda x: np.asarray(x)[:, pos * t:(pos + 1) * t]
            return [sl(out), *(sl(x) for x in grads)]

    no_xla_collectives(mesh, fn, [q, k, v, dout], on_gpu)
    outs = harness.run_members(mesh, fn, [q, k, v, dout])(q, k, v, dout)
    ok, err = harness.compare(outs, ref, "reduce", "bfloat16")
    scale = max(float(np.abs(np.asarray(r, np.float32)).max()) for r in ref(0))
    return err <= 3e-2 * max(scale, 1.0), err  # attention: bf16 blocks and merges, not one rounding


def main() -> int:
    args = harness.parse_args(__doc__)
    job = harness.start_job()
    rows = harness.Rows(job, "check_ring")
    for mesh, axis in harness.meshes(job):
        g = mesh.shape[axis]
        where = f"@{axis}"
        rows.run("ring_shift", f"two_buffers{where}", [mesh.size, 64, 96], "float32", g,
                 lambda: check_shift(mesh, axis, args.seed, job.on_gpu))
        rows.run("ring_shift", f"with_all_reduce{where}", [mesh.size, 512, 256], "float32", g,
                 lambda: check_shift_with_collective(mesh, axis, args.seed, job.on_gpu))
        rows.run("ring_attention", f"fwd_bwd_causal{where}", [1, g * 96, 4, 64], "bfloat16", g,
                 lambda: check_ring_attention(mesh, axis, args.seed, job.on_gpu))
    return rows.finish(args.out)


if __name__ == "__main__":
    harness.exit_now(main())
