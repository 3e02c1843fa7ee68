"""Chooses the fused GEMMs' schedule (num_comm_sms, the block tile, and for RS/AR store-add or pull)
by timing candidates once per (op, shape, dtype, group size, GPU model) and caching the choice on
disk, so no user ever tunes by hand.

Cache: $PK_JAX_CACHE_DIR, else $XDG_CACHE_HOME/pk_jax, else ~/.cache/pk_jax; file autotune.json.
Entries carry the package version and are ignored after an upgrade. PK_JAX_AUTOTUNE=0 skips the
timing and uses the starting point below.

The intra-SM kernels (INTRA_SM: no comm SMs; AG: a pusher thread on every compute SM, RS/AR without
`deterministic=True`: each tile added into its owner's output by TMA store-add) are candidates too,
timed first.

Candidate 0 is the unfused XLA composition itself: where no split of the SMs beats it (small shapes,
where the fixed cost of the fused kernel's handshakes dominates), the op lowers to the composition,
so a fused op is never slower than what it replaces by more than the timing noise.

Both block tiles are tried: the SM count left to compute decides how evenly the tiles fill the last
wave (e.g. 512 tiles of 128x256 on 116 SMs take 5 waves; 1,024 of 128x128 take 9 half-waves).

The search starts at the SM counts that saturate NVLink in the transfer microbenchmark
(benchmarks/results/2026-11-22-transfer-nvidia-h200-x2.json: TMA stores reach 90% of their best
with 8 SMs, register loads with 16): the AG kernel pushes with TMA, the RS/AR kernels pull with
register loads.
"""

from __future__ import annotations

import json
import statistics
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

START = {"all_gather_matmul": 8, "matmul_reduce_scatter": 16, "matmul_all_reduce": 16}
# With timing off, the intra-SM kernel is the start where it was measured the faster one (store-add RS/AR
# at N >= 8192 on 2 H200s); AG's intra-SM kernel starts as a candidate only.
START_INTRA_SM = {"all_gather_matmul": False, "matmul_reduce_scatter": True, "matmul_all_reduce": True}
CANDIDATES = (8, 12, 16, 24, 32, 0)  # 0: the XLA composition (no fusion); 4 never won a measurement
INTRA_SM = -1  # the kernel without comm SMs (AG: pushers on every compute SM; RS/AR: store-add)
AUTO_TILE = -1
FINALISTS = 3
WARMUP = 2          # untimed calls per candidate (the first compiles it)
REPS = 7            # timed calls per candidate, every candidate in turns
FINALIST_REPS = 10  # more timed calls for the FINALISTS fastest, in turns
TILE_NAMES = ("128x256", "128x128")  # the fused kernels' block tiles, by kernels/gemm.cuh Tile

_lock = threading.Lock()


def cache_path() -> Path:
    root = os.environ.get("PK_JAX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pk_jax")
    return Path(root) / "autotune.json"


def _version() -> str:
    from pk_jax import __version__

    return __version__


def _load() -> dict:
    try:
        doc = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return doc.get("entries", {}) if doc.get("version") == _version() else {}


def _store(entries: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".autotune-")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": _version(), "entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: concurrent processes never read a half-written file
    except OSError:
        pass  # an unwritable cache only costs re-tuning


def key(op: str, m: int, n: int, k: int, dtype: str, group: int, gpu: str, choices: str = "") -> str:
    """The cache key; `choices` names a candidate set other than the default (e.g. "intra_sm")."""
    return f"{op}|{m}x{n}x{k}|{dtype}|g{group}|{gpu}" + (f"|{choices}" if choices else "")


def enabled() -> bool:
    return os.environ.get("PK_JAX_AUTOTUNE", "1") != "0"


class Choice(NamedTuple):
    num_comm_sms: int  # SMs of the comm role; 0: the composition; INTRA_SM: the kernel without comm SMs
    tile: int = AUTO_TILE  # the block tile (kernels/gemm.cuh Tile); AUTO_TILE: the kernel picks


