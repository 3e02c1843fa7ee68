"""The pipelined all_reduce (algorithm="small_pipelined") on CPU: its schedule's index math
(pk_jax/_pipelined_schedule.py, the mirror of kernels/pk/pipelined_schedule.h, checked against the
extension's own computation where it is built), the protocol in the NumPy model under random
interleavings of members, CTAs and signal warps (tests/small_kernel_emulator.py), and the API's
choice, errors and fallback semantics."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _ext, _small_path
from pk_jax import _pipelined_schedule as sched

import small_kernel_emulator as emu
from small_choice import assert_choice

NP_DTYPES = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)]
KNOBS = [sched.Knobs(), sched.Knobs(rounds=4, lag=2), sched.Knobs(rounds=3, lag=1, min_chunk=16),
         sched.Knobs(rounds=16, lag=15, min_chunk=32, max_ctas=3), sched.Knobs(rounds=4, lag=0, shots=2, min_chunk=16),
         sched.Knobs(rounds=2, lag=5, shots=1, min_chunk=48), sched.Knobs(rounds=99, lag=-3, max_ctas=0, min_chunk=1)]
SIZES = [1, 2, 4, 6, 16, 18, 100, 4096, 4098, 65534, (1 << 20) + 6, 8 << 20]


def _geometries():
    for n, g, k, sms in itertools.product(SIZES, [2, 3, 4, 8], KNOBS, [1, 7, 132]):
        if n % 2 == 0 or n == 1:
            yield n, g, k, sms, sched.geometry(n, g, sms, k)


def test_chunks_tile_every_slice_once():
    """Chunk k of a slice covers [k Q, (k+1) Q) clipped to the slice: over k < C the chunks are disjoint,
    in order and cover the slice (the slices, x), whatever the size, group and knobs."""
    for n, g, k, sms, geo in _geometries():
        owners = range(g) if geo.two_shot else [0]
        covered = []
        for o in owners:
            ranges = [geo.chunk_range(o, c) for c in range(geo.chunks)]
            covered += [r for r in ranges if r[0] < r[1]]
            assert all(a[1] == b[0] or b[0] == b[1] for a, b in zip(ranges, ranges[1:])), (n, g, k)
        flat = [v for a, b in covered for v in range(a, b)] if geo.vecs < 5000 else None
        if flat is not None:
            assert flat == list(range(geo.vecs)), (n, g, k, sms)
        assert sum(b - a for a, b in covered) == geo.vecs == -(-n // 16)


def test_geometry_limits():
    """CTAs: at most one per SM, at most max_ctas, flags within the area; rounds and lag within their
    caps; chunks of at least min_chunk bytes unless one CTA and one round hold all of a slice."""
    four = sched.Knobs(rounds=4, lag=2)  # the defaults before 2026-11-27
    assert sched.geometry(1 << 20, 2, 132, four) == sched.Geometry(65536, 65536, 256, 64, 4, 2, False)
    assert sched.geometry(8 << 20, 2, 132, four) == sched.Geometry(524288, 524288, 993, 132, 4, 2, False)
    assert sched.geometry(8 << 20, 8, 132, four).ctas == 64  # two-shot: 1 MiB slices
    assert sched.geometry(8 << 20, 2, 132, sched.Knobs(rounds=4, lag=2, shots=2)).ctas == 128  # 2 x 128 x 4 flags
    # the defaults: one round, two-shot from G = 3, 4 KiB chunks at least
    assert sched.geometry(1 << 20, 4, 132) == sched.Geometry(65536, 16384, 256, 64, 1, 0, True)
    assert sched.geometry(8 << 20, 4, 132) == sched.Geometry(524288, 131072, 993, 132, 1, 0, True)
    for n, g, k, sms, geo in _geometries():
        assert 1 <= geo.ctas <= min(sms, max(k.max_ctas, 1)), (n, g, k, sms, geo)
        assert geo.stages * geo.chunks <= sched.FLAG_AREA
        assert 1 <= geo.rounds <= min(max(k.rounds, 1), sched.MAX_ROUNDS) and 0 <= geo.lag <= sched.MAX_LAG
        assert geo.two_shot == (k.shots == 2 or (k.shots != 1 and g > 2))
        assert geo.chunk * geo.chunks >= geo.slice
        if geo.chunks > 1:
            assert geo.chunk >= max(k.min_chunk // 16, 1), (n, g, k, sms, geo)


def test_release_points_announce_every_chunk_once_in_order():
    """Each (stage, round) is announced by exactly one release point; an iteration passes its points in
    increasing order; a round's stage-1 point comes at or before the iteration that sums it, and its
    stage-2 point before the iteration that copies it (so no wait depends on a later point: no deadlock
    at any lag, lag 0 included)."""
    for _, _, _, _, geo in _geometries():
        seen = [geo.released_by(rp) for rp in range(geo.release_points)]
        announced = [s for s in seen if s[1] >= 0]
        assert sorted(announced) == sorted({(s, r) for s in range(geo.stages) for r in range(geo.rounds)})
        assert len(announced) == len(set(announced))
        passed = [p for i in range(geo.iters) for p in (geo.release_point(i, 0), geo.release_point(i, 1)) if p >= 0]
        assert passed == list(range(geo.release_points))
        for rnd in range(geo.rounds):
            rp1 = next(rp for rp, s in enumerate(seen) if s == (0, rnd))
            assert rp1 <= geo.release_point(rnd + geo.lag, 0) or not geo.two_shot and rp1 == rnd
            if geo.two_shot:
                rp2 = next(rp for rp, s in enumerate(seen) if s == (1, rnd))
                assert rp2 == geo.release_point(rnd + geo.lag, 1)


@pytest.mark.skipif(not _ext.available(), reason="the extension (its C++ schedule) is not built")
def test_python_schedule_matches_the_kernels():
    """pk_jax/_pipelined_schedule.geometry == kernels/pk/pipelined_schedule.h pipelined_geometry (the
    extension's `pipelined_geometry`), for every size, group, knob set and SM count above."""
    for n, g, k, sms, geo in _geometries():
        cpp = _ext.ext.pipelined_geometry(n, g, sms, k.rounds, k.min_chunk, k.max_ctas, k.lag, k.shots)
        assert cpp == (geo.vecs, geo.slice, geo.chunk, geo.ctas, geo.rounds, geo.lag, int(geo.two_shot)), (n, g, k, sms)


def test_knobs_from_env_clamp_like_the_kernel(monkeypatch):
    for name in ("ROUNDS", "MIN_CHUNK", "MAX_CTAS", "LAG", "SHOTS"):
        monkeypatch.delenv(f"PK_JAX_AR_PIPELINED_{name}", raising=False)
    assert sched.knobs_from_env() == sched.Knobs()
    monkeypatch.setenv("PK_JAX_AR_PIPELINED_ROUNDS", "40")
    monkeypatch.setenv("PK_JAX_AR_PIPELINED_MIN_CHUNK", "8")
    monkeypatch.setenv("PK_JAX_AR_PIPELINED_LAG", "-1")
    monkeypatch.setenv("PK_JAX_AR_PIPELINED_SHOTS", "2x")
    monkeypatch.setenv("PK_JAX_AR_PIPELINED_MAX_CTAS", "")
    assert sched.knobs_from_env() == sched.Knobs(rounds=16, min_chunk=16, lag=0, shots=2, max_ctas=1024)


def _inputs(g: int, elems: int, dtype: np.dtype, rng: np.random.Generator) -> list[bytes]:
    return [rng.standard_normal(elems).astype(np.float32).astype(dtype).tobytes() for _ in range(g)]


@pytest.mark.parametrize("g", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", NP_DTYPES, ids=lambda d: d.name)
def test_model_matches_reference_under_random_schedules(g, dtype):
    """Pipelined all_reduces of odd sizes (partial last vectors, 16-bit tails), every schedule shape
    (one- and two-shot, lag 0 .. past the rounds, batches of release points of any size, stores landing
    early), between LL ops that shift the parities: every output equals the rank-order float32 reference
    bit for bit, no writer touches an area or flag its reader has yet to finish with, no deadlock."""
    rng = np.random.default_rng(g * 10 + dtype.itemsize)
    knobs = [sched.Knobs(rounds=3, lag=1, min_chunk=16), sched.Knobs(rounds=2, lag=0, min_chunk=32, shots=2),
             sched.Knobs(rounds=4, lag=5, min_chunk=16, shots=1), sched.Knobs(rounds=1, lag=2, min_chunk=64)]
    ops = []
    for i, (elems, k) in enumerate(zip([1, 37, 200, 9, 130, 3], itertools.cycle(knobs))):
        geo = sched.geometry(elems * dtype.itemsize, g, 3, k)
        ops.append(emu.Op("all_reduce_pipelined", _inputs(g, elems, dtype, rng), dtype, geo=geo))
        if i % 2:
            ops.append(emu.Op("all_reduce_one_shot", _inputs(g, 5, dtype, rng), dtype))
    emu.check_interleaved(ops, range(3))


def test_model_groups_of_different_axes_interleave():
    """Rows, columns and the whole of a 2 x 2 mesh (ranks not in slot order) run pipelined all_reduces
    (one- and two-shot) between LL ops: per-pair epochs keep each pair's parity right."""
    dtype = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(5)
    rows, cols, mesh = [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[2, 0, 3, 1]]
    k = sched.Knobs(rounds=2, lag=1, min_chunk=16)
    ops = []
    for groups, kind, elems in [(rows, "all_reduce_pipelined", 70), (cols, "all_gather", 5),
                                (mesh, "all_reduce_pipelined", 45), (rows, "all_reduce_one_shot", 9),
                                (cols, "all_reduce_pipelined", 33), (mesh, "all_reduce_pipelined", 8)]:
        for grp in groups:
            geo = sched.geometry(elems * 2, len(grp), 2, k) if kind == "all_reduce_pipelined" else None
            ops.append(emu.Op(kind, _inputs(len(grp), elems, dtype, rng), dtype, slots=grp, geo=geo))
    for seed in range(3):
        for op in ops:
            op.outs = [bytearray(b"\xa5" * op.out_bytes) for _ in range(op.g)]
        assert emu.run(ops, lines=32, seed=seed) == []
        for op in ops:
            want = emu.reference(op)
            for r in range(op.g):
                assert bytes(op.outs[r]) == want[r], f"{op.kind} on {op.slots} rank {r} seed {seed}"


def test_model_catches_a_flag_before_its_fence():
    """The model is strict enough to matter: signal warps that set flags without fencing first (their
    stores land only at the end of the op) make receivers sum stale bytes, which the bit comparison sees."""
    dtype = np.dtype(np.float32)
    rng = np.random.default_rng(1)
    geo = sched.geometry(4 * 64, 2, 2, sched.Knobs(rounds=2, lag=1, min_chunk=64))
    op = emu.Op("all_reduce_pipelined", _inputs(2, 64, dtype, rng), dtype, geo=geo)
    assert emu.run([op], lines=16, seed=0, fence=False) == []
    assert any(bytes(op.outs[r]) != emu.reference(op)[r] for r in range(2))


# ---------------------------------------------------------------- API
def _variant(fn, shape, dtype=jnp.bfloat16, g=8):
    mesh = Mesh(np.array(jax.devices()[:g]), ("x",))
    f = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    jaxpr = jax.make_jaxpr(f)(jax.ShapeDtypeStruct(shape, dtype)).jaxpr
    found = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "pk_collective":
                found.append(e.params["spec"].variant)
            for v in e.params.values():
                inner = getattr(v, "jaxpr", v)
                if hasattr(inner, "eqns"):
                    walk(inner)
    walk(jaxpr)
    assert len(found) == 1
    return found[0]


def test_forced_small_pipelined_lowers_to_its_variant():
    pipe = _small_path.VARIANT_SMALL_PIPELINED
    assert pipe == 5 and _small_path.ALL_REDUCE_VARIANTS["small_pipelined"] == pipe
    for shape in [(8 * 1, 2), (8 * 5, 3), (8 * 4096, 1024)]:  # 4 B .. 8 MiB of bf16 per member
        assert _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="small_pipelined"), shape) == pipe


