"""`python -m pk_jax.bench transfer|sync`: the paper's transfer and synchronization measurements
(section 3.1.2-3.1.3, table 1, figures 2, 3, 5) on this machine's GPUs, through pk_jax's own
primitives (kernels/microbench_*.cu) and the CUDA runtime."""

from __future__ import annotations

import os

from pk_jax import _ext
from pk_jax.bench.progress import Progress

GIB = 1 << 30
MESSAGE_SIZES = [1 << k for k in range(7, 29, 2)] + [1 << 28]   # 128 B .. 256 MiB
# Fine below 16: on 2x H200 every mechanism saturates NVLink with 8-16 SMs.
SM_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64, 96, 132]
FIXED_MESSAGE = 64 << 10                             # the SM sweep's message size
DEVICE_MECHANISMS = ["tma_store", "tma_load", "tma_store_add", "reg_store", "reg_load"]
# All-to-all over every local GPU: bytes each GPU sends to each other GPU (powers of two, so multiples
# of the kernels' 32 KiB pieces from 32 KiB on).
A2A_SIZES = [1 << k for k in range(16, 29, 2)]                 # 64 KiB .. 256 MiB per peer
A2A_SIZES_QUICK = [64 << 10, 4 << 20, 64 << 20]
A2A_MECHANISMS = ["copy_engine", "tma_store", "reg_store"]
A2A_BASELINE = "a2a_copy_engine same bytes_per_peer"


def require_gpus() -> list[int]:
    """CUDA ordinals of the local GPUs; raises SystemExit with a clear message without two."""
    from pk_jax import runtime

    gpus = runtime.gpu_devices()
    if _ext.ext is None or len(gpus) < 2:
        why = "the CUDA extension is not built" if _ext.ext is None else f"found {len(gpus)} GPU(s)"
        raise SystemExit(f"pk_jax.bench: this suite measures GPU-to-GPU transfers and needs >= 2 CUDA GPUs ({why}).")
    return [d.local_hardware_id for d in gpus]


def _row(case: str, nbytes: int, gbps: float, ms: float, sms: int, message: int, ce_gbps: float, sweep: str) -> dict:
    return {"op": "transfer", "case": case, "shape": [nbytes], "dtype": "bfloat16" if "add" in case else "bytes",
            "group": 2, "ours_ms": round(ms, 5), "baseline": "copy_engine 256 MiB messages",
            "baseline_ms": round(nbytes / (ce_gbps * 1e9) * 1e3, 5), "ratio": round(gbps / ce_gbps, 4),
            "extra": {"gbps": round(gbps, 1 if gbps >= 10 else 4), "sms": sms, "message_bytes": message,
                      "sweep": sweep}}


def _failed_row(case: str, nbytes: int, sms: int, message: int, sweep: str, err: Exception) -> dict:
    """A point that raised (e.g. bytes differed after the transfer): kept in the file, left out of plots."""
    print(f"\npk_jax.bench transfer: {case} ({sweep}, {message} B messages, {sms} SMs) FAILED: {err}", flush=True)
    return {"op": "transfer", "case": case, "shape": [nbytes], "dtype": "bytes", "group": 2, "ours_ms": None,
            "baseline": "copy_engine 256 MiB messages", "baseline_ms": None, "ratio": None,
            "extra": {"sms": sms, "message_bytes": message, "sweep": sweep + "_failed", "error": str(err)}}


def _a2a_row(mech: str, group: int, bytes_per_peer: int, ms: float, gpu_ms: list[float], sms: int,
             ce_ms: float | None) -> dict:
    """One all-to-all point: every one of `group` GPUs sends `bytes_per_peer` to every other one.
    gbps: bytes each GPU receives ((G-1) x bytes_per_peer) per second of the slowest GPU's time;
    aggregate_gbps: all G x (G-1) messages over that time. Baseline: the copy-engine all-to-all of
    the same size (ratio > 1: faster than it)."""
    recv = (group - 1) * bytes_per_peer
    gbps = recv / (ms * 1e-3) / 1e9
    agg = group * gbps
    return {"op": "transfer", "case": "a2a_" + mech, "shape": [bytes_per_peer], "dtype": "bytes", "group": group,
            "ours_ms": round(ms, 5), "baseline": A2A_BASELINE,
            "baseline_ms": None if ce_ms is None else round(ce_ms, 5),
            "ratio": None if ce_ms is None else round(ce_ms / ms, 4),
            "extra": {"gbps": round(gbps, 1 if gbps >= 10 else 4), "aggregate_gbps": round(agg, 1 if agg >= 10 else 4),
                      "per_gpu_ms": [round(t, 5) for t in gpu_ms], "sms": 0 if mech == "copy_engine" else sms,
                      "message_bytes": bytes_per_peer, "sweep": "a2a"}}


