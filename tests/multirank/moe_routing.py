"""check_moe.py's dispatch / combine rows: each routing case of tests/moe_model.py on every member of the job,
checked on this process's members against the NumPy model (tests/moe_checks.routing_expected)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import harness  # noqa: I001 - puts the checkout on sys.path first
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import pk_jax  # noqa: E402
from pk_jax.moe import fused  # noqa: E402
from pk_jax.moe.routing import routing_sizes  # noqa: E402

if str(harness.ROOT / "tests") not in sys.path:  # the MoE model and checks shared with tests/test_moe_cpu.py
    sys.path.insert(0, str(harness.ROOT / "tests"))
import moe_checks  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Routing:
    """One routing case: `kind` of moe_model.random_routing, L experts per member (E = L * G), top-k, and the
    drops: capacity C per (member, expert) and the recv_rows bound R (None: nothing drops)."""
    kind: str
    local: int
    top_k: int
    capacity: int | None = None
    recv_rows: int | None = None

    @property
    def name(self) -> str:
        return (f"{self.kind}_k{self.top_k}" + (f"_cap{self.capacity}" if self.capacity is not None else "")
                + (f"_recv{self.recv_rows}" if self.recv_rows is not None else ""))

    @property
    def drops(self) -> bool:
        return self.capacity is not None or self.recv_rows is not None


# Every kind of moe_model.random_routing; top-k 1, 2, 3, 4, 6, 8; drops by capacity and by the recv_rows bound
# (the skewed routing overflows both at T = 12 tokens per member).
ROUTINGS = (Routing("uniform", 4, 1), Routing("uniform", 4, 2), Routing("skewed", 4, 2),
            Routing("empty_expert", 8, 4), Routing("idle_member", 2, 2), Routing("repeats", 4, 3),
            Routing("uniform", 4, 8), Routing("skewed", 4, 2, capacity=2), Routing("skewed", 4, 2, recv_rows=10),
            # deduplicated rows: several choices per (token, member), some of them past the R bound (a token's
            # primary at a member is its first kept choice there, not always its first choice)
            Routing("repeats", 2, 6, recv_rows=40))
QUICK = ("idle_member_k2", "skewed_k2_cap2")  # CPU CI: each program costs seconds to compile
SMOKE = ("uniform_k2", "skewed_k2_cap2")  # --smoke: the first GPU run of a new build (no moe_mlp)
FUSED_CALLS = ("pk_moe_dispatch", "pk_moe_combine", "pk_moe_send")  # custom-call targets of the fused path

# Row checks: (op, case suffix, outputs of moe_checks.ROUTED_OUTPUTS, tolerance class of harness.TOLERANCES).
# Moves are exact; combine and the VJPs sum K float32 products against a float64 model: "reduce".
ROW_CHECKS = (("dispatch", "fwd", ("recv", "counts", "received"), "exact"),
              ("dispatch", "fwd_bwd", ("dx_dispatch",), "reduce"),
              ("combine", "fwd", ("out",), "reduce"),
              ("combine", "fwd_bwd", ("dx", "dweights"), "reduce"))


def routings(quick: bool, smoke: bool = False) -> list[Routing]:
    pick = SMOKE if smoke else QUICK if quick else None
    return [r for r in ROUTINGS if pick is None or r.name in pick]


def once(fn: Callable[[], object]) -> Callable[[], object]:
    """fn run on the first call only; later calls return its result or raise its exception again (the rows
    of one program share one run, and a failed run must not wait for peers once per row)."""
    memo: list = []

    def call():
        if not memo:
            try:
                memo.append((True, fn()))
            except Exception as e:  # noqa: BLE001 - re-raised to every row
                memo.append((False, e))
        ok, value = memo[0]
        if not ok:
            raise value
        return value
    return call


def run_routing(mesh: Mesh, r: Routing, seed: int, on_gpu: bool, impl: str = "auto",
                dedup: bool = True) -> tuple[list[jax.Array], dict]:
    """Runs moe_checks.routed_member on every member, traced with pk_jax.moe's path `impl` (auto: the fused
    kernels on GPUs): (stacked outputs in ROUTED_OUTPUTS order, the model's expectation). Raises if the
    program holds an XLA collective (GPU), if on GPU it does not (auto) or does (reference) hold the fused
    custom calls, or if a drop case drops nothing. dedup = False: the fused kernels before deduplication
    (fused.override_dedup)."""
    g = mesh.devices.size
    e = r.local * g
    sizes = routing_sizes(g, e, moe_checks.TOKENS, r.top_k, r.capacity, r.recv_rows)
    inputs = moe_checks.routing_inputs(g, e, r.top_k, r.kind, seed, sizes.recv_rows)
    want = moe_checks.routing_expected(inputs, e, r.capacity, sizes.recv_rows)
    if r.drops and want["arrived"].all():
        raise AssertionError(f"{r.name}: the case must drop some assignments (the model drops none)")
    f = harness.members_program(mesh, moe_checks.routed_member("ep", e, r.capacity, r.recv_rows), 5)
    args = [harness.stacked_array(mesh, inputs[k]) for k in ("ids", "x", "weights", "cot", "d_recv")]
    with fused.override(impl), fused.override_dedup(dedup):
        compiled = f.lower(*args).compile()
    text = compiled.as_text()
    if on_gpu and (lax := harness.xla_collectives(text)):
        raise AssertionError(f"XLA collectives in the program: {lax}")
    if on_gpu:
        present = [c for c in FUSED_CALLS if c in text]
        if impl == "reference" and present:
            raise AssertionError(f"the reference path's program holds fused custom calls {present}")
        if impl != "reference" and len(present) != len(FUSED_CALLS):
            raise AssertionError(f"the fused path's program lacks custom calls: has {present} of {FUSED_CALLS}")
    outs = jax.block_until_ready(compiled(*args))
    pk_jax.runtime.check()  # a peer that failed or never arrived (GPU) is an error here, not a hang
    return list(outs), want


def add_rows(rows: harness.Rows, r: Routing, seed: int, on_gpu: bool, impl: str = "auto", dedup: bool = True) -> None:
    """The four rows of ROW_CHECKS for routing `r` over all devices of the job (impl "reference": case suffix
    @reference; dedup = False, the fused kernels before deduplication: @nodedup)."""
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    g = mesh.devices.size
    result = once(lambda: run_routing(mesh, r, (seed * 7919 + harness.hash_str(r.name)) % (1 << 32), on_gpu, impl,
                                      dedup))
    suffix = "@reference" if impl == "reference" else "" if dedup else "@nodedup"
    names = moe_checks.ROUTED_OUTPUTS
    for op, case, outputs, kind in ROW_CHECKS:
        def check(outputs=outputs, kind=kind) -> tuple[bool, float]:
            outs, want = result()
            picked = [outs[names.index(o)] for o in outputs]
            return harness.compare(picked, lambda m: [want[o][m] for o in outputs], kind, "float32")
        rows.run(op, f"{r.name}_{case}{suffix}", (moe_checks.TOKENS, moe_checks.HIDDEN, r.local * g, r.top_k),
                 "float32", g, check)
