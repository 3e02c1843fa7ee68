"""Command-buffer replays of the small path across processes (issue 25): one jitted program holding
small-path ops, replayed --replays times (default 1,000; --quick 20), every replay checked.

Run under the launcher, e.g. `python -m pk_jax.launch -n 2 --share-gpu tests/multirank/check_small_replay.py --out rows.json`,
or `--cpu` (the jax.lax fallbacks over gloo: values only). XLA_FLAGS are set before jax starts (as
tests/gpu/small_replay.py) so fusions and custom calls are recorded into command buffers (CUDA graphs)
from the first command on. Per mesh axis (as check_ops.py) and dtype, the program on a member's x of
shape (8, 250):

  a = all_reduce(x, small_one_shot)            (8, 250)
  b = all_gather(a * 0.5, tiled, small)        (8 G, 250)   the multiply is a fusion between two calls
  c = reduce_scatter(b, tiled, small)          (8, 250)
  d = all_reduce(c, small_two_shot)            (8, 250)     (small_one_shot where x's words do not split over G)
  e = all_reduce(d, small_chunked)             (8, 250)     plain stores + chunk flags
  f = all_reduce(d, small_pipelined)           (8, 250)     the same, pipelined: f == e
  h = all_reduce(d, small_ll128)               (8, 250)     128-byte LL lines: h == e

Replay i runs on input i mod 4. The inputs are random integers in [-4, 4], so every partial sum of every
op is exact in each dtype at G <= 8 (|a| <= 4 G; every block of b is a / 2, c = G a / 2, d = G^2 a / 2:
e = f = h = G^3 a / 2: at most 8 significant bits): each replay's seven outputs must equal the NumPy float32 reference exactly,
whatever order or precision a sum takes (the kernels' float32 rank order, or the jax.lax fallback's
dtype on CPU), and so must equal the first replay of the same input bit for bit (a replay that read a
stale LL line would differ). On GPU the compiled HLO must hold the seven pk_collective custom calls with
the small variants; whether it holds a command-buffer computation is recorded (`command_buffer_in_hlo`:
XLA can also convert thunks to command buffers, which the HLO does not show).
"""

from __future__ import annotations

import os
from collections.abc import Callable

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                           " --xla_gpu_graph_min_graph_size=1").strip()

import harness  # noqa: E402,I001 - puts the checkout on sys.path first
import small_cases  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax import _small_path  # noqa: E402

LOCAL = (8, 250)
OUTPUT_NAMES = ("a", "b", "c", "d", "e", "f", "h")  # the program's outputs in call order (module docstring)
INPUTS = 4
MAX_BAD = 20  # replays reported before giving up on a program


def add_args(p) -> None:
    p.add_argument("--replays", type=int, default=None, help="replays per program (default 1000; --quick 20)")


def program(g: int, itemsize: int) -> tuple[list[tuple[str, int]], Callable[[str, jax.Array], tuple]]:
    """([(op, variant it must lower to)] in call order; step(axis, x) -> (a, b, c, d, e, f, h))."""
    two_shot = _small_path.words(LOCAL[0] * LOCAL[1] * itemsize) % g == 0
    last = "small_two_shot" if two_shot else "small_one_shot"
    small = _small_path.VARIANT_SMALL
    want = [("all_reduce", small), ("all_gather", small), ("reduce_scatter", small),
            ("all_reduce", _small_path.VARIANT_SMALL_TWO_SHOT if two_shot else small),
            ("all_reduce", _small_path.VARIANT_SMALL_CHUNKED), ("all_reduce", _small_path.VARIANT_SMALL_PIPELINED),
            ("all_reduce", _small_path.VARIANT_SMALL_LL128)]

    def step(axis: str, x: jax.Array) -> tuple[jax.Array, ...]:
        a = pk_jax.all_reduce(x, axis, algorithm="small_one_shot")
        b = pk_jax.all_gather(a * 0.5, axis, tiled=True, algorithm="small")
        c = pk_jax.reduce_scatter(b, axis, tiled=True, algorithm="small")
        d = pk_jax.all_reduce(c, axis, algorithm=last)
        return (a, b, c, d, pk_jax.all_reduce(d, axis, algorithm="small_chunked"),
                pk_jax.all_reduce(d, axis, algorithm="small_pipelined"), pk_jax.all_reduce(d, axis, algorithm="small_ll128"))
    return want, step


def integer_inputs(seed: int, axis: str, members: int, dtype: str) -> list[np.ndarray]:
    """INPUTS stacked inputs (members, *LOCAL) of random integers in [-4, 4], identical on every rank."""
    rng = np.random.default_rng([seed, harness.hash_str(f"small_replay/{axis}")])
    return [rng.integers(-4, 5, (members, *LOCAL)).astype(harness.DTYPES[dtype]) for _ in range(INPUTS)]