def _a2a_failed_row(mech: str, group: int, bytes_per_peer: int, sms: int, why: str, skipped: bool = False) -> dict:
    return {"op": "transfer", "case": "a2a_" + mech, "shape": [bytes_per_peer], "dtype": "bytes", "group": group,
            "ours_ms": None, "baseline": A2A_BASELINE, "baseline_ms": None, "ratio": None,
            "extra": {"sms": sms, "message_bytes": bytes_per_peer, "sweep": "a2a_skipped" if skipped else "a2a_failed",
                      "error": why}}


def run_all_to_all(ext, devs: list[int], sizes: list[int], sms: int, reps: int, bar=None) -> list[dict]:
    """(d) all-to-all over all `devs`: copy engine first (the baseline of the kernel rows at the same
    size), then TMA store and register store. Pairs without peer access skip the kernel rows (said
    once, with the pairs); a point that raises is kept as a failed row."""
    if len(devs) > 8:
        print(f"\npk_jax.bench transfer: a2a rows use the first 8 of {len(devs)} GPUs", flush=True)
        devs = devs[:8]
    g = len(devs)
    missing = [tuple(p) for p in ext.mb_missing_peer_access(devs)]
    no_peer = ""
    if missing:
        no_peer = "no peer access between " + ", ".join(f"GPU {a} -> GPU {b}" for a, b in missing)
        print(f"\npk_jax.bench transfer: {no_peer}; skipping the a2a kernel rows (a2a_tma_store, a2a_reg_store)",
              flush=True)
    rows: list[dict] = []
    for size in sizes:
        ce_ms = None
        for mech in A2A_MECHANISMS:
            if mech != "copy_engine" and no_peer:
                rows.append(_a2a_failed_row(mech, g, size, sms, no_peer, skipped=True))
            else:
                try:
                    ms, gpu_ms = ext.mb_all_to_all(mech, devs, size, sms, reps)
                    if mech == "copy_engine":
                        ce_ms = ms
                    rows.append(_a2a_row(mech, g, size, ms, list(gpu_ms), sms, ce_ms))
                except RuntimeError as e:
                    print(f"\npk_jax.bench transfer: a2a_{mech} ({g} GPUs, {size} B per peer) FAILED: {e}", flush=True)
                    rows.append(_a2a_failed_row(mech, g, size, sms, str(e)))
            if bar is not None:
                bar.step(f"a2a {mech} {size} B")
    return rows


def run_transfer(quick: bool, reps: int, out_dir: str) -> list[dict]:
    ext = _ext.ext
    devs = require_gpus()
    src, dst = devs[0], devs[1]
    all_sms = ext.num_sms(src)
    total = (256 << 20) if quick else GIB
    sizes = MESSAGE_SIZES[::2] if quick else MESSAGE_SIZES
    sms_list = [s for s in SM_COUNTS if s < all_sms] + [all_sms]
    rows: list[dict] = []
    _, ce_gbps, _ = ext.mb_transfer("copy_engine", src, dst, total, 256 << 20 if total >= 256 << 20 else total,
                                    all_sms, reps)
    mechs = ext.mb_mechanisms()
    a2a_sizes = A2A_SIZES_QUICK if quick else A2A_SIZES
    bar = Progress(len(sizes) * len(mechs) + len(sms_list) * len(DEVICE_MECHANISMS) + 3
                   + len(a2a_sizes) * len(A2A_MECHANISMS), "transfer")
    for mech in mechs:  # (a) message size, all SMs
        for msg in sizes:
            try:
                ms, gbps, moved = ext.mb_transfer(mech, src, dst, total, min(msg, total), all_sms, reps)
                rows.append(_row(mech, moved, gbps, ms, all_sms, msg, ce_gbps, "message_size"))
            except RuntimeError as e:
                rows.append(_failed_row(mech, total, all_sms, msg, "message_size", e))
            bar.step(f"{mech} {msg} B")
    for mech in DEVICE_MECHANISMS:  # (b) SM count, fixed message
        for sms in sms_list:
            try:
                ms, gbps, moved = ext.mb_transfer(mech, src, dst, total, FIXED_MESSAGE, sms, reps)
                rows.append(_row(mech, moved, gbps, ms, sms, FIXED_MESSAGE, ce_gbps, "sm_count"))
            except RuntimeError as e:
                rows.append(_failed_row(mech, total, sms, FIXED_MESSAGE, "sm_count", e))
            bar.step(f"{mech} {sms} SMs")
    for mech in ["copy_engine", "tma_store", "reg_store"]:  # (c) every GPU sends to every other one
        try:
            gbps = ext.mb_all_pairs(mech, devs, total, all_sms, reps)
            row = _row(mech + "_all_pairs", total, gbps, total * (len(devs) - 1) / (gbps * 1e9) * 1e3, all_sms,
                       total, ce_gbps, "all_pairs")
        except RuntimeError as e:
            row = _failed_row(mech + "_all_pairs", total, all_sms, total, "all_pairs", e)
        row["group"] = len(devs)
        rows.append(row)
        bar.step(f"all pairs {mech}")
    rows += run_all_to_all(ext, devs, a2a_sizes, all_sms, reps, bar)  # (d) all-to-all over every GPU
    _plots(rows, out_dir, ce_gbps)
    return rows


