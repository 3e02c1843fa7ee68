"""Shared helpers of the multi-rank scripts (check_ops.py, soak.py, faults.py): job start-up, meshes,
per-member inputs and NumPy references, tolerance checks, and gathering every rank's rows on rank 0.

Layout used by every check: each input is a "stacked" global array of shape (members, *local) whose
leading axis is sharded over all mesh axes, so member d (row-major over the mesh) holds block d. Every
rank regenerates the same stacked inputs from a seed and checks only its addressable output shards
against a NumPy float32 reference: no XLA collective runs across ranks (they fail when ranks share a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # scripts run as files: make the checkout's pk_jax importable
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax import _kv  # noqa: E402  (the one wrapper of jax's distributed key-value store)
from pk_jax.launch import initialize_from_env  # noqa: E402

KV_TIMEOUT_S = 300.0

# Tolerances, elementwise |got - ref| <= tol * (1 + |ref|) against a float32 reference of the rounded
# inputs. Gathers and all_to_all move bits: exact. Our reductions sum in float32 and round once (half an
# ulp); store-add and the jax.lax fallback on CPU sum in the output dtype, one rounding per member (up to
# 4 here): about 3 ulps (bf16 ulp 2^-7, f16 2^-10). GEMMs add the accumulation order; float32 GEMMs run as
# jnp.dot does at default precision, TF32 on Hopper (10-bit mantissa: 1.0-1.3e-3 measured at K = 512).
TOLERANCES = {
    "exact": {"float32": 0.0, "bfloat16": 0.0, "float16": 0.0},
    "reduce": {"float32": 1e-5, "bfloat16": 2.4e-2, "float16": 4e-3},
    "gemm": {"float32": 4e-3, "bfloat16": 3e-2, "float16": 4e-3},
}
DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}


def parse_args(doc: str, add: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="rank 0 writes the merged rows (JSON list) here")
    p.add_argument("--seed", type=int, default=0, help="inputs and call order (identical on every rank)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--quick", action="store_true", help="a small subset (CPU CI)")
    if add:
        add(p)
    return p.parse_args()


@dataclasses.dataclass(frozen=True)
class Job:
    rank: int
    ranks: int
    on_gpu: bool
    ranks_per_gpu: int
    startup_s: float  # wall time of pk_jax.initialize() in this process
    info: object      # pk_jax.DistributedInfo


def start_job() -> Job:
    """Joins the job and runs pk_jax.initialize() (timed)."""
    initialize_from_env()
    t0 = time.perf_counter()
    info = pk_jax.initialize()
    startup = time.perf_counter() - t0
    on_gpu = jax.devices()[0].platform == "gpu"
    return Job(jax.process_index(), jax.process_count(), on_gpu, info.ranks_per_gpu, startup, info)


def meshes(job: Job) -> list[tuple[Mesh, str]]:
    """(mesh, axis the ops run over): a 1-D ("x",) mesh over every device; with 4 devices or more
    (an even count) also a 2 x (n/2) ("dp", "tp") mesh, once over each axis."""
    devs = np.array(jax.devices())
    out = [(Mesh(devs, ("x",)), "x")]
    if devs.size >= 4 and devs.size % 2 == 0:
        grid = Mesh(devs.reshape(2, devs.size // 2), ("dp", "tp"))
        out += [(grid, "dp"), (grid, "tp")]
    return out


def where(mesh: Mesh, axis: str) -> str:
    """A case's mesh label: "@x" on a 1-D mesh, "@tp(dp2xtp2)" on a 2-D one."""
    name = "x".join(f"{n}{s}" for n, s in mesh.shape.items())
    return f"@{axis}" + (f"({name})" if len(mesh.shape) > 1 else "")


def group_of(mesh: Mesh, axis: str, member: int) -> list[int]:
    """Stacked indices of `member`'s group over `axis`, in the axis's order (rank order)."""
    shape = tuple(mesh.devices.shape)
    coords = np.unravel_index(member, shape)
    a = mesh.axis_names.index(axis)
    out = []
    for i in range(shape[a]):
        c = list(coords)
        c[a] = i
        out.append(int(np.ravel_multi_index(tuple(c), shape)))
    return out


def position(mesh: Mesh, axis: str, member: int) -> int:
    return int(np.unravel_index(member, tuple(mesh.devices.shape))[mesh.axis_names.index(axis)])


def random_inputs(seed: int, case: str, shapes: Sequence[tuple[int, ...]], dtype: str,
                  scales: Sequence[float] | None = None) -> list[np.ndarray]:
    """Stacked inputs, identical on every rank: a fresh stream per (seed, case)."""
    rng = np.random.default_rng([seed, abs(hash_str(case))])
    scales = scales or [1.0] * len(shapes)
    return [(rng.standard_normal(s, dtype=np.float32) * sc).astype(DTYPES[dtype]) for s, sc in zip(shapes, scales)]


def hash_str(s: str) -> int:
    """A hash that is the same in every process (Python's hash() of str is salted per process)."""
    h = 1469598103934665603
    for ch in s.encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 61)
    return h