def _label(c: Choice) -> str:
    return f"{c.num_comm_sms}" + ("" if c.tile == AUTO_TILE else f"@{TILE_NAMES[c.tile]}")


def choose(op: str, cache_key: str, time_candidate: Callable[[Choice], float], max_sms: int,
           intra_sm: bool = False, composition: bool = True, tiles: Sequence[int] = (AUTO_TILE,)) -> Choice:
    """The cached choice, or the fastest candidate by `time_candidate(choice)`, which makes one call of
    the candidate and returns its ms per op. Candidates: every SM count of CANDIDATES (nearest START
    first) with every tile of `tiles`; the store-add kernel with each tile, first, when `intra_sm`; the
    composition last unless `composition=False`. Each is warmed up, then all are timed in turns (each
    turn starting one candidate later), as the benchmark times its contenders: timed one after another,
    a kernel ran hotter or cooler than beside the others, and store-add RS/AR came out 5-7% slower
    than in the benchmark (2 H200s, N = 16384), so the pull schedule won there. The FINALISTS fastest
    are timed FINALIST_REPS more times in turns; medians decide.
    With timing off (PK_JAX_AUTOTUNE=0): the intra-SM kernel if allowed and START_INTRA_SM, else START."""
    with _lock:
        hit = _load().get(cache_key)
        if hit is not None:
            return Choice(int(hit["num_comm_sms"]), int(hit.get("tile", AUTO_TILE)))
        start = start_choice(op, intra_sm)
        if not enabled():
            return start
        sms = sorted((c for c in CANDIDATES if 0 < c < max_sms), key=lambda c: (abs(c - START[op]), c))
        order = [Choice(c, t) for c in ([INTRA_SM] if intra_sm else []) + sms for t in tiles]
        order += [Choice(0)] if composition else []
        samples: dict[Choice, list[float]] = {c: [] for c in order}
        live = []
        for c in order:
            try:
                for _ in range(WARMUP):
                    time_candidate(c)
                live.append(c)
            except Exception as e:  # noqa: BLE001 - a candidate that fails is not chosen
                print(f"pk_jax autotune: {op} {_label(c)} failed: {e}")
        if not live:
            return start  # nothing ran: keep the default and try again next time (no cache entry)
        _time_in_turns(live, time_candidate, REPS, samples)
        times = {c: statistics.median(s) if s else float("inf") for c, s in samples.items()}
        finalists = sorted(live, key=times.get)[:FINALISTS]
        _time_in_turns(finalists, time_candidate, FINALIST_REPS, samples)
        times.update({c: statistics.median(samples[c]) for c in finalists})
        best = min(times, key=times.get)
        entries = _load()
        entries[cache_key] = {"num_comm_sms": best.num_comm_sms, "tile": best.tile,
                              "ms": {_label(c): round(t, 5) for c, t in times.items()}}
        _store(entries)
        return best


def start_choice(op: str, intra_sm: bool) -> Choice:
    """The choice with timing off: the intra-SM kernel where allowed and START_INTRA_SM, else START."""
    return Choice(INTRA_SM if intra_sm and START_INTRA_SM[op] else START[op])


def cached_or_start(op: str, cache_key: str, intra_sm: bool) -> Choice:
    """The cached choice without timing anything (multi-process jobs), else start_choice."""
    hit = _load().get(cache_key)
    if hit is not None:
        return Choice(int(hit["num_comm_sms"]), int(hit.get("tile", AUTO_TILE)))
    return start_choice(op, intra_sm)


def _time_in_turns(cands: Sequence[Choice], time_candidate: Callable[[Choice], float], reps: int,
                   samples: dict[Choice, list[float]]) -> None:
    from pk_jax.bench.timing import turns

    for i in turns(len(cands), reps):
        samples[cands[i]].append(time_candidate(cands[i]))


def entries() -> dict:
    """Everything cached for this package version (for inspection and the benchmark report)."""
    return _load()
