"""Where the attention forward's per-task time goes, from the kernel's own clock trace: a build configured with
`cmake -DPK_JAX_ATTENTION_TRACE=ON` (Kernel::kTrace in kernels/attention_kernel.cuh, pk/clock_trace.cuh), in which CTAs
0-7's loader, two consumer warpgroups and storer stamp their steps with the SM clock into the LSE buffer. The fa3
mainloops with two consumer warpgroups only (fa3, fa3n160 and its short-tail builds; not fa3w3). Timing of the traced
build only: its LSE is the trace.

    python3 scripts/attention_trace.py --batch 16 --seq 4096 --heads 16 --head-dim 128

For each consumer warpgroup it prints the median cycles of each step of a turn inside a task (issue -> S ready -> P V
ready -> next K / V ready -> next issue) and of the same steps around a task switch (the last turn of task t to the
second turn of task t + 1, through the Q wait and the previous task's finish), then the switch's cost in steady turns:
(task time - turns x steady turn) per task. The loader's lines give when Q was issued against when the consumers got
it; the storer's lines when each warpgroup's O reached its slot and when TMA had read both. finish_rows is split into
its arithmetic (O /= l, LSE), the wait for its output slot, and the stmatrix + proxy fence + arrival. Tasks 0 and the last
of each CTA are left out (start-up, drain)."""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

import pk_jax

CTAS, ROLES, EVENTS, MAGIC = 8, 4, 8192, 0x7ACE  # pk/clock_trace.cuh; roles: loader, warpgroup 0, warpgroup 1, storer
NAMES = {1: "task", 2: "q_ready", 3: "kv_ready", 4: "issued", 5: "s_ready", 6: "pv_ready", 7: "finished",
         12: "l_task", 13: "l_q_empty", 9: "l_q_issued", 10: "l_k_issued", 11: "l_v_issued",
         14: "fin_normed", 15: "fin_slot", 16: "fin_stored", 17: "st_full", 18: "st_read"}  # attention_kernel.cuh TraceEvent


def read_trace(lse: np.ndarray) -> dict[tuple[int, int], list[tuple[int, str, int, int]]]:
    """{(cta, role): [(clock, event, task, kb), ...]} with the clock unwrapped from 32 bits."""
    words = np.ascontiguousarray(lse).view(np.uint32).reshape(-1)
    need = CTAS * ROLES * EVENTS * 2
    if words.size < need:
        raise SystemExit(f"the LSE buffer holds {words.size} words, the trace needs {need}: raise --batch or --seq")
    words = words[:need].reshape(CTAS, ROLES, EVENTS, 2)
    out = {}
    for cta in range(CTAS):
        roles = [r for r in range(ROLES) if int(words[cta, r, 0, 1]) == MAGIC]
        if not roles:
            continue
        # One SM clock for the CTA's roles: each stamp relative to the first role's first one, within +-2^31 cycles
        # (a call lasts milliseconds).
        ref = np.int64(words[cta, roles[0], 1, 0])
        for role in roles:
            ev = words[cta, role, 1:int(words[cta, role, 0, 0]) + 1]
            clock = (ev[:, 0].astype(np.int64) - ref) % (1 << 32)
            clock = np.where(clock >= 1 << 31, clock - (1 << 32), clock)
            out[cta, role] = [(int(c), NAMES.get(int(w) >> 24, str(int(w) >> 24)), (int(w) >> 12) & 0xFFF,
                               int(w) & 0xFFF) for c, w in zip(clock, ev[:, 1])]
    return out


def median(xs: list[int]) -> str:
    return f"{int(np.median(xs)):6d}" if xs else "     -"


