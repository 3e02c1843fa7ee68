"""check_moe.py's moe_mlp rows: the expert-parallel SwiGLU layer's output and its five gradients (x, topk_weights,
w_gate, w_up, w_down) across processes, against the single-device float32 reference of tests/moe_model.py
(moe_mlp_reference, run on this process's own device: no collective), on this process's shards."""

from __future__ import annotations

import dataclasses
import os

import harness  # noqa: I001 - puts the checkout on sys.path first
import moe_routing  # noqa: E402  (also puts tests/ on sys.path)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import moe_model  # noqa: E402
import pk_jax  # noqa: E402
from moe_routing import Routing  # noqa: E402

# Relative to the largest |reference| of each output, as tests/gpu/test_moe_gpu.py (matmuls at "highest").
TOL = {"float32": 1e-3, "bfloat16": 4e-2}
GRADS = ("dx", "dweights", "dw_gate", "dw_up", "dw_down")


@dataclasses.dataclass(frozen=True)
class Sizes:
    tokens: int  # T per member
    hidden: int
    ffn: int
    scale: float  # expert weights are standard normal / scale


FULL, QUICK = Sizes(64, 128, 256, 16.0), Sizes(8, 16, 24, 4.0)


@dataclasses.dataclass(frozen=True)
class MlpCase:
    routing: Routing  # recv_rows unused (moe_mlp's default: the worst case, nothing drops there)
    dtype: str
    dp: int           # 1: ("ep",) over every device; 2: (dp=2, ep=n/2), experts replicated over dp
    sizes: Sizes
    overlap: bool = False  # PK_JAX_MOE_OVERLAP=1: dispatch + the gate/up GEMMs as one kernel (pk_jax/moe/overlap.py)

    def mesh(self) -> Mesh:
        devs = np.array(jax.devices())
        if self.dp == 1:
            return Mesh(devs, ("ep",))
        return Mesh(devs.reshape(self.dp, devs.size // self.dp), ("dp", "ep"))

    def label(self, mesh: Mesh, suffix: str) -> str:
        return (f"{self.routing.name}_{suffix}" + (f"@dp{self.dp}xep{mesh.shape['ep']}" if self.dp > 1 else "")
                + ("@overlap" if self.overlap else ""))


def cases(quick: bool, dtypes: list[str]) -> list[MlpCase]:
    """Routings with and without capacity drops on the 1-D mesh (the first dtype; one routing in the others);
    with an even device count also the (dp=2, ep) mesh, whose weight gradients are summed over dp by
    pk_jax.all_reduce. quick: the capacity case on the 1-D mesh and the dp case."""
    sz = QUICK if quick else FULL
    skewed, cap = Routing("skewed", 4, 2), Routing("skewed", 4, 2, capacity=sz.tokens // 4)  # 3 hot experts overflow
    one_d = [cap] if quick else [skewed, Routing("uniform", 4, 1), Routing("idle_member", 2, 2),
                                 Routing("repeats", 4, 3), cap]
    out = [MlpCase(r, dtypes[0], 1, sz) for r in one_d] + [MlpCase(skewed, d, 1, sz) for d in dtypes[1:]]
    if len(jax.devices()) % 2 == 0:
        out += [MlpCase(r, dtypes[0], 2, sz) for r in ([skewed] if quick else [skewed, cap])]
    return out


def overlap_case(quick: bool) -> MlpCase:
    """The fused dispatch + first grouped GEMM (GPU runs: its kernel across processes), bfloat16 (the kernel's)."""
    return MlpCase(Routing("skewed", 4, 2), "bfloat16", 1, QUICK if quick else FULL, overlap=True)


def problem(case: MlpCase, mesh: Mesh, seed: int) -> tuple[dict, np.ndarray]:
    """Global inputs in the case's dtype (ids (N, K), x (N, H), weights (N, K), w_gate / w_up (E, H, F),
    w_down (E, F, H), cot (N, H); N = members * T) and arrived (N, K), the choices capacity keeps."""
    sz, r = case.sizes, case.routing
    ep, members = mesh.shape["ep"], mesh.devices.size
    e = r.local * ep
    rng = np.random.default_rng([seed, harness.hash_str(case.label(mesh, case.dtype))])
    # Each ep group routes its own tokens over the same E experts: ep rows of (dp * T) tokens, any order.
    ids = moe_model.random_routing(rng, ep, members // ep * sz.tokens, r.top_k, e, r.kind).reshape(-1, r.top_k)
    cast = lambda a: a.astype(harness.DTYPES[case.dtype])
    x, cot = (cast(rng.standard_normal((members * sz.tokens, sz.hidden), dtype=np.float32)) for _ in range(2))
    weights = cast(rng.uniform(0.1, 1.0, (members * sz.tokens, r.top_k)).astype(np.float32))
    w_gate, w_up = (cast(rng.standard_normal((e, sz.hidden, sz.ffn), dtype=np.float32) / sz.scale) for _ in range(2))
    w_down = cast(rng.standard_normal((e, sz.ffn, sz.hidden), dtype=np.float32) / sz.scale)
    per_member = ids.reshape(members, sz.tokens, r.top_k)
    arrived = np.concatenate([moe_model.capacity_keep(m, r.capacity) for m in per_member])
    return dict(ids=ids, x=x, weights=weights, w_gate=w_gate, w_up=w_up, w_down=w_down, cot=cot), arrived


PARAMS = ("x", "weights", "w_gate", "w_up", "w_down")


def reference(inputs: dict, arrived: np.ndarray) -> dict:
    """float32 out and gradients on this process's device; dropped choices get weight 0 (they add nothing and
    pass no gradient), and d topk_weights of a dropped choice is 0 (moe_mlp sees no expert output for it)."""
    f32 = {k: np.asarray(inputs[k], np.float32) for k in PARAMS + ("cot",)}
    mask = arrived.astype(np.float32)

    @jax.jit
    def ref(x, weights, a, b, c, cot):
        fn = lambda x, w, a, b, c: moe_model.moe_mlp_reference(x, inputs["ids"], w * mask, a, b, c)
        out, vjp = jax.vjp(fn, x, weights, a, b, c)
        return (out, *vjp(cot))

    with jax.default_device(jax.local_devices()[0]), jax.default_matmul_precision("highest"):
        got = [np.asarray(o) for o in ref(*(f32[k] for k in PARAMS), f32["cot"])]
    return dict(zip(("out",) + GRADS, got))


def run(case: MlpCase, mesh: Mesh, inputs: dict, on_gpu: bool) -> dict:
    """moe_mlp and its VJP against `cot` as one jitted program over global arrays: the outputs by name."""
    tok, exp = P(tuple(mesh.axis_names)), P("ep")
    specs = dict(ids=tok, x=tok, weights=tok, cot=tok, w_gate=exp, w_up=exp, w_down=exp)
    cap = case.routing.capacity
    layer = jax.shard_map(lambda ids, x, wt, a, b, c: pk_jax.moe.moe_mlp(x, ids, wt, a, b, c, "ep", capacity=cap),
                          mesh=mesh, in_specs=(tok, tok, tok, exp, exp, exp), out_specs=tok, check_vma=True)

    def program(ids, cot, *params):
        out, vjp = jax.vjp(lambda *p: layer(ids, *p), *params)
        return (out, *vjp(cot))

    put = lambda k: jax.make_array_from_callback(inputs[k].shape, NamedSharding(mesh, specs[k]),
                                                 lambda i: inputs[k][i])
    args = [put(k) for k in ("ids", "cot") + PARAMS]
    old = os.environ.get("PK_JAX_MOE_OVERLAP")
    os.environ["PK_JAX_MOE_OVERLAP"] = "1" if case.overlap else "0"  # read when moe_mlp is traced
    try:
        with jax.default_matmul_precision("highest"):
            compiled = jax.jit(program).lower(*args).compile()
    finally:
        if old is None:
            os.environ.pop("PK_JAX_MOE_OVERLAP")
        else:
            os.environ["PK_JAX_MOE_OVERLAP"] = old
    if on_gpu and case.overlap and "pk_moe_dispatch_matmul" not in compiled.as_text():
        raise AssertionError("PK_JAX_MOE_OVERLAP=1 but the program has no pk_moe_dispatch_matmul call")
    if on_gpu and (lax := harness.xla_collectives(compiled.as_text())):
        raise AssertionError(f"XLA collectives in the program: {lax}")
    outs = jax.block_until_ready(compiled(*args))
    pk_jax.runtime.check()  # a peer that failed or never arrived (GPU) is an error here, not a hang
    return dict(zip(("out",) + GRADS, outs))


def rel_error(got: jax.Array, want: np.ndarray) -> float:
    """Largest |got - want| over this process's shards, relative to the largest |want| (the whole array)."""
    scale = max(float(np.max(np.abs(want))), 1e-30)
    return max(float(np.max(np.abs(np.asarray(s.data, np.float32) - want[s.index]))) for s in got.addressable_shards) / scale


def add_rows(rows: harness.Rows, case: MlpCase, seed: int, on_gpu: bool) -> None:
    """`<routing>_fwd` (the output) and `<routing>_fwd_bwd` (the output and the five gradients), both from one
    program (a forward-only one would compute the same output: one compile less per case)."""
    mesh = case.mesh()
    r, sz = case.routing, case.sizes

    def errors() -> dict:
        inputs, arrived = problem(case, mesh, seed)
        if r.capacity is not None and arrived.all():
            raise AssertionError(f"{r.name}: the case must drop some choices (capacity keeps all)")
        got, want = run(case, mesh, inputs, on_gpu), reference(inputs, arrived)
        return {k: rel_error(got[k], want[k]) for k in got}

    result = moe_routing.once(errors)
    for suffix, names in (("fwd", ("out",)), ("fwd_bwd", ("out",) + GRADS)):
        def check(names=names) -> tuple[bool, float]:
            err = max(result()[k] for k in names)
            return err < TOL[case.dtype], err
        rows.run("moe_mlp", case.label(mesh, suffix), (sz.tokens, sz.hidden, r.local * mesh.shape["ep"], r.top_k),
                 case.dtype, mesh.shape["ep"], check)
