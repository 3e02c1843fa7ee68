"""scripts/attention_trace.py on CPU: its layout and event names match the kernel's (pk/clock_trace.cuh, TraceEvent in
attention_kernel.cuh), and a synthetic buffer of a known timeline decodes to it and summarizes to its step lengths."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import attention_trace  # noqa: E402


def test_layout_and_names_match_the_kernel():
    header = (ROOT / "kernels/pk/clock_trace.cuh").read_text()
    consts = dict(re.findall(r"\b(kCtas|kRoles|kEvents|kMagic)\s*=\s*(0x[0-9A-Fa-f]+|\d+)", header))
    assert {k: int(v, 0) for k, v in consts.items()} == {"kCtas": attention_trace.CTAS, "kRoles": attention_trace.ROLES,
                                                       "kEvents": attention_trace.EVENTS, "kMagic": attention_trace.MAGIC}
    kernel = (ROOT / "kernels/attention_kernel.cuh").read_text()
    enum = kernel[kernel.index("enum TraceEvent"):]
    enum = enum[:enum.index("};")]
    values, nxt = {}, 0
    for name, value in re.findall(r"(kTr\w+)(?:\s*=\s*(\d+))?", enum):
        nxt = int(value) if value else nxt
        values[name] = nxt
        nxt += 1
    snake = {name: re.sub(r"(?<!^)(?=[A-Z])", "_", name[3:]).lower() for name in values}
    script = {v: k for k, v in attention_trace.NAMES.items()}
    expected = {"task": "task", "q_ready": "q_ready", "kv_ready": "kv_ready", "issued": "issued", "s_ready": "s_ready",
                "pv_ready": "pv_ready", "finished": "finished", "loader_q_issued": "l_q_issued",
                "loader_k_issued": "l_k_issued", "loader_v_issued": "l_v_issued", "loader_task": "l_task",
                "loader_q_empty": "l_q_empty", "fin_normed": "fin_normed", "fin_slot": "fin_slot",
                "fin_stored": "fin_stored", "storer_full": "st_full", "storer_read": "st_read"}
    assert sorted(snake.values()) == sorted(expected)
    for name, value in values.items():
        assert script[expected[snake[name]]] == value, name


def _buffer(events: dict[tuple[int, int], list[tuple[int, int, int, int]]]) -> np.ndarray:
    """An LSE-shaped float32 buffer holding {(cta, role): [(clock, event, task, index), ...]} as the kernel writes it."""
    t = attention_trace
    words = np.zeros((t.CTAS, t.ROLES, t.EVENTS, 2), np.uint32)
    for (cta, role), evs in events.items():
        words[cta, role, 0] = (len(evs), t.MAGIC)
        for n, (clock, event, task, index) in enumerate(evs, start=1):
            words[cta, role, n] = (clock % (1 << 32), (event << 24) | (task << 12) | index)
    return words.reshape(-1).view(np.float32).reshape(4, -1)


def _consumer_timeline(start: int, tasks: int, blocks: int, turn: int) -> list[tuple[int, int, int, int]]:
    """One warpgroup: per task, task / q_ready / kv_ready, then per block issued / s_ready / pv_ready, one turn apart;
    block 0 also finishes the previous task (fin_normed / fin_slot / fin_stored / finished)."""
    evs, c = [], start
    for task in range(1, tasks + 1):
        evs += [(c, 1, task, 0), (c + 100, 2, task, 0), (c + 150, 3, task, 0)]
        c += 200
        for kb in range(blocks):
            if kb:
                evs.append((c - 50, 3, task, kb))
            evs += [(c, 4, task, kb), (c + 300, 5, task, kb), (c + 900, 6, task, kb)]
            if kb == 0:
                evs += [(c + 950, 14, task, 0), (c + 1000, 15, task, 0), (c + 1100, 16, task, 0), (c + 1110, 7, task, 0)]
            c += turn
    return evs


def test_decodes_and_summarizes_a_known_timeline(capsys):
    turn = 2000
    wg0 = _consumer_timeline(10_000, 5, 4, turn)
    wg1 = _consumer_timeline(11_000, 5, 4, turn)
    # The loader: each task's Q in two parts (index: the warpgroup), issued 40 / 20 cycles after that warpgroup entered
    # the task (its Q arrives 100 cycles after entering): latencies 60 and 80.
    loader = []
    for t in range(1, 6):
        start = 10_000 + (t - 1) * (200 + 4 * turn)
        loader += [(start - 500, 12, t, 0), (start - 400, 13, t, 1), (start + 1_000 + 20, 9, t, 1),
                   (start - 300, 13, t, 0), (start + 40, 9, t, 0)]
    loader.sort()
    trace = attention_trace.read_trace(_buffer({(0, 0): loader, (0, 1): wg0, (0, 2): wg1}))
    assert sorted(trace) == [(0, 0), (0, 1), (0, 2)]
    first = trace[0, 1][0]
    assert first[1:] == ("task", 1, 0) and trace[0, 1][1][0] - first[0] == 100
    attention_trace.consumer_summary(trace[0, 1])
    out = capsys.readouterr().out
    steady = {m[0].strip(): int(m[1]) for m in re.findall(r"steady  (.+?)\s+(-?\d+)$", out, re.M)}
    assert steady["issued -> s_ready"] == 300 and steady["s_ready -> pv_ready"] == 600
    assert steady["turn (issued -> next issued)"] == turn
    finish = {m[0].strip(): int(m[1]) for m in re.findall(r"switch    finish: (.+?)\s+(-?\d+)$", out, re.M)}
    assert finish == {"pv_ready 0 -> O /= l, LSE": 50, "-> slot free": 50, "-> stmatrix, fence, arrive": 100}
    # A task is 4 turns plus 200 cycles of task / Q / K steps: 0.10 turns.
    assert "= 4 turns x 2000 + 200 (0.10 turns" in out
    attention_trace.loader_summary(trace[0, 0], [trace[0, 1], trace[0, 2]])
    out = capsys.readouterr().out
    assert re.search(r"waits for a Q slot\s+-?\d+ cycles after the task began; Q issued -> a waiting consumer has it\s+70 "
                     r"\(6 waits\)", out), out