def reference(blocks: list[np.ndarray], pos: int) -> list[np.ndarray]:
    """A member's (a, b, c, d, e, f, h) from the group's inputs in rank order, float32 (exact: see above)."""
    g = len(blocks)
    a = sum(np.asarray(b, np.float32) for b in blocks)
    b = np.concatenate([a * 0.5] * g, 0)
    cs = [g * np.split(b, g, 0)[p] for p in range(g)]  # every member holds the same b: G x its block
    d = sum(cs)
    return [a, b, cs[pos], d, g * d, g * d, g * d]


def local_outputs(outs) -> list[np.ndarray]:
    """This process's shards of every output, in a fixed order (for the bit-for-bit comparison)."""
    return [np.asarray(s.data) for o in outs for s in sorted(o.addressable_shards, key=lambda s: s.index[0].start or 0)]


def check(mesh: Mesh, axis: str, dtype: str, replays: int, seed: int, on_gpu: bool,
          rank: int) -> tuple[bool, float, dict]:
    """One program over `axis`, replayed: (ok, max_err, extra) of its row."""
    g = mesh.shape[axis]
    members = mesh.devices.size
    want, step = program(g, np.dtype(harness.DTYPES[dtype]).itemsize)
    inputs = integer_inputs(seed, axis, members, dtype)
    prog = harness.members_program(mesh, lambda x: step(axis, x), 1)
    args = [harness.stacked_array(mesh, a) for a in inputs]
    traced = prog.trace(args[0])
    compiled = traced.lower().compile()
    hlo = compiled.as_text() if on_gpu else None
    problems = [p for p in small_cases.variant_problems(want, small_cases.jaxpr_variants(traced.jaxpr.jaxpr), hlo) if p]
    refs: dict[tuple[int, int], list[np.ndarray]] = {}

    def ref_of(k: int) -> Callable[[int], list[np.ndarray]]:
        def ref(member: int) -> list[np.ndarray]:
            if (k, member) not in refs:
                group = harness.group_of(mesh, axis, member)
                refs[k, member] = reference([inputs[k][m] for m in group], group.index(member))
            return refs[k, member]
        return ref

    first: dict[int, list[np.ndarray]] = {}
    worst, bad, first_bad, ran = 0.0, 0, None, 0
    for i in range(replays):
        ran = i + 1
        k = i % INPUTS
        outs = jax.block_until_ready(compiled(args[k]))
        ok, err = harness.compare(outs, ref_of(k), "exact", dtype)
        bits = local_outputs(outs)
        earlier = first.setdefault(k, bits)
        stable = all(np.array_equal(u.view(np.uint8), v.view(np.uint8)) for u, v in zip(bits, earlier))
        worst = max(worst, err)
        if not (ok and stable):
            bad += 1
            first_bad = i if first_bad is None else first_bad
            # Which outputs moved (bytes that differ from the first replay of this input): the op that failed is
            # among the first of them in call order (b..d take a's output in turn; e, f and h all take d).
            # local_outputs is output-major: this process's shards of output 0, then of output 1, ...
            per_output = max(len(bits) // len(OUTPUT_NAMES), 1)
            moved = [f"{OUTPUT_NAMES[j // per_output]}: {int((u.view(np.uint8) != v.view(np.uint8)).sum())} B"
                     for j, (u, v) in enumerate(zip(bits, earlier)) if not np.array_equal(u.view(np.uint8), v.view(np.uint8))]
            print(f"rank {rank}: replay {i} {axis} {dtype}: max_err {err:.3g} (exact wanted), same bits as "
                  f"replay {k}: {stable}; bytes that differ from it: {', '.join(moved) or 'none'}", flush=True)
            if bad >= MAX_BAD:
                break
        if i % 100 == 99:
            pk_jax.runtime.check()
    pk_jax.runtime.check()
    extra = {"replays": replays, "replays_run": ran, "bad_replays": bad, "inputs": INPUTS,
             "command_buffer_in_hlo": None if hlo is None else "command_buffer" in hlo}
    if first_bad is not None:
        extra["first_bad"] = first_bad
    if problems:
        extra["error"] = "; ".join(problems)[:400]
    return bad == 0 and not problems, worst, extra


def main() -> int:
    args = harness.parse_args(__doc__, add_args)
    replays = args.replays or (20 if args.quick else 1000)
    job = harness.start_job()
    rows = harness.Rows(job, "check_small_replay")
    for mesh, axis in harness.meshes(job):
        g = mesh.shape[axis]
        where = harness.where(mesh, axis)
        for dtype in args.dtypes:
            rows.run_group([("small_replay", f"{replays}x{where}", LOCAL, dtype, g)],
                           lambda mesh=mesh, axis=axis, dtype=dtype: [check(mesh, axis, dtype, replays, args.seed,
                                                                           job.on_gpu, job.rank)])
    return rows.finish(args.out)


if __name__ == "__main__":
    harness.exit_now(main())
