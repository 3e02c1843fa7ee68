"""A long chain of dependent small all_reduces across processes, every call's result exact (issue 25): the stress
test of a protocol whose data carries its own flags (LL / LL128 lines), where a line read half old, half new
would pass its flag check and corrupt the sum.

Run under the launcher, e.g. `python -m pk_jax.launch -n 4 --ranks-per-gpu 4 tests/multirank/check_small_chain.py
--out rows.json` (ranks sharing one GPU under MPS), or `--cpu` (the jax.lax fallback: values only). Per mesh axis
(as check_ops.py), dtype, size (--sizes, bytes of x per member) and algorithm (--algorithms), one jitted program
holds --chain dependent all_reduces: v = all_reduce(x) (x random integers in [-4, 4]) gives every member S, the
group's sum, and step i > 0, v <- all_reduce(v + k) - G k - (G - 1) v with k = i mod 3, gives S again, exactly in
every dtype (|G (S + k)| <= G (4 G + 2) <= 272, a multiple of G: representable in bfloat16). The payload S + k
differs from the one two ops back (same parity, same area), so a line whose flag is new and whose payload is that
older op's (a torn line) changes the sum; the shift stays: the output after --calls calls of the program (each on
one of 4 inputs in turn) must equal S bit for bit.
"""

from __future__ import annotations

import harness  # noqa: I001 - puts the checkout on sys.path first
import jax  # noqa: E402
import numpy as np  # noqa: E402

import pk_jax  # noqa: E402

INPUTS = 4
SIZES = (4096, 65536, 262144, 1 << 20)  # bytes of x per member
ALGORITHMS = ("small_ll128", "small_one_shot")


def add_args(p) -> None:
    p.add_argument("--chain", type=int, default=64, help="dependent all_reduces per program")
    p.add_argument("--calls", type=int, default=None, help="calls per program (default 50; --quick 3)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="bytes of x per member")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))


def check(mesh, axis: str, dtype: str, nbytes: int, algorithm: str, chain: int, calls: int,
          seed: int) -> tuple[bool, float, dict]:
    g = mesh.shape[axis]
    members = mesh.devices.size
    n = nbytes // np.dtype(harness.DTYPES[dtype]).itemsize
    rng = np.random.default_rng([seed, harness.hash_str(f"small_chain/{axis}/{dtype}/{nbytes}")])
    inputs = [rng.integers(-4, 5, (members, n)).astype(harness.DTYPES[dtype]) for _ in range(INPUTS)]

    def step(x: jax.Array) -> tuple[jax.Array]:
        v = pk_jax.all_reduce(x, axis, algorithm=algorithm)  # S on every member
        for i in range(1, chain):
            k = i % 3  # the payload S + k differs from the one two ops back, which its area held
            v = pk_jax.all_reduce(v + k, axis, algorithm=algorithm) - g * k - (g - 1) * v  # G (S + k) - G k - (G - 1) S
        return (v,)

    prog = harness.members_program(mesh, step, 1)
    args = [harness.stacked_array(mesh, a) for a in inputs]
    refs: dict[tuple[int, int], list[np.ndarray]] = {}

    def ref_of(k: int):
        def ref(member: int) -> list[np.ndarray]:
            if (k, member) not in refs:
                group = harness.group_of(mesh, axis, member)
                refs[k, member] = [sum(np.asarray(inputs[k][m], np.float32) for m in group)]
            return refs[k, member]
        return ref

    worst, bad = 0.0, 0
    for i in range(calls):
        k = i % INPUTS
        ok, err = harness.compare(jax.block_until_ready(prog(args[k])), ref_of(k), "exact", dtype)
        worst, bad = max(worst, err), bad + (not ok)
    pk_jax.runtime.check()
    return bad == 0, worst, {"calls": calls, "chain": chain, "bad_calls": bad, "algorithm": algorithm}


def main() -> int:
    args = harness.parse_args(__doc__, add_args)
    calls = args.calls or (3 if args.quick else 50)
    job = harness.start_job()
    rows = harness.Rows(job, "check_small_chain")
    for mesh, axis in harness.meshes(job):
        g = mesh.shape[axis]
        where = harness.where(mesh, axis)
        for algorithm in args.algorithms:
            for dtype in args.dtypes:
                for nbytes in args.sizes:
                    n = nbytes // np.dtype(harness.DTYPES[dtype]).itemsize
                    rows.run("all_reduce_chain", f"{algorithm}/{nbytes}B{where}", [n], dtype, g,
                             lambda mesh=mesh, axis=axis, dtype=dtype, nbytes=nbytes, algorithm=algorithm: check(
                                 mesh, axis, dtype, nbytes, algorithm, args.chain, calls, args.seed))
    return rows.finish(args.out)


if __name__ == "__main__":
    harness.exit_now(main())
