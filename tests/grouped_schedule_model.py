"""Host model of the grouped GEMM's task schedule (kernels/grouped_gemm_kernel.cuh, kernels/pk/group_table.cuh,
kernels/pk/tile_scheduler.cuh, kernels/grouped_gemm.cu), written line for line after the device code, so
CPU tests check the tile-table math of every variant (PK_JAX_GROUPED_VARIANT: dyn, narrow, n128, pipe, pair, w128,
split), and a
cost model of the static and the claimed (dyn) schedules gives the expected gain of each variant.

The emulation computes every task as the kernel does (BM x BN tile from the group's first row; the last
k-block of a weight-grad group masked; narrow tiles: only the first BN/2 columns) and stores what the kernel
stores (the group's rows, columns < n), so its output must equal ragged_dot exactly where written.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

FORWARD, INPUT_GRAD, WEIGHT_GRAD = 0, 1, 2
DYN, NARROW, N128, PIPE, PAIR, W128, SPLIT, KSLICE = 1, 2, 4, 8, 32, 64, 128, 256  # the kernel's Variant bits
BM, BK = 128, 64
SINGLE_WARPGROUP_TILE = 1.1  # a 64 x BN tile on one warpgroup, in full (two-warpgroup) tiles: cost()
BN_OF_TILE = (256, 128)  # kBn
EFFICIENCY = (1.0, 0.87)


def choose_tile(n: int, variant: int, mode: int = FORWARD) -> int:
    """grouped_gemm.cu choose_tile: 0 = 128x256, 1 = 128x128."""
    if n % 256 and n % 256 <= 128 and (mode != WEIGHT_GRAD or variant & N128):
        return 1
    costs = [math.ceil(n / bn) * bn / eff for bn, eff in zip(BN_OF_TILE, EFFICIENCY)]
    return int(np.argmin(costs))  # ties: the first (the kernel keeps the first minimum)


def balanced_group_m(workers: int, bm: int, bn: int, tiles_m: int) -> int:
    g = int(round(math.sqrt(workers * bn / bm)))  # std::lround: halves away from zero (never a half here)
    return max(1, min(tiles_m, g))


def tile_of(t: int, tiles_m: int, tiles_n: int, group_m: int) -> tuple[int, int]:
    """TileGrid::tile."""
    per_group = group_m * tiles_n
    first = (t // per_group) * group_m
    rows = min(tiles_m - first, group_m)
    r = t % per_group
    return first + r % rows, r // rows


@dataclasses.dataclass
class Table:
    """GroupTable::build."""
    start: list[int]
    tile_start: list[int]
    order: list[int]
    pair_start: list[int]

    @staticmethod
    def build(sizes, rows: int, bm: int) -> "Table":
        e = len(sizes)
        scan = np.cumsum([max(0, int(s)) for s in sizes])
        start = [min(int(scan[t - 1]) if t else 0, rows) for t in range(e + 1)] + [rows]
        tile_start = [0]
        if bm > 0:
            per = [(start[t + 1] - start[t] + bm - 1) // bm for t in range(e + 1)]
            tile_start += list(np.cumsum(per).astype(int))
        size = [start[t + 1] - start[t] for t in range(e)]
        order = sorted(range(e), key=lambda t: (-size[t], t))
        pair_start = [0]
        if bm > 0:  # pairs of a group's row tiles (built with the pair variant; harmless otherwise)
            pair_start += list(np.cumsum([(tile_start[t + 1] - tile_start[t] + 1) // 2 for t in range(e)]).astype(int))
        return Table(start, tile_start, order, pair_start)

    @staticmethod
    def _last_at_most(firsts, v: int, hi: int) -> int:
        lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if firsts[mid] <= v:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def group_of_tile(self, tile: int, num_groups: int) -> int:
        return self._last_at_most(self.tile_start, tile, num_groups)

    def group_of_pair(self, pair: int, num_groups: int) -> int:
        return self._last_at_most(self.pair_start, pair, num_groups - 1)


@dataclasses.dataclass
class Task:
    valid: bool
    group: int = 0
    row0: int = 0
    row_end: int = 0
    col0: int = 0
    k0: int = 0
    k_blocks: int = 0
    k_last: int = BK


@dataclasses.dataclass
class Launch:
    """The host's Globals (grouped_gemm.cu run) and the CTA table of one call."""
    mode: int
    tokens: int
    m: int
    n: int
    k: int
    sizes: list[int]
    variant: int = 0
    sms: int = 132

    def __post_init__(self):
        self.tile = choose_tile(self.n, self.variant, self.mode)
        if self.mode == WEIGHT_GRAD and self.variant & PIPE:  # launch(): the pipelined weight grad's tile
            self.tile = 1
        if self.variant & W128:
            self.tile = 1
        self.bn = BN_OF_TILE[self.tile]
        e = len(self.sizes)
        wgrad = self.mode == WEIGHT_GRAD
        self.tiles_m = -(-self.m // BM) if wgrad else -(-self.tokens // BM)
        self.tiles_n = -(-self.n // self.bn)
        # pair (forward): clusters of two CTAs walk pairs of a group's row tiles (dyn dropped)
        self.pair = self.mode == FORWARD and bool(self.variant & PAIR) and self.sms >= 2
        if self.pair:
            self.group_m = balanced_group_m(self.sms // 2, 2 * BM, self.bn, (self.tiles_m + 1) // 2)
            self.max_tasks = (self.tiles_m + 2 * e) // 2 * self.tiles_n
            self.workers = min(self.sms // 2, self.max_tasks)  # clusters
        else:
            self.group_m = balanced_group_m(self.sms, BM, self.bn, self.tiles_m)
            self.max_tasks = e * self.tiles_m * self.tiles_n if wgrad else (self.tiles_m + e + 1) * self.tiles_n
            self.workers = min(self.sms, self.max_tasks)
        self.table = Table.build(self.sizes, self.tokens, 0 if wgrad else BM)

    def task(self, t: int) -> Task:
        """Kernel::task_of."""
        tb, groups = self.table, len(self.sizes)
        if self.mode == WEIGHT_GRAD:
            per = self.tiles_m * self.tiles_n
            e = tb.order[t // per]
            x, y = tile_of(t % per, self.tiles_m, self.tiles_n, self.group_m)
            rows = tb.start[e + 1] - tb.start[e]
            kb = (rows + BK - 1) // BK
            return Task(True, e, x * BM, self.m, y * self.bn, tb.start[e], kb, rows - (kb - 1) * BK)
        if self.pair:
            raise ValueError("pair: tasks are pair_task(t, rank)")
        tiles = tb.tile_start[groups]  # the groups' row tiles (the tail's are the storers', zero_tiles)
        if t >= tiles * self.tiles_n:
            return Task(False)
        x, y = tile_of(t, tiles, self.tiles_n, self.group_m)
        e = tb.group_of_tile(x, groups)
        row0 = tb.start[e] + (x - tb.tile_start[e]) * BM
        return Task(True, e, row0, tb.start[e + 1], y * self.bn, 0, -(-self.k // BK))

    def pair_task(self, t: int, rank: int) -> Task:
        """Kernel::task_of with pair: CTA `rank` of the cluster's part of pair task t (a shadow stores nothing)."""
        tb, groups = self.table, len(self.sizes)
        pairs = tb.pair_start[groups]
        if t >= pairs * self.tiles_n:
            return Task(False)
        x, y = tile_of(t, pairs, self.tiles_n, self.group_m)
        e = tb.group_of_pair(x, groups)
        mine = (x - tb.pair_start[e]) * 2 + rank
        shadow = mine >= tb.tile_start[e + 1] - tb.tile_start[e]
        row0 = tb.start[e] + (mine - 1 if shadow else mine) * BM
        return Task(True, e, row0, row0 if shadow else tb.start[e + 1], y * self.bn, 0, -(-self.k // BK))

    def zero_tiles(self) -> list[Task]:
        """Kernel::store_zero_tile of every tail tile (the storers': CTA i takes i, i + CTAs, ...) as tasks
        without k-blocks."""
        if self.mode == WEIGHT_GRAD:
            return []
        tb, groups = self.table, len(self.sizes)
        count = (tb.tile_start[groups + 1] - tb.tile_start[groups]) * self.tiles_n
        return [Task(True, groups, tb.start[groups] + (z // self.tiles_n) * BM, self.tokens,
                     (z % self.tiles_n) * self.bn, 0, 0) for z in range(count)]

    def slice_rows(self, task: Task, w: int) -> int:
        return max(0, min(64, task.row_end - (task.row0 + w * 64)))

    def split(self, task: Task) -> bool:
        """Kernel::split_task: 1..64 rows on both warpgroups, half the columns each."""
        return (self.mode != WEIGHT_GRAD and bool(self.variant & SPLIT) and self.bn >= 128
                and 0 < task.row_end - task.row0 <= 64 and not self.narrow(task))

    def slice_of(self, task: Task, w: int) -> tuple[int, int, int, int]:
        """Kernel::slice_of: warpgroup w's (row0, rows, col0, width)."""
        if self.split(task):
            return task.row0, self.slice_rows(task, 0), task.col0 + w * (self.bn // 2), self.bn // 2
        return task.row0 + w * 64, self.slice_rows(task, w), task.col0, self.bn

    def narrow(self, task: Task) -> bool:
        """Kernel::narrow_task."""
        return bool(self.variant & NARROW) and self.bn >= 128 and self.n - task.col0 <= self.bn // 2

    def tasks(self) -> list[Task]:
        if self.pair:
            return [self.pair_task(t, r) for t in range(self.max_tasks) for r in (0, 1)]
        return [self.task(t) for t in range(self.max_tasks)]

    # --- cost model: a task's time in units of one full BM x BN tile of 64 k-blocks at BN 256 ---------
    def cost(self, task: Task, epilogue: float = 0.02) -> float:
        if not task.valid:
            return 0.001
        if self.mode == WEIGHT_GRAD:
            busy = 2
        else:
            busy = sum(self.slice_rows(task, w) > 0 for w in range(2))
        width = (self.bn // 2 if self.narrow(task) else self.bn) / 256 / EFFICIENCY[self.tile]
        if self.split(task):  # both warpgroups, half the columns each: half a tile's MMAs
            busy, width = 2, width / 2
        # a tile whose rows fit in one 64-row slice runs on one warpgroup: measured at SINGLE_WARPGROUP_TILE of a
        # full tile, not half (one H200, session 26: E 64 groups of 448 rows took 1.10x the 512-row time)
        mma = task.k_blocks / 64 * width * (1.0 if busy == 2 else SINGLE_WARPGROUP_TILE if busy else 0.0)
        if self.mode == WEIGHT_GRAD and self.variant & PIPE and task.k_blocks:
            return max(mma, epilogue * self.bn / 256)  # the epilogue runs under the next tile's MMAs
        return mma + epilogue * self.bn / 256

    def makespan(self, dynamic: bool | None = None) -> float:
        """Time of the launch under the static round-robin or claimed (greedy list) schedule."""
        dynamic = bool(self.variant & DYN) and not self.pair if dynamic is None else dynamic
        costs = [self.cost(t) for t in self.tasks()]
        if self.pair:  # a cluster's two CTAs walk one list in step: a pair task lasts as its longer part
            costs = [max(costs[i], costs[i + 1]) for i in range(0, len(costs), 2)]
        if not dynamic:
            return max(sum(costs[i::self.workers]) for i in range(self.workers))
        free = [0.0] * self.workers
        for c in costs:  # each task to the CTA that frees up first (the next to claim)
            heapq.heappush(free, heapq.heappop(free) + c)
        return max(free)


def emulate(launch: Launch, a: np.ndarray, b: np.ndarray, fill=np.nan) -> np.ndarray:
    """The kernel's output (float64) of one launch: a, b as the kernel's operands (forward: x (tokens, k),
    w (E, k, n); input grad: dy, w (E, n, k); weight grad: x (tokens, m), y (tokens, n)); elements no task
    stores keep `fill`."""
    e = len(launch.sizes)
    bn = launch.bn
    if launch.mode == WEIGHT_GRAD:
        out = np.full((e, launch.m, launch.n), fill)
        at = np.concatenate([a, np.zeros((BK, a.shape[1]))])  # TMA zero-fills rows past tokens
        bt = np.concatenate([b, np.zeros((BK, b.shape[1]))])
    else:
        out = np.full((launch.tokens, launch.n), fill)
        at = np.concatenate([a, np.zeros((BM, a.shape[1]))])
    written = np.zeros(out.shape, np.int32)
    for task in launch.tasks() + launch.zero_tiles():
        if not task.valid:
            continue
        width = bn // 2 if launch.narrow(task) else bn
        acc = np.zeros((BM, bn))
        if launch.mode == WEIGHT_GRAD:
            kk = task.k_blocks * BK
            av = at[task.k0:task.k0 + kk].copy()
            bv = bt[task.k0:task.k0 + kk].copy()
            if task.k_blocks:  # mask_stage: k-rows past the group's end in the last k-block
                av[(task.k_blocks - 1) * BK + task.k_last:] = 0
                bv[(task.k_blocks - 1) * BK + task.k_last:] = 0
            am = np.zeros((kk, BM))
            cols = av[:, task.row0:task.row0 + BM]
            am[:, :cols.shape[1]] = cols
            bm_ = np.zeros((kk, bn))
            cols = bv[:, task.col0:task.col0 + bn]
            bm_[:, :cols.shape[1]] = cols
            acc[:, :width] = am.T @ bm_[:, :width]
            rows_valid = min(BM, launch.m - task.row0)
            cols_valid = min(bn, launch.n - task.col0)
            out[task.group, task.row0:task.row0 + rows_valid, task.col0:task.col0 + cols_valid] = \
                acc[:rows_valid, :cols_valid]
            written[task.group, task.row0:task.row0 + rows_valid, task.col0:task.col0 + cols_valid] += 1
            continue
        if task.k_blocks:
            ar = at[task.row0:task.row0 + BM]
            if launch.mode == INPUT_GRAD:
                wb = b[task.group].T  # (k, n)
            else:
                wb = b[task.group]
            wb = np.concatenate([wb, np.zeros((wb.shape[0], bn))], axis=1)[:, task.col0:task.col0 + bn]
            acc[:, :width] = ar @ wb[:, :width]
        split = launch.split(task)
        for w in range(2):
            r0, rows, c0, wide = launch.slice_of(task, w)
            if rows == 0:
                continue
            part = acc[:64, w * wide:(w + 1) * wide] if split else acc[w * 64:w * 64 + 64, :]
            stored = rows if rows < 64 and task.row_end < launch.tokens else min(64, launch.tokens - r0)
            cols = min(wide, launch.n - c0)
            if cols <= 0:
                continue
            out[r0:r0 + stored, c0:c0 + cols] = part[:stored, :cols]
            written[r0:r0 + stored, c0:c0 + cols] += 1
    assert written.max() <= 1, "an output element stored by two tasks"
    return out


def ragged_reference(mode: int, a: np.ndarray, b: np.ndarray, sizes, tokens: int) -> np.ndarray:
    """float64 ragged_dot (forward / input grad) or its weight grad, rows past the sum zero."""
    starts = np.minimum(np.concatenate([[0], np.cumsum(sizes)]), tokens)
    if mode == WEIGHT_GRAD:
        return np.stack([a[s:t].T @ b[s:t] for s, t in zip(starts[:-1], starts[1:])])
    out = np.zeros((tokens, b.shape[1] if mode == INPUT_GRAD else b.shape[2]))
    for g, (s, t) in enumerate(zip(starts[:-1], starts[1:])):
        out[s:t] = a[s:t] @ (b[g].T if mode == INPUT_GRAD else b[g])
    return out
