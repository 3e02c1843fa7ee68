"""Inspecting lowered programs: which GEMMs they hold (and in which dtypes) and which pk_jax custom calls.

Reads both StableHLO text (`jax.jit(f).lower(...).as_text()`, e.g. on CPU) and compiled HLO text
(`....compile().as_text()`, after XLA's GPU passes turned dots into cuBLAS custom calls or GEMM
fusions), so GPU tests and multi-rank scripts check a program the same way:

    gemms = hlo_checks.gemms(text)
    assert not hlo_checks.float32_gemms(gemms)
    kinds = hlo_checks.custom_call_kinds(text, "pk_tp_gemm")
"""

from __future__ import annotations

import re
from typing import NamedTuple

from jax.extend.core import jaxprs_in_params


class Gemm(NamedTuple):
    where: str                  # "dot_general" (StableHLO), "dot" (HLO, incl. inside GEMM fusions), "cublas"
    operands: tuple[str, ...]   # element types, e.g. ("bf16", "bf16")
    result: str
    line: str


_MLIR_DOT = re.compile(r"stablehlo\.dot_general .*?:\s*\(tensor<[^>]*?x?(\w+)>,\s*tensor<[^>]*?x?(\w+)>\)\s*->\s*"
                       r"tensor<[^>]*?x?(\w+)>")
_HLO_DOT = re.compile(r"=\s*(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+dot\((\w+)\[[^\]]*\](?:\{[^}]*\})?\s+%?[\w.-]+,\s*"
                      r"(\w+)\[")
_HLO_CUSTOM = re.compile(r"=\s*\(?(\w+)\[[^\]]*\].*?custom-call\((\w+)\[[^\]]*\](?:\{[^}]*\})?\s+%?[\w.-]+,\s*"
                         r"(\w+)\[.*custom_call_target=\"([^\"]+)\"")


def _elem(t: str) -> str:
    """'512x64xbf16' tail or 'bf16' -> 'bf16'."""
    return t.rsplit("x", 1)[-1] if "x" in t and not t.startswith("x") else t


def gemms(text: str) -> list[Gemm]:
    """Every GEMM of a lowered (StableHLO) or compiled (HLO) program with its operand and result types."""
    out = []
    for line in text.splitlines():
        if "stablehlo.dot_general" in line and (m := _MLIR_DOT.search(line)):
            out.append(Gemm("dot_general", (_elem(m[1]), _elem(m[2])), _elem(m[3]), line.strip()))
        elif " dot(" in line and (m := _HLO_DOT.search(line)):
            out.append(Gemm("dot", (m[2], m[3]), m[1], line.strip()))
        elif "custom-call(" in line and "cublas" in line and (m := _HLO_CUSTOM.search(line)):
            out.append(Gemm("cublas", (m[2], m[3]), m[1], line.strip()))
    return out


def float32_gemms(found: list[Gemm], results_too: bool = True) -> list[Gemm]:
    """The GEMMs that run in float32: an f32 operand (an f32 GEMM), or (results_too) a 16-bit GEMM
    with an f32 result (its gradient would then be an f32 GEMM)."""
    return [g for g in found if "f32" in g.operands or (results_too and g.result == "f32")]


def custom_call_kinds(text: str, target: str) -> list[int | None]:
    """The `kind` attribute of every custom call to `target` (None where it has none), in program order."""
    kinds = []
    for line in text.splitlines():
        if f'custom_call_target="{target}"' in line or f"custom_call @{target}(" in line:
            m = re.search(r"\bkind\s*=\s*(-?\d+)", line)
            kinds.append(int(m[1]) if m else None)
    return kinds


_BACKEND_CONFIG = re.compile(r'backend_config\s*=\s*"?\{([^{}]*)\}')
_INT_ATTR = re.compile(r"(\w+)\s*=\s*(-?\d+)\s*:\s*[iu]\d+")  # `variant = 2 : i32`; arrays are dense<...>


def custom_call_attrs(text: str, target: str) -> list[dict[str, int]]:
    """The scalar integer attributes (e.g. pk_collective's `op`, `variant`) of every typed-FFI custom call
    to `target`, in program order: read from its backend_config dictionary, which StableHLO prints as
    `mhlo.backend_config = {op = 3 : i32, ...}` and compiled HLO as `backend_config={op = 3 : i32, ...}`."""
    found = []
    for line in text.splitlines():
        if f'custom_call_target="{target}"' in line or f"custom_call @{target}(" in line:
            m = _BACKEND_CONFIG.search(line)
            found.append({k: int(v) for k, v in _INT_ATTR.findall(m[1])} if m else {})
    return found


def describe(found: list[Gemm]) -> str:
    """One line per GEMM, for failure messages."""
    return "\n".join(f"  {g.where}: {'x'.join(g.operands)} -> {g.result}: {g.line[:160]}" for g in found)


# What a training step of each fused op (its output y and jax.vjp's gradients) compiles to (autotuning
# off, so the schedule is the fused starting point, never the composition): (pk_tp_gemm kinds of its
# forward, of its backward's fused kernel, number of pk_matmul calls in the backward). Kinds as tp_gemm.kernel_kind: comm-SM kernels 0-2, intra-SM 3-5.
# The pairing: AG's dx is a GEMM+RS and its dw a pk_matmul; RS's dh an AG+GEMM and its dw a pk_matmul;
# AR's dh and dw two pk_matmuls.
FUSED_VJP = {
    "all_gather_matmul": ({0, 5}, {1, 3}, 1),
    "matmul_reduce_scatter": ({1, 3}, {0, 5}, 1),
    "matmul_all_reduce": ({2, 4}, set(), 2),
}


def fused_vjp_problems(compiled: str, op: str) -> list[str]:
    """Why the compiled (HLO) training step of fused `op` (y and jax.vjp's gradients; a program of the
    gradients alone drops RS's and AR's forward kernel as dead code) is not the fused bf16 backward:
    float32 GEMMs, or pk_tp_gemm / pk_matmul calls other than FUSED_VJP[op]. Empty when it is."""
    problems = []
    bad = float32_gemms(gemms(compiled), results_too=False)
    if bad:
        problems.append("float32 GEMMs in the compiled backward:\n" + describe(bad))
    fwd, bwd, matmuls = FUSED_VJP[op]
    kinds = custom_call_kinds(compiled, "pk_tp_gemm")
    # jax.vjp's function recomputes nothing: the step is the forward kernel plus the backward's.
    if sum(k in fwd for k in kinds) != 1 or sum(k in bwd for k in kinds) != (1 if bwd else 0) \
            or len(kinds) != 1 + (1 if bwd else 0):
        problems.append(f"pk_tp_gemm kinds {kinds}: want one of {sorted(fwd)} (forward)"
                        + (f" and one of {sorted(bwd)} (backward)" if bwd else ""))
    n = len(custom_call_kinds(compiled, "pk_matmul"))
    if n != matmuls:
        problems.append(f"{n} pk_matmul custom calls, expected {matmuls}")
    return problems


# jax.lax primitives that communicate across members (jax._src.lax.parallel). Where ranks share one GPU
# NCCL refuses them, so a program meant to run there must hold none (its exchanges are pk_collective calls).
LAX_COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "ppermute", "psend", "precv", "all_to_all",
                             "ragged_all_to_all", "all_gather", "all_gather_invariant", "reduce_scatter"})


def primitive_names(jaxpr) -> set[str]:
    """Every primitive of a jaxpr, sub-jaxprs (shard_map, pjit, scan, cond, custom rules) included."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            names |= primitive_names(sub)
    return names