def stacked_array(mesh: Mesh, a: np.ndarray) -> jax.Array:
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def members_program(mesh: Mesh, fn: Callable, n_inputs: int) -> Callable:
    """The jitted shard_map (check_vma on) that applies fn(*local blocks) -> tuple of local outputs on
    every member: stacked global arrays in and out (lower() it to inspect the program)."""
    spec = P(tuple(mesh.axis_names))

    def body(*blocks):
        return tuple(o[None] for o in fn(*[b[0] for b in blocks]))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n_inputs, out_specs=spec, check_vma=True))


def run_members(mesh: Mesh, fn: Callable, inputs: Sequence[np.ndarray]) -> Callable[..., tuple]:
    """members_program as a function of stacked numpy inputs giving stacked global outputs."""
    f = members_program(mesh, fn, len(inputs))
    return lambda *arrays: f(*[stacked_array(mesh, a) for a in arrays])


XLA_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
                   "collective-permute")


def xla_collectives(compiled_hlo: str) -> list[str]:
    """XLA collectives left in a compiled program's text: none may run when ranks share a GPU (NCCL refuses
    the duplicate GPU), so on GPU a check fails on any. On CPU pk_jax ops lower to them (the fallbacks)."""
    return [op for op in XLA_COLLECTIVES if f" {op}(" in compiled_hlo or f" {op}-start(" in compiled_hlo]


def compare(outs: Sequence[jax.Array], ref_fn: Callable[[int], Sequence[np.ndarray]], kind: str,
            dtype: str) -> tuple[bool, float]:
    """(ok, max_err) over this process's addressable members. ref_fn(member) gives that member's
    float32 reference outputs; err = max |got - ref| / (1 + |ref|)."""
    tol = TOLERANCES[kind][dtype]
    err, members = 0.0, {}
    for i, out in enumerate(outs):
        for shard in out.addressable_shards:
            m = shard.index[0].start or 0
            if m not in members:
                members[m] = ref_fn(m)
            got = np.asarray(shard.data, np.float32)[0]
            ref = np.asarray(members[m][i], np.float32)
            if got.shape != ref.shape:
                return False, float("inf")
            if got.size:
                e = float(np.max(np.abs(got - ref) / (1.0 + np.abs(ref))))
                err = max(err, e if np.isfinite(e) else float("inf"))
    return err <= tol, err


@dataclasses.dataclass
class Rows:
    """This rank's results; rank 0 merges every rank's (through the KV store) and prints PASS/FAIL."""

    job: Job
    name: str  # the script's name: keeps the KV keys of different scripts in one job apart
    rows: list[dict] = dataclasses.field(default_factory=list)
    stopped: str = ""  # why the remaining cases are not run (the GPU runtime stopped)

    def add(self, op: str, case: str, shape: Sequence[int], dtype: str, group: int, ok: bool, max_err: float,
            **extra) -> None:
        self.rows.append({"op": op, "case": case, "shape": [int(s) for s in shape], "dtype": dtype, "group": group,
                          "extra": {"ok": bool(ok), "max_err": max_err, **extra}})
        if not ok:  # seen at once in the log, before the merge
            print(f"rank {self.job.rank}: local failure {op} {case} {dtype} max_err={max_err:.3g} "
                  f"{extra.get('error', '')}", flush=True)

    def run(self, op: str, case: str, shape: Sequence[int], dtype: str, group: int,
            check: Callable[[], tuple[bool, float]]) -> None:
        """Runs one check; an exception is a failed row naming it (and the runtime's own error). Once
        the GPU runtime has stopped (a peer failed), later cases are failed without running: each
        would only wait PK_JAX_TIMEOUT_MS for peers that stopped too."""
        self.run_group([(op, case, shape, dtype, group)], lambda: [check()])

    def run_group(self, labels: Sequence[tuple[str, str, Sequence[int], str, int]],
                  check: Callable[[], Sequence[tuple]]) -> None:
        """Like run, for one program checked as several rows: labels are (op, case, shape, dtype, group)
        and check() returns one (ok, max_err) or (ok, max_err, extra dict) per label; an exception
        fails every row of the program."""
        if self.stopped:
            for label in labels:
                self.add(*label, False, float("inf"), error=f"not run: {self.stopped}")
            return
        try:
            results = list(check())
        except Exception as e:  # noqa: BLE001 - a failed case must not end the suite
            msg = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc(limit=3)
            for label in labels:
                self.add(*label, False, float("inf"), error=msg)
            if "runtime is stopped" in str(e):
                op, case, _, dtype, _ = labels[0]
                self.stopped = f"the pk_jax runtime stopped at {op} {case} {dtype}"
            return
        for label, (ok, err, *extra) in zip(labels, results, strict=True):
            self.add(*label, ok, err, **(extra[0] if extra else {}))

    def finish(self, out: str | None) -> int:
        """Merges all ranks' rows on rank 0 (ok = all ok, max_err = max), prints one PASS/FAIL line per
        case, writes `out`, and returns the exit code (0 when every case passed everywhere)."""
        key = f"multirank/{self.name}/rows"
        _kv.put(f"{key}/{self.job.rank}", json.dumps({"rows": self.rows, "startup_s": self.job.startup_s}))
        local_ok = all(r["extra"]["ok"] for r in self.rows)
        if self.job.rank != 0:
            return 0 if local_ok else 1
        sent = [json.loads(_kv.get(f"{key}/{r}", KV_TIMEOUT_S)) for r in range(self.job.ranks)]
        startup = max(s["startup_s"] for s in sent)  # pk_jax.initialize() ends when the last rank's does
        merged = merge_rows([s["rows"] for s in sent], self.job.ranks_per_gpu, startup)
        for r in merged:
            e = r["extra"]
            print(f"{'PASS' if e['ok'] else 'FAIL'} {r['op']} {r['case']} {r['dtype']} shape={r['shape']} "
                  f"group={r['group']} max_err={_num(e['max_err'])}{' ' + e['error'] if 'error' in e else ''}", flush=True)
        failed = sum(not r["extra"]["ok"] for r in merged)
        print(f"{self.name}: {len(merged) - failed}/{len(merged)} cases passed at {self.job.ranks} ranks "
              f"(ranks_per_gpu={self.job.ranks_per_gpu}, on {'GPU' if self.job.on_gpu else 'CPU'})", flush=True)
        if out:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out, "w") as f:
                json.dump(merged, f, indent=1)
        return 1 if failed else 0


