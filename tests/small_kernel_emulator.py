"""NumPy model of the small-message kernels (kernels/small_collectives.cu) and their LL protocol.

Each member is a generator that runs its ops in stream order and yields whenever it would spin on a
line; a scheduler interleaves the members at random, so one member runs up to an op ahead of another
exactly as on GPUs. Byte offsets, 16-bit halves of odd sizes, the two-shot chunk mapping, the LL
areas ll[parity][sender][line] with epoch flags and the per-peer epochs ll_seq follow the kernels, so
CPU tests check the index math and the parity argument (a writer at most one op ahead never
overwrites lines its reader has yet to read) against NumPy references.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import numpy as np

MASK32 = 0xFFFFFFFF
MASK28 = 0x0FFFFFFF
OP_CODES = {"all_gather": 1, "reduce_scatter": 2, "all_reduce_one_shot": 3, "all_reduce_two_shot": 3}  # OpCode


def ll_flag(epoch: int, kind: str) -> int:
    """pk/ll.cuh ll_flag: the pair's epoch (low 28 bits) over the op code (4 bits)."""
    return ((epoch & MASK28) << 4) | OP_CODES[kind]


class OpMismatch(RuntimeError):
    """A receiver saw its epoch with another op code on a line: the members' op sequences diverged."""


@dataclasses.dataclass
class Member:
    """One GPU's control-block state of the small path, indexed by device slot (ll[parity][sender
    slot][line], ll_seq[peer slot]); `group` is the number of devices (slots)."""

    lines: int
    group: int

    def __post_init__(self) -> None:
        self.ll = np.zeros((2, self.group, self.lines), np.uint64)
        self.ll_seq = [0] * self.group


def load_word(buf: bytes, off: int, end: int) -> int:
    """kernels' load_word: 4 bytes at `off`, or 16-bit halves at 2 (mod 4) / a half word at the end."""
    lo = int.from_bytes(buf[off:off + 2], "little")
    hi = int.from_bytes(buf[off + 2:off + 4], "little") if off + 2 < end else 0
    return lo | (hi << 16)


def store_word(buf: bytearray, off: int, end: int, w: int) -> None:
    buf[off:off + 2] = (w & 0xFFFF).to_bytes(2, "little")
    if off + 2 < end:
        buf[off + 2:off + 4] = (w >> 16).to_bytes(2, "little")


def add_word(acc: list[float], w: int, dtype: np.dtype) -> None:
    """Float32 accumulation of a word's 1 (f32) or 2 (16-bit) elements, as add_word<T>."""
    vals = np.frombuffer(w.to_bytes(4, "little"), dtype).astype(np.float32)
    for k, v in enumerate(vals):
        acc[k] = np.float32(acc[k] + v)


def pack_word(acc: list[float], dtype: np.dtype) -> int:
    n = 4 // dtype.itemsize
    return int.from_bytes(np.asarray(acc[:n], np.float32).astype(dtype).tobytes(), "little")


class Op:
    """One small op on every member of its group: kind in all_reduce_one_shot / all_reduce_two_shot /
    all_gather / reduce_scatter; xs[r] the bytes of rank r's input; slots[r] the device of rank r
    (default: rank r is device r), as Group::slot maps ranks to control-block slots."""

    def __init__(self, kind: str, xs: list[bytes], dtype: np.dtype, slots: list[int] | None = None):
        self.kind, self.xs, self.dtype = kind, xs, np.dtype(dtype)
        self.g = len(xs)
        self.slots = list(range(self.g)) if slots is None else list(slots)
        assert len(self.slots) == self.g and len(set(self.slots)) == self.g
        n = len(xs[0])
        self.payload = n // self.g if kind == "reduce_scatter" else n  # bytes per receiver (`bytes` arg)
        self.out_bytes = n * self.g if kind == "all_gather" else self.payload
        self.outs = [bytearray(b"\xa5" * self.out_bytes) for _ in range(self.g)]


WAITING, PROGRESS = 0, 1


