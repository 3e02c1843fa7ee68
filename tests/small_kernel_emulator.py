"""NumPy model of the small-message kernels (kernels/small_collectives.cu) and their LL protocol.

Each member is a generator that runs its ops in stream order and yields whenever it would spin on a
line; a scheduler interleaves the members at random, so one member runs up to an op ahead of another
exactly as on GPUs. Byte offsets, 16-bit halves of odd sizes, the two-shot chunk mapping, the LL
areas ll[parity][sender][line] with epoch flags and the per-peer epochs ll_seq follow the kernels, so
CPU tests check the index math and the parity argument (a writer at most one op ahead never
overwrites lines its reader has yet to read) against NumPy references.

The pipelined all_reduce ("all_reduce_pipelined", kernels/small_pipelined.cu) runs its schedule from
pk_jax/_pipelined_schedule.py (the kernel's index math, mirrored) on the chunk areas
chunk_data[parity][sender] and chunk_flag[parity][sender][i]: per CTA a data coroutine and a signal
coroutine, interleaved at random inside the member. A data store stays invisible to the receiver until
its CTA's signal coroutine fences a release point after it (or at random earlier: stores may land early,
never late), so a receiver that read before the flag, or a flag set before its stores' fence, shows up
as wrong bits.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import numpy as np

from pk_jax import _pipelined_schedule as sched

FLAG_AREA = sched.FLAG_AREA

MASK32 = 0xFFFFFFFF
MASK28 = 0x0FFFFFFF
OP_CODES = {"all_gather": 1, "reduce_scatter": 2, "all_reduce_one_shot": 3, "all_reduce_two_shot": 3,
            "all_reduce_pipelined": 13}  # OpCode (13: kOpAllReducePipelined, the pipelined flags' code)


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
    area: int = 4096  # chunk_data bytes per (parity, sender) (kChunkedBytes on GPUs)

    def __post_init__(self) -> None:
        self.ll = np.zeros((2, self.group, self.lines), np.uint64)
        self.ll_seq = [0] * self.group
        self.chunk_data = np.zeros((2, self.group, self.area), np.uint8)
        self.chunk_flag = np.zeros((2, self.group, FLAG_AREA), np.int64)


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

    def __init__(self, kind: str, xs: list[bytes], dtype: np.dtype, slots: list[int] | None = None,
                 geo: sched.Geometry | None = None):
        self.kind, self.xs, self.dtype, self.geo = kind, xs, np.dtype(dtype), geo
        assert (kind == "all_reduce_pipelined") == (geo is not None), "the pipelined op takes its geometry"
        self.g = len(xs)
        self.slots = list(range(self.g)) if slots is None else list(slots)
        assert len(self.slots) == self.g and len(set(self.slots)) == self.g
        n = len(xs[0])
        self.payload = n // self.g if kind == "reduce_scatter" else n  # bytes per receiver (`bytes` arg)
        self.out_bytes = n * self.g if kind == "all_gather" else self.payload
        self.outs = [bytearray(b"\xa5" * self.out_bytes) for _ in range(self.g)]


WAITING, PROGRESS = 0, 1


def run_member(members: list[Member], device: int, ops: list[Op], violations: list[str],
               rng: random.Random | None = None, fence: bool = True) -> Iterator[int]:
    """Device `device` runs the `ops` it is a member of, in order; yields WAITING while spinning on a
    line, PROGRESS elsewhere. Areas and epochs are by slot, index math by rank, as in the kernels."""
    rng = rng or random.Random(device)
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
        if op.kind == "all_reduce_pipelined":
            yield from run_pipelined(members, device, op, epoch, flag, violations, rng, fence)
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


def run(ops: list[Op] | list[list[Op]], lines: int, seed: int, fence: bool = True) -> list[str]:
    """Runs `ops` (each on its group's devices) on every device under a random interleaving; a list of
    lists gives each device its own sequence (a member that diverged). fence=False: the pipelined op's
    signal warps set flags without fencing (a broken kernel, to show the model catches it). Returns protocol violations
    (none expected); raises OpMismatch when a receiver sees another op, RuntimeError on deadlock."""
    per_device = ops if ops and isinstance(ops[0], list) else None
    g = len(per_device) if per_device else max(max(op.slots) for op in ops) + 1  # devices
    members = [Member(lines, g) for _ in range(g)]
    violations: list[str] = []
    gens = {r: run_member(members, r, per_device[r] if per_device else ops, violations, random.Random(seed * 31 + r),
                          fence) for r in range(g)}
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


@dataclasses.dataclass
class _Cta:
    """One CTA of the pipelined kernel: release points its data warps passed, and their stores not yet
    visible (tag = the release point that covers them, receiver device, parity, offset, bytes)."""

    passed: int = 0
    pending: list[tuple[int, int, int, int, bytes]] = dataclasses.field(default_factory=list)


def run_pipelined(members: list[Member], device: int, op: Op, epoch: list[int], flag: list[int],
                  violations: list[str], rng: random.Random, fence: bool = True) -> Iterator[int]:
    """kernels/small_pipelined.cu on one member: its CTAs' data and signal warps as coroutines, with the
    index math of op.geo (pk_jax/_pipelined_schedule.py); the caller advances the epochs after it.
    fence=False: flags without the fence (stores land only at the end of the op)."""
    mine, geo, g, slot = members[device], op.geo, op.g, op.slots
    me, n, x, y = slot.index(device), op.payload, op.xs[slot.index(device)], op.outs[slot.index(device)]
    par = [e & 1 for e in epoch]
    ctas = [_Cta() for _ in range(geo.ctas)]
    span = lambda v0, v1: (min(16 * v0, n), min(16 * v1, n))  # bytes of vectors [v0, v1); the last one partial

    def check_receiver(r: int, what: str) -> None:
        # Parity: the receiver finished the op two back with us before we write this parity again.
        if r != me and members[slot[r]].ll_seq[device] < epoch[r] - 2:
            violations.append(f"device {device} wrote {what} into device {slot[r]} before it finished op {epoch[r] - 2}")

    def store(cta: _Cta, r: int, b0: int, b1: int, data: bytes) -> None:
        check_receiver(r, f"bytes {b0}..{b1}")
        cta.pending.append((cta.passed, slot[r], par[r], b0, data[:b1 - b0]))

    def commit(item: tuple[int, int, int, int, bytes]) -> None:
        _, dev, p, b0, data = item
        members[dev].chunk_data[p, device, b0:b0 + len(data)] = np.frombuffer(data, np.uint8)

    def wait_flag(r: int, idx: int) -> Iterator[int]:
        while (got := int(mine.chunk_flag[par[r], slot[r], idx])) != flag[r]:
            if got >> 4 == flag[r] >> 4:
                raise OpMismatch(f"device {device} ran {op.kind} while device {slot[r]} ran op code {got & 15}")
            yield WAITING

    def area_in(r: int, b0: int, b1: int) -> bytes:
        return mine.chunk_data[par[r], slot[r], b0:b1].tobytes()

    def data(b: int) -> Iterator[int]:
        cta = ctas[b]

        def release(rp: int) -> None:
            if rp >= 0:
                assert rp == cta.passed, "release points are passed in order"
                cta.passed += 1

        for i in range(geo.iters):
            if i < geo.rounds:  # stage 1: this round's chunk to the peers (one-shot) / to its owners (two-shot)
                k = geo.chunk_id(b, i)
                for q in range(1, g):
                    o = (me + q) % g
                    b0, b1 = span(*geo.chunk_range(o if geo.two_shot else 0, k))
                    store(cta, o, b0, b1, x[b0:b1])
            release(geo.release_point(i, 0))
            yield PROGRESS
            j = i - geo.lag
            if 0 <= j < geo.rounds:
                k = geo.chunk_id(b, j)
                for r in range(g):
                    if r != me:
                        yield from wait_flag(r, geo.flag_index(0, k))
                b0, b1 = span(*geo.chunk_range(me if geo.two_shot else 0, k))
                acc = np.zeros((b1 - b0) // op.dtype.itemsize, np.float32)
                for r in range(g):
                    part = x[b0:b1] if r == me else area_in(r, b0, b1)
                    acc = (acc + np.frombuffer(part, op.dtype).astype(np.float32)).astype(np.float32)
                out = acc.astype(op.dtype).tobytes()
                y[b0:b1] = out
                if geo.two_shot:  # stage 2: the owner's sums to every peer
                    for q in range(1, g):
                        store(cta, (me + q) % g, b0, b1, out)
            release(geo.release_point(i, 1))
            yield PROGRESS
            h = i - 2 * geo.lag
            if geo.two_shot and 0 <= h < geo.rounds:
                k = geo.chunk_id(b, h)
                for q in range(1, g):
                    o = (me + q) % g
                    yield from wait_flag(o, geo.flag_index(1, k))
                    b0, b1 = span(*geo.chunk_range(o, k))
                    y[b0:b1] = area_in(o, b0, b1)

    def signal(b: int) -> Iterator[int]:
        cta, nxt = ctas[b], 0
        while nxt < geo.release_points:
            while cta.passed <= nxt:
                yield WAITING
            last = rng.randint(nxt, cta.passed - 1)  # any batch of the points already passed
            if fence:
                for item in [p for p in cta.pending if p[0] <= last]:  # the fence: those stores are visible
                    commit(item)
                cta.pending = [p for p in cta.pending if p[0] > last]
            for rp in range(nxt, last + 1):
                stage, rnd = geo.released_by(rp)
                if rnd < 0:
                    continue
                for r in range(g):
                    if r != me:
                        check_receiver(r, f"flag {geo.flag_index(stage, geo.chunk_id(b, rnd))}")
                        members[slot[r]].chunk_flag[par[r], device, geo.flag_index(stage, geo.chunk_id(b, rnd))] = flag[r]
            nxt = last + 1
            yield PROGRESS

    gens = [data(b) for b in range(geo.ctas)] + [signal(b) for b in range(geo.ctas)]
    while gens:
        if fence and rng.random() < 0.2:  # a store may land before its fence (never after it)
            waiting = [c for c in ctas if c.pending]
            if waiting:
                c = rng.choice(waiting)
                commit(c.pending.pop(rng.randrange(len(c.pending))))
        progressed = False
        for k in rng.sample(range(len(gens)), len(gens)):
            try:
                if next(gens[k]) == PROGRESS:
                    progressed = True
                    break
            except StopIteration:
                gens.pop(k)
                progressed = True
                break
        yield PROGRESS if progressed else WAITING
    if not fence:  # the broken kernel's stores land late
        for c in ctas:
            for item in c.pending:
                commit(item)
            c.pending = []
    assert all(not c.pending for c in ctas), "every store is covered by a release point"


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


def check_interleaved(ops: list[Op], seeds: range, lines: int = 32) -> None:
    """Runs `ops` (interleaved on their devices) once per seed, outputs poisoned first, and asserts every member's
    output equals the reference bit for bit and no protocol violation was seen."""
    for seed in seeds:
        for op in ops:
            op.outs = [bytearray(b"\xa5" * op.out_bytes) for _ in range(op.g)]
        assert run(ops, lines=lines, seed=seed) == []
        for op in ops:
            want = reference(op)
            for r in range(op.g):
                assert bytes(op.outs[r]) == want[r], f"{op.kind} on devices {op.slots} rank {r} seed {seed}"