def _num(x: float | None) -> str:
    return "none" if x is None else f"{x:.3g}"


def merge_rows(per_rank: Sequence[Sequence[dict]], ranks_per_gpu: int, startup_s: float) -> list[dict]:
    """One row per case (op, case, dtype, group) in first-seen order: ok when it passed on every rank
    (a rank that lacks it, having stopped early, fails it), max_err the largest."""
    key = lambda r: (r["op"], r["case"], r["dtype"], r["group"])
    order: dict[tuple, list[dict]] = {}
    for rows in per_rank:
        for r in rows:
            order.setdefault(key(r), []).append(r)
    merged = []
    for mine in order.values():
        row = mine[0]
        ok = len(mine) == len(per_rank) and all(r["extra"]["ok"] for r in mine)
        err = max(r["extra"]["max_err"] for r in mine)
        extra = {**row["extra"], "ok": ok, "max_err": err if np.isfinite(err) else None,  # None: no result (strict JSON)
                 "ranks_per_gpu": ranks_per_gpu, "startup_s": round(startup_s, 3)}
        errors = [r["extra"]["error"] for r in mine if "error" in r["extra"]]
        if errors:
            extra["error"] = errors[0]
        elif len(mine) < len(per_rank):
            extra["error"] = f"ran on {len(mine)} of {len(per_rank)} ranks"
        merged.append({**{k: row[k] for k in ("op", "case", "shape", "dtype", "group")}, "extra": extra})
    return merged


def exit_now(code: int, ranks: Sequence[int] | None = None) -> None:
    """Ends this process without jax.distributed's shutdown barrier (a peer may be dead, and peers'
    memory may still be mapped here). Rank 0 hosts the coordination service, whose end aborts every
    process still connected, so it leaves last: the others of `ranks` (default: all) say goodbye
    through the KV store and exit at once; rank 0 waits for them and a moment more."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _kv.available():
        rank = jax.process_index()
        ranks = list(range(jax.process_count())) if ranks is None else list(ranks)
        if rank != 0:
            _kv.put(f"multirank/exit/{rank}", "1")
        else:
            for r in ranks:
                if r != 0:
                    try:
                        _kv.get(f"multirank/exit/{r}", 60)
                    except TimeoutError as e:
                        print(f"rank 0: {e}", flush=True)
            time.sleep(1.0)
    os._exit(code)


def case_runner(mesh: Mesh, axis: str, case) -> Callable[[int], tuple[bool, float]]:
    """A function of a seed that runs `case` (cases.Case) over `axis` of `mesh` on fresh stacked inputs
    and checks this process's members (compiled once, on the first call)."""
    shapes = [(mesh.devices.size, *s) for s in case.local_shapes]
    fn = lambda *blocks: case.fn(axis, *blocks)
    compiled: list = []

    def run(seed: int) -> tuple[bool, float]:
        inputs = random_inputs(seed, f"{case.name}/{axis}", shapes, case.dtype, case.scales)
        if not compiled:
            compiled.append(run_members(mesh, fn, inputs))
        outs = jax.block_until_ready(compiled[0](*inputs))
        pk_jax.runtime.check()  # a peer that failed or never arrived (GPU) is an error here, not a hang

        def ref(member: int) -> list[np.ndarray]:
            members = group_of(mesh, axis, member)
            return case.ref([[a[i] for i in members] for a in inputs], members.index(member))
        return compare(outs, ref, case.kind, case.dtype)
    return run