def consumer_summary(events: list[tuple[int, str, int, int]]) -> None:
    """Steady-turn and task-switch step medians for one consumer warpgroup's events."""
    by_task = collections.defaultdict(list)
    for e in events:
        by_task[e[2]].append(e)
    tasks = sorted(by_task)[1:-1]
    steady = collections.defaultdict(list)   # step name -> cycles
    switch = collections.defaultdict(list)
    task_cycles, turns = [], []
    for t in tasks:
        ev = by_task[t]
        at = {(name, kb): c for c, name, _, kb in ev}
        blocks = 1 + max(kb for _, name, _, kb in ev if name == "issued")
        turns.append(blocks)
        for kb in range(1, blocks - 1):
            if ("issued", kb + 1) in at:
                steady["issued -> s_ready"].append(at["s_ready", kb] - at["issued", kb])
                steady["s_ready -> pv_ready"].append(at["pv_ready", kb] - at["s_ready", kb])
                steady["pv_ready -> next kv_ready"].append(at["kv_ready", kb + 1] - at["pv_ready", kb])
                steady["next kv_ready -> next issued"].append(at["issued", kb + 1] - at["kv_ready", kb + 1])
                steady["turn (issued -> next issued)"].append(at["issued", kb + 1] - at["issued", kb])
        nxt = by_task.get(t + 1)
        if nxt is None or t + 1 not in tasks:
            continue
        an = {(name, kb): c for c, name, _, kb in nxt}
        last = blocks - 1
        switch["last issued -> s_ready"].append(at["s_ready", last] - at["issued", last])
        switch["last s_ready -> pv_ready"].append(at["pv_ready", last] - at["s_ready", last])
        switch["last pv_ready -> task t+1"].append(an["task", 0] - at["pv_ready", last])
        switch["task -> q_ready"].append(an["q_ready", 0] - an["task", 0])
        switch["q_ready -> kv_ready 0"].append(an["kv_ready", 0] - an["q_ready", 0])
        switch["kv_ready 0 -> issued 0"].append(an["issued", 0] - an["kv_ready", 0])
        switch["issued 0 -> s_ready 0"].append(an["s_ready", 0] - an["issued", 0])
        switch["s_ready 0 -> pv_ready 0 (carried)"].append(an["pv_ready", 0] - an["s_ready", 0])
        switch["pv_ready 0 -> finished"].append(an["finished", 0] - an["pv_ready", 0])
        if ("fin_stored", 0) in an:
            switch["  finish: pv_ready 0 -> O /= l, LSE"].append(an["fin_normed", 0] - an["pv_ready", 0])
            switch["  finish: -> slot free"].append(an["fin_slot", 0] - an["fin_normed", 0])
            switch["  finish: -> stmatrix, fence, arrive"].append(an["fin_stored", 0] - an["fin_slot", 0])
        if ("kv_ready", 1) in an:
            switch["finished -> kv_ready 1"].append(an["kv_ready", 1] - an["finished", 0])
            switch["kv_ready 1 -> issued 1"].append(an["issued", 1] - an["kv_ready", 1])
        switch["turn last -> issued 0"].append(an["issued", 0] - at["issued", last])
        if ("issued", 1) in an:
            switch["turn issued 0 -> issued 1"].append(an["issued", 1] - an["issued", 0])
        task_cycles.append(an["issued", 0] - at["issued", 0])
    for name, xs in steady.items():
        print(f"    steady  {name:<36}{median(xs)}")
    for name, xs in switch.items():
        print(f"    switch  {name:<36}{median(xs)}")
    if task_cycles and steady["turn (issued -> next issued)"]:
        turn = float(np.median(steady["turn (issued -> next issued)"]))
        per_task = float(np.median(task_cycles))
        n = float(np.median(turns))
        print(f"    task {per_task:.0f} cycles = {n:.0f} turns x {turn:.0f} + {per_task - n * turn:.0f} "
              f"({(per_task - n * turn) / turn:.2f} turns, {100 * (per_task - n * turn) / per_task:.1f} % of the task)")