def run_member(members: list[Member], device: int, ops: list[Op], violations: list[str]) -> Iterator[int]:
    """Device `device` runs the `ops` it is a member of, in order; yields WAITING while spinning on a
    line, PROGRESS elsewhere. Areas and epochs are by slot, index math by rank, as in the kernels."""
    mine = members[device]
    for op in ops:
        if device not in op.slots:
            continue
        g, slot, me = op.g, op.slots, op.slots.index(device)
        epoch = [mine.ll_seq[slot[r]] + 1 for r in range(g)]  # prologue: epochs by peer
        flag = [ll_flag(e, op.kind) for e in epoch]
        x = op.xs[me]
        y = op.outs[me]

        def send(r: int, line: int, w: int) -> None:
            area = members[slot[r]].ll[epoch[r] & 1, device]
            old = int(area[line])
            # The peer must have consumed the line's previous content (two ops back) already: a writer
            # at most one op ahead never meets an unread line. Unread = epoch one behind ours on it.
            if old >> 36 == (epoch[r] - 2) & MASK28 and members[slot[r]].ll_seq[device] < epoch[r] - 2:
                violations.append(f"device {device} overwrote unread line {line} of device {slot[r]}")
            area[line] = np.uint64((flag[r] << 32) | w)

        def receive(r: int, line: int):
            area = mine.ll[epoch[r] & 1, slot[r]]
            while (got := int(area[line]) >> 32) != flag[r]:
                if got >> 4 == flag[r] >> 4:  # ll_wait: this epoch, another op
                    raise OpMismatch(f"device {device} ran {op.kind} while device {slot[r]} ran op code {got & 15}")
                yield WAITING
            return int(area[line]) & MASK32

        n = op.payload
        words = -(-n // 4)
        if op.kind in ("all_reduce_one_shot", "all_gather"):
            for i in range(words):
                for p in range(1, g):
                    send((me + p) % g, i, load_word(x, 4 * i, n))
                yield PROGRESS
        if op.kind == "reduce_scatter":
            for i in range(words):
                for p in range(1, g):
                    r = (me + p) % g
                    send(r, i, load_word(x, r * n + 4 * i, (r + 1) * n))
                yield PROGRESS
        if op.kind in ("all_reduce_one_shot", "reduce_scatter"):
            x_off = me * n if op.kind == "reduce_scatter" else 0
            for i in range(words):
                acc = [0.0, 0.0]
                for r in range(g):
                    w = load_word(x, x_off + 4 * i, x_off + n) if r == me else (yield from receive(r, i))
                    add_word(acc, w, op.dtype)
                store_word(y, 4 * i, n, pack_word(acc, op.dtype))
        if op.kind == "all_gather":
            for j in range(words * g):
                s, i = divmod(j, words)
                w = load_word(x, 4 * i, n) if s == me else (yield from receive(s, i))
                store_word(y, s * n + 4 * i, (s + 1) * n, w)
        if op.kind == "all_reduce_two_shot":
            chunk = words // g
            assert chunk * g == words, "two-shot needs words divisible by the group (launch_small refuses)"
            others = [j if j < me * chunk else j + chunk for j in range(words - chunk)]
            for i in others:
                send(i // chunk, i, load_word(x, 4 * i, n))
                yield PROGRESS
            for i in range(me * chunk, (me + 1) * chunk):
                acc = [0.0, 0.0]
                for r in range(g):
                    w = load_word(x, 4 * i, n) if r == me else (yield from receive(r, i))
                    add_word(acc, w, op.dtype)
                w = pack_word(acc, op.dtype)
                for p in range(1, g):
                    send((me + p) % g, i, w)
                store_word(y, 4 * i, n, w)
            for i in others:
                store_word(y, 4 * i, n, (yield from receive(i // chunk, i)))
        for r in range(g):  # finish: the last CTA advances the epochs
            if r != me:
                mine.ll_seq[slot[r]] += 1


def run(ops: list[Op] | list[list[Op]], lines: int, seed: int) -> list[str]:
    """Runs `ops` (each on its group's devices) on every device under a random interleaving; a list of
    lists gives each device its own sequence (a member that diverged). Returns protocol violations
    (none expected); raises OpMismatch when a receiver sees another op, RuntimeError on deadlock."""
    per_device = ops if ops and isinstance(ops[0], list) else None
    g = len(per_device) if per_device else max(max(op.slots) for op in ops) + 1  # devices
    members = [Member(lines, g) for _ in range(g)]
    violations: list[str] = []
    gens = {r: run_member(members, r, per_device[r] if per_device else ops, violations) for r in range(g)}
    rng = random.Random(seed)
    speed = [rng.random() + 0.05 for _ in range(g)]  # some members run far ahead of others
    idle = 0  # consecutive steps in which the scheduled member was spinning
    while gens:
        r = rng.choices(list(gens), weights=[speed[k] for k in gens])[0]
        try:
            idle = idle + 1 if next(gens[r]) == WAITING else 0
        except StopIteration:
            del gens[r]
            idle = 0
        if idle > 2000 * g:  # every member has been scheduled many times and all only spun
            raise RuntimeError("small-path model deadlocked: every member waits for a line that never comes")
    return violations


def reference(op: Op) -> list[bytes]:
    """What every member's output must hold: float32 rank-order sums (bits) or the concatenation."""
    g, dt = op.g, op.dtype
    arrs = [np.frombuffer(x, dt) for x in op.xs]
    if op.kind == "all_gather":
        out = np.concatenate(arrs)
        return [out.tobytes()] * g
    if op.kind == "reduce_scatter":
        m = arrs[0].size // g
        res = []
        for r in range(g):
            acc = np.zeros(m, np.float32)
            for a in arrs:
                acc = (acc + a[r * m:(r + 1) * m].astype(np.float32)).astype(np.float32)
            res.append(acc.astype(dt).tobytes())
        return res
    acc = np.zeros(arrs[0].size, np.float32)
    for a in arrs:
        acc = (acc + a.astype(np.float32)).astype(np.float32)
    return [acc.astype(dt).tobytes()] * g