@pytest.mark.parametrize("nbytes,g,mode,want", [
    (512 << 10, 2, "1", "small_pipelined"),
    ((512 << 10) - 2, 2, "1", "small_one_shot"),
    (1 << 20, 2, "1", "small_pipelined"),
    (8 << 20, 2, "1", "small_pipelined"),
    ((8 << 20) + 16, 2, "1", None),
    (8 << 20, 8, "1", "small_pipelined"),  # two-shot: 14 MiB sent, as the bulk two-shot
    (1 << 20, 2, None, "small_chunked"),  # default "auto": not at G = 2 (one-shot, the chunk flags again)
    (512 << 10, 2, None, "small_one_shot"),
    (1 << 20, 4, None, "small_pipelined"),  # ... but from G = 3 (two-shot)
    (512 << 10, 3, "auto", "small_pipelined"),  # words not divisible by 3: no LL two-shot
    (512 << 10, 4, None, "small_two_shot"),  # the LL two-shot stays first where it serves
    ((512 << 10) + 8, 4, None, "small_pipelined"),  # in the chunk flags' place
    ((512 << 10) - 8, 4, None, "small_chunked"),
    (1 << 20, 4, "0", "small_chunked"),
])
def test_pipelined_choice_by_group_and_env(monkeypatch, nbytes, g, mode, want):
    monkeypatch.setenv("PK_JAX_AR_LL128", "0")  # G = 2 rows: the ladder below the LL128 lines
    assert_choice(monkeypatch, "PK_JAX_AR_PIPELINED", mode, nbytes, g, want)


