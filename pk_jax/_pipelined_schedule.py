"""The chunk / round / flag schedule of the pipelined all_reduce (algorithm="small_pipelined").

A line-for-line mirror of kernels/pk/pipelined_schedule.h, which the kernel (kernels/small_pipelined.cu)
uses: tests/test_small_pipelined_cpu.py checks that both give the same geometry (through the extension's
`pipelined_geometry`, where it is built) and runs this schedule in the NumPy model of the protocol
(tests/small_kernel_emulator.py). Units are 16-byte vectors of x: V = ceil(n / 16), the last partial when
n % 16 != 0.

one-shot (G = 2 by default): one slice (all of x); every member pushes it to every peer and sums all G.
two-shot (G > 2 by default): G slices of S = ceil(V / G) vectors; member o owns slice o: the others push
  their slice-o chunks to o (stage 1), o sums them and pushes the sums to every peer (stage 2).
Bytes each member sends: one-shot (G - 1) n, two-shot 2 (G - 1) / G n (less from G = 3; equal at G = 2,
where one-shot saves the second trip).
"""

from __future__ import annotations

import dataclasses
import os
import re

MAX_ROUNDS = 16
MAX_LAG = 15
FLAG_AREA = 1024        # kChunkedMaxChunks: flags per (parity, sender)
AREA_BYTES = 8 << 20    # kChunkedBytes: the largest x


@dataclasses.dataclass(frozen=True)
class Knobs:
    """PK_JAX_AR_PIPELINED_ROUNDS / _MIN_CHUNK (bytes) / _MAX_CTAS / _LAG / _SHOTS (1 one-shot, 2 two-shot,
    0 by group size); clamped by geometry() as by the kernel."""

    rounds: int = 1  # kernels/pk/pipelined_schedule.h: one fence per stage and round, so one round
    min_chunk: int = 4096
    max_ctas: int = 1024
    lag: int = 0
    shots: int = 0


def _env_int(name: str, fallback: int, lo: int, hi: int) -> int:
    """kernels/pk/env.h env_or: unset or empty gives `fallback`, else the value clamped to [lo, hi]."""
    v = os.environ.get(name, "")
    if not v:
        return fallback
    m = re.match(r"\s*([+-]?\d+)", v)  # atoll: the leading integer, 0 if none
    return min(max(int(m.group(1)) if m else 0, lo), hi)


def knobs_from_env() -> Knobs:
    """The knobs a launch in this process uses (kernels/small_pipelined.cu pipelined_knobs)."""
    d = Knobs()
    return Knobs(rounds=_env_int("PK_JAX_AR_PIPELINED_ROUNDS", d.rounds, 1, MAX_ROUNDS),
                 min_chunk=_env_int("PK_JAX_AR_PIPELINED_MIN_CHUNK", d.min_chunk, 16, AREA_BYTES),
                 max_ctas=_env_int("PK_JAX_AR_PIPELINED_MAX_CTAS", d.max_ctas, 1, FLAG_AREA),
                 lag=_env_int("PK_JAX_AR_PIPELINED_LAG", d.lag, 0, MAX_LAG),
                 shots=_env_int("PK_JAX_AR_PIPELINED_SHOTS", d.shots, 0, 2))


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _clamp(v: int, lo: int, hi: int) -> int:
    return min(max(v, lo), hi)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """PipelinedGeometry: vecs V, slice S, chunk Q (vectors), ctas, rounds, lag, two_shot."""

    vecs: int
    slice: int
    chunk: int
    ctas: int
    rounds: int
    lag: int
    two_shot: bool

    @property
    def chunks(self) -> int:
        """C: chunks per slice (ctas x rounds); stage 1 flags 0..C-1, stage 2 flags C..2C-1."""
        return self.ctas * self.rounds

    @property
    def stages(self) -> int:
        return 2 if self.two_shot else 1

    @property
    def iters(self) -> int:
        """Iterations of a CTA's data loop."""
        return self.rounds + self.lag * self.stages

    @property
    def release_points(self) -> int:
        return 2 * (self.rounds + self.lag) if self.two_shot else self.rounds

    def release_point(self, i: int, part: int) -> int:
        """Iteration i's release point after its pushes (part 0) or its sum (part 1, two-shot); -1: none."""
        if not self.two_shot:
            return i if part == 0 and i < self.rounds else -1
        return 2 * i + part if i < self.rounds + self.lag else -1

    def released_by(self, rp: int) -> tuple[int, int]:
        """(stage, round) whose chunk's flags release point rp sets; round -1: none."""
        stage = rp % 2 if self.two_shot else 0
        rnd = rp // 2 - stage * self.lag if self.two_shot else rp
        return stage, (rnd if 0 <= rnd < self.rounds else -1)

    def chunk_id(self, cta: int, rnd: int) -> int:
        return rnd * self.ctas + cta

    def flag_index(self, stage: int, k: int) -> int:
        return stage * self.chunks + k

    def chunk_range(self, owner: int, k: int) -> tuple[int, int]:
        """[v0, v1) of chunk k of owner's slice (owner 0 in one-shot); empty past the end."""
        base = owner * self.slice if self.two_shot else 0
        end = min(base + self.slice, self.vecs)
        b = base + k * self.chunk
        return min(b, end), min(b + self.chunk, end)


def geometry(nbytes: int, group: int, num_sms: int, knobs: Knobs = Knobs()) -> Geometry:
    """kernels/pk/pipelined_schedule.h pipelined_geometry: as many CTAs as `rounds` rounds of whole
    min_chunk-byte chunks fill, at most one per SM and within the flag area, then as many rounds (up to
    `rounds`) as keep chunks at min_chunk bytes or more; one CTA and one round below min_chunk."""
    vecs = _ceil_div(nbytes, 16)
    two_shot = knobs.shots == 2 or (knobs.shots != 1 and group > 2)
    slice_ = _ceil_div(vecs, group) if two_shot else vecs
    lag = _clamp(knobs.lag, 0, MAX_LAG)
    rounds = _clamp(knobs.rounds, 1, MAX_ROUNDS)
    min_vecs = _clamp(knobs.min_chunk // 16, 1, 1 << 40)
    cap = min(_clamp(knobs.max_ctas, 1, FLAG_AREA), num_sms)
    cap = _clamp(min(cap, FLAG_AREA // ((2 if two_shot else 1) * rounds)), 1, FLAG_AREA)
    ctas = _clamp(slice_ // (rounds * min_vecs), 1, cap)
    rounds = _clamp(slice_ // (ctas * min_vecs), 1, rounds)
    chunk = max(_ceil_div(slice_, ctas * rounds), 1)
    return Geometry(vecs, slice_, chunk, ctas, rounds, lag, two_shot)


def send_bytes(nbytes: int, group: int, two_shot: bool) -> int:
    """Payload bytes one member stores into its peers per op."""
    return 2 * (group - 1) * nbytes // group if two_shot else (group - 1) * nbytes
