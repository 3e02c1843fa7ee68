"""Device 0's GPU events of one traced call (jax.profiler, CUPTI), printed in time order: shared by the
timeline scripts (scripts/ring_timeline.py, scripts/moe_timeline.py)."""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Callable

import jax


def trace_events(run: Callable[[], object]) -> list[tuple[str, str, float, float]]:
    """(line, event name, start us, duration us) of device 0's GPU events during one run() (after a warm-up run)."""
    from jax.profiler import ProfileData

    run()
    d = tempfile.mkdtemp(prefix="pk_timeline_")
    jax.profiler.start_trace(d)
    run()
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    out = []
    for plane in ProfileData.from_file(files[0]).planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        for line in plane.lines:
            for e in line.events:
                out.append((line.name, e.name, e.start_ns / 1e3, e.duration_ns / 1e3))
    out.sort(key=lambda t: t[2])
    return out


def print_timeline(label: str, evs: list[tuple[str, str, float, float]], min_us: float) -> None:
    """Every event of at least min_us (stream, start relative to the first event, duration, name); the shorter
    ones summed per stream."""
    if not evs:
        print(f"{label}: no GPU events traced")
        return
    t0 = evs[0][2]
    end = max(s + d for _, _, s, d in evs)
    print(f"== {label}: {len(evs)} events, span {end - t0:9.1f} us")
    small: dict[str, float] = {}
    for line, name, s, d in evs:
        if d >= min_us:
            print(f"  {line[:22]:<22} {s - t0:10.1f} +{d:9.1f} us  {name[:90]}")
        else:
            small[line] = small.get(line, 0.0) + d
    for line, tot in small.items():
        print(f"  {line[:22]:<22} events < {min_us} us: {tot:9.1f} us in all")