def test_auto_and_small_take_pipelined_under_the_env(monkeypatch):
    monkeypatch.setenv("PK_JAX_SMALL_PATH", "1")
    monkeypatch.setenv("PK_JAX_AR_LL128", "0")  # G = 2 rows: the ladder below the LL128 lines
    monkeypatch.setenv("PK_JAX_AR_PIPELINED", "1")
    pipe = _small_path.VARIANT_SMALL_PIPELINED
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (2 * 512, 512), g=2) == pipe          # 512 KiB
    assert _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="small"), (2 * 4096, 1024), g=2) == pipe  # 8 MiB
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (2 * 4, 1024), g=2) == _small_path.VARIANT_SMALL  # 8 KiB
    monkeypatch.setenv("PK_JAX_AR_PIPELINED", "0")
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (2 * 1024, 512), g=2) == _small_path.VARIANT_SMALL_CHUNKED
    monkeypatch.delenv("PK_JAX_AR_PIPELINED")  # the default takes it from G = 3
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (4 * 1024, 512), g=4) == pipe
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (2 * 1024, 512), g=2) == _small_path.VARIANT_SMALL_CHUNKED
    monkeypatch.setenv("PK_JAX_AR_PIPELINED", "yes")
    with pytest.raises(ValueError, match="PK_JAX_AR_PIPELINED"):
        _small_path.all_reduce_choice(1 << 20, 4, auto=True)


def test_small_pipelined_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"algorithm='small_pipelined' serves 1..8388608 bytes; x has 16777216\. "
                                         r"Use 'auto'"):
        _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="small_pipelined"), (8 * 8192, 1024))
    with pytest.raises(ValueError, match="'small_pipelined'"):  # the list of choices names it
        _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="pipelined"), (8, 4))


def test_small_pipelined_keeps_fallback_semantics():
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    x = jax.random.normal(jax.random.key(9), (8 * 5, 3), jnp.float32).astype(jnp.bfloat16)

    def run(fn):
        return np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P(),
                                                check_vma=False))(x).astype(jnp.float32))

    np.testing.assert_allclose(run(lambda v: pk_jax.all_reduce(v, "x", algorithm="small_pipelined")),
                               run(lambda v: jax.lax.psum(v, "x")), rtol=1e-2, atol=1e-2)