def saturation_sms(rows: list[dict], mechanism: str, fraction: float = 0.9) -> int | None:
    """Fewest SMs at which `mechanism` reaches `fraction` of its best SM-sweep bandwidth (the
    starting point of the fused kernels' num_comm_sms search)."""
    sweep = sorted((r["extra"]["sms"], r["extra"]["gbps"]) for r in rows
                   if r["case"] == mechanism and r["extra"]["sweep"] == "sm_count")
    if not sweep:
        return None
    best = max(g for _, g in sweep)
    return next(s for s, g in sweep if g >= fraction * best)


def _plots(rows: list[dict], out_dir: str, ce_gbps: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("pk_jax.bench: matplotlib not installed; skipping plots")
        return
    for sweep, xkey, xlabel, name in [("message_size", "message_bytes", "message size (bytes)", "message_size"),
                                      ("sm_count", "sms", "SMs used", "sm_count")]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mech in sorted({r["case"] for r in rows if r["extra"]["sweep"] == sweep}):
            pts = sorted((r["extra"][xkey], r["extra"]["gbps"]) for r in rows
                         if r["case"] == mech and r["extra"]["sweep"] == sweep)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mech)
        ax.axhline(ce_gbps, color="gray", ls="--", lw=1, label=f"copy engine, 256 MiB ({ce_gbps:.0f} GB/s)")
        ax.set_xscale("log", base=2)  # SM sweep too: the knee sits below 16 SMs
        ax.set_xlabel(xlabel)
        ax.set_ylabel("GB/s, GPU0 -> GPU1")
        ax.set_title("Peer bandwidth by message size, all SMs\n(kernels move messages above 32 KiB as 32 KiB pieces)"
                     if sweep == "message_size" else f"Peer bandwidth by SM count, {FIXED_MESSAGE >> 10} KiB messages",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"transfer-{name}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        print(f"wrote {path}")


def run_sync(reps: int) -> list[dict]:
    from pk_jax import runtime

    ext = _ext.ext
    devs = require_gpus()
    if runtime.ensure_initialized() is not None:
        raise SystemExit(f"pk_jax.bench: runtime unavailable: {runtime.ensure_initialized()}")
    cases = [("mbarrier_intra_sm", lambda: ext.mb_mbarrier_handoff_ns(devs[0], 100_000)),
             ("hbm_flag_inter_sm", lambda: ext.mb_hbm_flag_handoff_ns(devs[0], 20_000)),
             ("peer_signal_round_trip", lambda: ext.mb_peer_round_trip_ns(devs[0], devs[1], 20_000)),
             ("group_barrier", lambda: ext.mb_group_barrier_ns(20_000))]
    rows = []
    bar = Progress(len(cases) * reps, "sync")
    for case, fn in cases:
        samples = []
        for _ in range(reps):
            samples.append(fn())
            bar.step(case)
        samples.sort()
        ns = samples[len(samples) // 2]
        rows.append({"op": "sync", "case": case, "shape": [], "dtype": "none",
                     "group": len(devs) if case == "group_barrier" else (2 if "peer" in case else 1),
                     "ours_ms": round(ns * 1e-6, 9), "baseline": "none", "baseline_ms": None, "ratio": None,
                     "extra": {"latency_ns": round(ns, 1), "spread_ns": round(samples[-1] - samples[0], 1),
                               "samples": len(samples)}})
    return rows