def loader_summary(events: list[tuple[int, str, int, int]], consumers: list[list[tuple[int, str, int, int]]]) -> None:
    """When the loader got the Q slot and issued Q, against the consumers' Q waits (same CTA, same clock)."""
    # Index: the Q part (one per consumer warpgroup where Q is loaded in parts; 0 for a single slot).
    q_issued = {(t, i): c for c, name, t, i in events if name == "l_q_issued"}
    q_empty = {(t, i): c for c, name, t, i in events if name == "l_q_empty"}
    l_task = {t: c for c, name, t, _ in events if name == "l_task"}
    wait_slot, latency = [], []
    for wg, ev in enumerate(consumers):
        ready = {t: c for c, name, t, _ in ev if name == "q_ready"}
        entered = {t: c for c, name, t, _ in ev if name == "task"}
        for t in sorted(ready)[1:-1]:
            issued = q_issued.get((t, wg), q_issued.get((t, 0)))
            if issued is not None and ready[t] > entered[t] + 64:  # the consumer waited for Q
                latency.append(ready[t] - issued)
    for (t, _), c in sorted(q_empty.items())[1:-1]:
        if t in l_task:
            wait_slot.append(c - l_task[t])
    print(f"    loader: waits for a Q slot {median(wait_slot)} cycles after the task began; Q issued -> a waiting consumer has it "
          f"{median(latency)} ({len(latency)} waits)")


def storer_summary(events: list[tuple[int, str, int, int]], consumers: list[list[tuple[int, str, int, int]]]) -> None:
    """When each warpgroup's O reached the storer against the consumer's arrival, and the TMA read's length. The
    consumers finish task t during task t + 1 (the carry), so their fin_stored of t carries the task number t + 1."""
    full = {(t, i): c for c, name, t, i in events if name == "st_full"}
    read = {t: c for c, name, t, _ in events if name == "st_read"}
    seen, tma_read = collections.defaultdict(list), []
    for wg, ev in enumerate(consumers):
        stored = {t - 1: c for c, name, t, _ in ev if name == "fin_stored"}
        for t in sorted(stored)[1:-1]:
            if (t, wg) in full:
                seen[wg].append(full[t, wg] - stored[t])
    for t in sorted(read)[1:-1]:
        if (t, len(consumers) - 1) in full:
            tma_read.append(read[t] - full[t, len(consumers) - 1])
    print("    storer: consumer's arrival -> storer has it " + " / ".join(median(seen[w]) for w in sorted(seen)) +
          f" cycles; last slot -> TMA has read both {median(tma_read)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--ctas", type=int, default=8, help=f"CTAs to print (of the {CTAS} traced)")
    args = ap.parse_args()
    kv = args.kv_heads or args.heads
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (args.batch, args.seq, args.heads, args.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (args.batch, args.seq, kv, args.head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (args.batch, args.seq, kv, args.head_dim), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: pk_jax.attention(q, k, v, causal=args.causal, return_lse=True,
                                                 implementation="pk")[1])
    for _ in range(3):
        lse = f(q, k, v)
    trace = read_trace(np.asarray(jax.block_until_ready(lse)))
    print(f"B{args.batch} S{args.seq} N{args.heads}/{kv} D{args.head_dim} causal={args.causal}: "
          f"{len(trace)} traced roles")
    if not trace:
        raise SystemExit("no trace in the LSE buffer: the extension is not a PK_JAX_ATTENTION_TRACE=ON build, the call "
                         "took a variant without the trace (fa3w3: set PK_JAX_ATTENTION_FWD_VARIANT=fa3), or it ran the "
                         "fallback")
    for cta in range(min(args.ctas, CTAS)):
        consumers = [trace[cta, r] for r in (1, 2) if (cta, r) in trace]
        for r, ev in zip((1, 2), consumers):
            print(f"  CTA {cta} warpgroup {r - 1}: {len(ev)} events")
            consumer_summary(ev)
        if (cta, 0) in trace:
            loader_summary(trace[cta, 0], consumers)
        if (cta, 3) in trace:
            storer_summary(trace[cta, 3], consumers)


if __name__ == "__main__":
    main()
