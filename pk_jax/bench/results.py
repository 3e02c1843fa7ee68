"""Result files in the shape of shared/notes/results-format.md."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
from collections.abc import Sequence

import jax
import numpy as np


def rel_err(a, b) -> float:
    """Relative Frobenius error of `a` against the reference `b`, in float32."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def device_description() -> str:
    """'4x NVIDIA H200'; where ranks share GPUs (the multi-rank test mode) the physical count and the
    ranks: '1x NVIDIA H200 (2 ranks sharing each GPU)'."""
    from pk_jax import distributed

    devs = jax.devices()
    if devs[0].platform != "gpu":
        return f"{len(devs)}x cpu"
    info = distributed.info()
    if info is not None and info.ranks_per_gpu > 1:
        return f"{len(devs) // info.ranks_per_gpu}x {devs[0].device_kind} ({info.ranks_per_gpu} ranks sharing each GPU)"
    return f"{len(devs)}x {devs[0].device_kind}"


def git_commit() -> str:
    """PK_JAX_COMMIT when set (device copies of the tree may carry a stale .git), else git HEAD."""
    if os.environ.get("PK_JAX_COMMIT"):
        return os.environ["PK_JAX_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def document(suite: str, rows: Sequence[dict], device: str | None = None, command: str | None = None) -> dict:
    """A results file's contents. `device`: as in device_description() (pass it where this process must not start
    a jax backend); `command`: what produced the rows (default: this bench CLI's command line)."""
    return {
        "suite": suite,
        "device": device or device_description(),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "command": command or "python -m pk_jax.bench " + " ".join(sys.argv[1:]),
        "rows": list(rows),
    }


def _dump(path: str, doc: dict) -> None:
    """Writes `doc` to `path` atomically: a temporary file in the same directory, then os.replace, so a process
    killed mid-write leaves the previous file whole (or none), never a truncated one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # beside `path`: os.replace is atomic within one file system
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:  # SystemExit from a SIGTERM handler too: no temporary file left behind
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write(path: str, suite: str, rows: Sequence[dict], device: str | None = None, command: str | None = None) -> dict:
    """Writes document(suite, rows, device, command) to `path` (atomically) and returns it."""
    doc = document(suite, rows, device, command)
    _dump(path, doc)
    return doc


def partial_path(path: str) -> str:
    """Where the rows finished so far are kept while the results file `path` is being made:
    <path without .json>.partial.json."""
    root = path[:-len(".json")] if path.endswith(".json") else path
    return root + ".partial.json"


# The partial file being kept: (its path, its document); None when no suite run keeps one.
_partial: tuple[str, dict] | None = None


def start_partial(path: str, suite: str) -> None:
    """From now on every add_partial(row) rewrites partial_path(path) (first written at the first row): results
    `path`'s document with the rows added so far and "partial": true. A suite killed by a timeout then leaves the
    rows it finished."""
    global _partial
    _partial = (partial_path(path), {"partial": True, **document(suite, [])})


def add_partial(row: dict) -> None:
    """Adds a finished row to the partial file; nothing without start_partial (a suite run from Python)."""
    if _partial is None:
        return
    path, doc = _partial
    doc["rows"].append(row)
    _dump(path, doc)


def stop_partial() -> None:
    """No more rows are kept; the partial file stays (for a run that did not finish, it is what is left)."""
    global _partial
    _partial = None


def discard_partial(path: str) -> None:
    """Removes partial_path(path): called once the results file `path` holds every row."""
    with contextlib.suppress(FileNotFoundError):  # no row was finished (or the suite keeps none)
        os.unlink(partial_path(path))


def print_table(rows: Sequence[dict]) -> None:
    head = f"{'op':<15}{'case':<12}{'shape':<22}{'G':>3}{'ours ms':>11}{'lax ms':>11}{'ratio':>8}{'GB/s':>9}  check"
    print(head)
    print("-" * len(head))
    for r in rows:
        gbps = r.get("extra", {}).get("gbps")
        print(f"{r['op']:<15}{r['case']:<12}{str(r['shape']):<22}{r['group']:>3}{r['ours_ms']:>11.4f}"
              f"{r['baseline_ms']:>11.4f}{r['ratio']:>8.2f}{(f'{gbps:.0f}' if gbps else '-'):>9}  "
              f"{r.get('extra', {}).get('check', '')}")


def print_micro_table(rows: Sequence[dict]) -> None:
    """Transfer/sync rows: mechanism, sweep point, bandwidth or latency."""
    print(f"{'op':<10}{'case':<26}{'sweep':<14}{'bytes':>12}{'msg':>11}{'SMs':>5}{'GB/s':>9}{'latency ns':>12}")
    for r in rows:
        e = r["extra"]
        print(f"{r['op']:<10}{r['case']:<26}{e.get('sweep', ''):<14}{(r['shape'] or [''])[0]!s:>12}"
              f"{e.get('message_bytes', '')!s:>11}{e.get('sms', '')!s:>5}{e.get('gbps', '')!s:>9}"
              f"{e.get('latency_ns', '')!s:>12}")


def _print_ruled(head: str, lines) -> None:
    print(head)
    print("-" * len(head))
    for line in lines:
        print(line)


def print_gemm_table(rows: Sequence[dict]) -> None:
    head = (f"{'case':<14}{'M x N x K':<22}{'tile':<9}{'ours ms':>10}{'TF/s':>7}{'dot ms':>10}{'TF/s':>7}"
            f"{'ratio':>8}{'target':>8}  check")
    _print_ruled(head, (_gemm_line(r) for r in rows))


def _gemm_line(r: dict) -> str:
    return f"{r['case']:<14}{'x'.join(map(str, r['extra']['mnk'])):<22}" + _gemm_cells(r)


def _gemm_cells(r: dict) -> str:
    """The columns after M x N x K, shared by the GEMM and the layout tables."""
    e = r["extra"]
    goal = "" if e["target"] is None else f"{e['target']:.2f}{'' if e['meets_target'] else ' !'}"
    return (f"{e['tile']:<9}{r['ours_ms']:>10.4f}{e['tflops']:>7.0f}{r['baseline_ms']:>10.4f}"
            f"{e['baseline_tflops']:>7.0f}{r['ratio']:>8.3f}{goal:>8}  {e['check']} rel={e['rel_err']:.1e}")


def print_layout_table(rows: Sequence[dict]) -> None:
    """The transposed-layout rows (case layout_NT / layout_TN) with their shard count, if any."""
    rows = [r for r in rows if r["case"].startswith("layout_")]
    if not rows:
        return
    print()
    head = (f"{'layout':<8}{'G':>3}  {'M x N x K':<20}{'tile':<9}{'ours ms':>10}{'TF/s':>7}{'dot ms':>10}{'TF/s':>7}"
            f"{'ratio':>8}{'target':>8}  check")
    _print_ruled(head, (_layout_line(r) for r in rows))


def _layout_line(r: dict) -> str:
    e = r["extra"]
    return f"{e['layout']:<8}{e['shards']:>3}  {'x'.join(map(str, e['mnk'])):<20}" + _gemm_cells(r)


def print_tp_table(rows: Sequence[dict]) -> None:
    head = (f"{'op':<23}{'N':>7}{'G':>3}{'ours ms':>10}{'XLA ms':>10}{'ratio':>7}{'target':>8}{'bound ms':>10}"
            f"{'gemm ms':>9}{'comm ms':>9}{'non-ovl':>8}{'sms':>6}{'intra ms':>9}{'det ms':>9}  check")
    _print_ruled(head, (_tp_line(r) for r in rows))


def _tp_line(r: dict) -> str:
    e = r["extra"]
    return (f"{r['op']:<23}{r['shape'][0]:>7}{r['group']:>3}{r['ours_ms']:>10.4f}{r['baseline_ms']:>10.4f}"
            f"{r['ratio']:>7.3f}{e['target']:>7.2f}{'' if e['meets_target'] else '!'}{e['bound_ms']:>10.4f}"
            f"{min(e['gemm_ms_cublas'], e['gemm_ms_pk']):>9.4f}{min(e['coll_ms_lax'], e['coll_ms_pk']):>9.4f}"
            f"{e['non_overlapped_fraction']:>8.2f}{schedule_label(e['num_comm_sms']):>6}{_ms(e.get('intra_sm_ms')):>9}"
            f"{_ms(e.get('deterministic_ms')):>9}  {e['check']} rel={e['rel_err']:.1e}")


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t:.4f}"


def schedule_label(n: int | None) -> str:
    """num_comm_sms as chosen: '-' unknown, 'xla' the unfused composition (0), 'intra' no comm SMs (-1)."""
    return "-" if n is None else {0: "xla", -1: "intra"}.get(n, str(n))


def _bound_ratio(row: dict) -> float | None:
    """The most any overlap can reach where a row knows it: baseline / (work without communication)."""
    e = row.get("extra") or {}
    alone = e.get("attention_alone_ms") or e.get("bound_ms")
    return row["baseline_ms"] / alone if alone and row.get("baseline_ms") else None


def plot_ratios(rows: Sequence[dict], path: str, title: str) -> str | None:
    """One line per row (op, case, shape, group) from 1x to its ratio (baseline ms / ours ms, same run) on a log
    axis, the overlap bound as a tick where the row has one; written to `path` (PNG). None without matplotlib or
    rows with a ratio."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("pk_jax.bench: matplotlib not installed; no plot")
        return None
    done = [r for r in rows if r.get("ratio")]
    if not done:
        return None
    shape = lambda r: "x".join(map(str, r["shape"])) if isinstance(r.get("shape"), (list, tuple)) else str(r.get("shape"))
    labels = [f"{r.get('op')} {r.get('case')} {shape(r)} G{r.get('group', 1)} vs {str(r.get('baseline') or '')[:24]}"
              for r in done]
    ratios = [r["ratio"] for r in done]
    fig, ax = plt.subplots(figsize=(12, max(2.6, 0.32 * len(done) + 1.6)))
    rows_at = range(len(done))  # one line per row, even where two rows' labels are equal
    colors = ["tab:green" if x >= 1 else "tab:red" for x in ratios]
    ax.hlines(rows_at, 1.0, ratios, colors=colors, linewidth=4)  # from 1x: on the log axis the length is log(ratio)
    ax.scatter(ratios, rows_at, color=colors, zorder=3, s=18)
    ax.set_yticks(rows_at, labels)
    bounds = [(i, b) for i, b in enumerate(_bound_ratio(r) for r in done) if b]
    if bounds:
        ax.scatter([b for _, b in bounds], [i for i, _ in bounds], marker="|", s=200, color="black",
                   label="bound (baseline / work alone)")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18 if len(done) > 4 else -0.35), fontsize=8)
    ax.axvline(1.0, color="gray", ls="--")
    ax.set_xscale("log")
    label = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x")
    ax.xaxis.set_major_formatter(label)
    ax.xaxis.set_minor_formatter(label)
    ax.tick_params(axis="x", which="both", labelsize=7)
    ax.set_xlabel("speedup over the baseline (same run; log scale)")
    fig.suptitle(title, fontsize=10)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_ylim(len(done) - 0.5, -0.5)  # first row on top, half a row of margin
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")
    return path


def plot_file(json_path: str) -> str | None:
    """plot_ratios of a results file, to the same name with .png."""
    with open(json_path) as f:
        data = json.load(f)
    title = f"{data.get('suite')} on {data.get('device')} ({data.get('date')}, {data.get('commit')})"
    return plot_ratios(data.get("rows", []), os.path.splitext(json_path)[0] + ".png", title)
