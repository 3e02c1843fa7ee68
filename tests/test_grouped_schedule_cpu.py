"""The grouped GEMM's tile schedule on the CPU (tests/grouped_schedule_model.py, a line-for-line host model
of kernels/grouped_gemm_kernel.cuh and pk/group_table.cuh): every output element stored exactly once and
equal to ragged_dot, for every variant (PK_JAX_GROUPED_VARIANT bits: dyn, narrow, n128, pipe, pair, split, w128) and the odd group
sizes of the GPU tests; the task bound holds; the variant parser; the cost model's expected gains."""

from __future__ import annotations

import numpy as np
import pytest

import grouped_schedule_model as gsm
from pk_jax.moe import grouped_matmul as _gm_public  # noqa: F401 - the package import registers the primitive
import importlib

gm = importlib.import_module("pk_jax.moe.grouped_matmul")

VARIANT_BITS = [0, gsm.DYN, gsm.NARROW, gsm.N128, gsm.PIPE, gsm.DYN | gsm.NARROW, gsm.DYN | gsm.N128,
                gsm.DYN | gsm.NARROW | gsm.N128, gsm.DYN | gsm.NARROW | gsm.PIPE, gsm.PAIR, gsm.PAIR | gsm.NARROW,
                gsm.PAIR | gsm.DYN, gsm.SPLIT, gsm.SPLIT | gsm.NARROW, gsm.SPLIT | gsm.PAIR, gsm.SPLIT | gsm.W128]


def sizes_of(kind: str, m: int, e: int, rng) -> list[int]:
    if kind == "uniform":
        s = np.full(e, m // e)
        s[: m - s.sum()] += 1
    elif kind == "skewed":
        w = np.full(e, 0.2 / e)
        w[rng.choice(e, size=min(3, e), replace=False)] += 0.8 / min(3, e)
        s = rng.multinomial(m, w / w.sum())
    elif kind == "short":
        total = max(0, m - 37)
        s = np.diff(np.concatenate([[0], np.sort(rng.integers(0, total + 1, e - 1)), [total]]))
    elif kind == "tiny":
        s = rng.integers(1, 41, e)
    elif kind == "over":
        s = np.full(e, m // e + 3)
    elif kind == "empty":
        s = np.zeros(e, int)
        s[1::2] = rng.multinomial(m, np.ones(len(s[1::2])) / len(s[1::2]))
    else:
        raise ValueError(kind)
    return [int(v) for v in s]


CASES = [  # (mode, tokens, m (weight grad), k, n, E, kind)
    (gsm.FORWARD, 700, 0, 96, 360, 5, "uniform"),     # n 360: 1.4 x 256, the tail 104 <= 128 (narrow)
    (gsm.FORWARD, 900, 0, 64, 200, 7, "skewed"),      # n 200 < 256: the only column tile is narrow-able
    (gsm.FORWARD, 640, 0, 72, 136, 9, "tiny"),        # k off the 64 grid; n 136 -> 128x128 tiles + tail 8
    (gsm.FORWARD, 500, 0, 64, 384, 4, "over"),
    (gsm.FORWARD, 300, 0, 64, 520, 3, "short"),       # 520 = 2 x 256 + 8
    (gsm.FORWARD, 1000, 0, 64, 64, 8, "empty"),
    (gsm.INPUT_GRAD, 700, 0, 128, 360, 5, "skewed"),
    (gsm.INPUT_GRAD, 400, 0, 64, 1408 // 4, 6, "short"),
    (gsm.WEIGHT_GRAD, 700, 200, 0, 360, 5, "uniform"),
    (gsm.WEIGHT_GRAD, 500, 136, 0, 200, 6, "tiny"),
    (gsm.WEIGHT_GRAD, 300, 64, 0, 520, 3, "empty"),
]


@pytest.mark.parametrize("variant", VARIANT_BITS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_grouped_schedule_emulation_matches_ragged_dot(case, variant):
    mode, tokens, m, k, n, e, kind = case
    rng = np.random.default_rng(hash((case, 1)) % 2**32)
    sizes = sizes_of(kind, tokens, e, rng)
    launch = gsm.Launch(mode, tokens, m, n, k, sizes, variant)
    if mode == gsm.WEIGHT_GRAD:
        a, b = rng.standard_normal((tokens, m)), rng.standard_normal((tokens, n))
        used = min(sum(sizes), tokens)
        a[used:], b[used:] = np.nan, np.nan  # rows past the sum never reach a result
        a[used:], b[used:] = 0, 0  # (TMA reads them only past `tokens`; the mask covers the rest)
    else:
        a = rng.standard_normal((tokens, k))
        b = rng.standard_normal((e, n, k) if mode == gsm.INPUT_GRAD else (e, k, n))
    got = gsm.emulate(launch, a, b)
    want = gsm.ragged_reference(mode, a, b, sizes, tokens)
    assert np.isfinite(got).all(), "an output element no task stores"
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("variant", VARIANT_BITS)
def test_grouped_schedule_task_bound_and_narrow_tiles(variant):
    rng = np.random.default_rng(5)
    for tokens, e, n in [(16384, 64, 1408), (8192, 8, 4096), (4099, 13, 200), (3000, 256, 256)]:
        sizes = sizes_of("skewed", tokens, e, rng)
        launch = gsm.Launch(gsm.FORWARD, tokens, 0, n, 64, sizes, variant)
        tasks = launch.tasks()
        if launch.pair:  # two CTAs' parts per task
            real = 2 * launch.table.pair_start[e] * launch.tiles_n
            assert real <= 2 * launch.max_tasks
        else:
            real = launch.table.tile_start[e + 1] * launch.tiles_n
            assert real <= launch.max_tasks
        assert all(t.valid for t in tasks[:real]) and not any(t.valid for t in tasks[real:])
        narrow = [t for t in tasks if t.valid and launch.narrow(t)]
        if variant & gsm.NARROW and 0 < n % launch.bn <= launch.bn // 2:
            assert narrow and all(t.col0 == (launch.tiles_n - 1) * launch.bn for t in narrow)
        elif not variant & gsm.NARROW:
            assert not narrow


def test_grouped_pair_tasks_share_their_b_boxes():
    """pair: the two CTAs of a cluster multicast halves of one B tile to each other, so both parts of a task must
    name the same group, columns and k-blocks (and both be valid or not); a group's odd last row tile leaves the
    second CTA a shadow that stores nothing, and the first CTA always has rows."""
    rng = np.random.default_rng(7)
    for tokens, e, n in [(4099, 13, 200), (16384, 64, 1408), (3000, 256, 256), (700, 5, 360)]:
        sizes = sizes_of("skewed", tokens, e, rng)
        launch = gsm.Launch(gsm.FORWARD, tokens, 0, n, 64, sizes, gsm.PAIR | gsm.DYN)
        assert launch.pair
        tasks = launch.tasks()
        shadows = 0
        for first, second in zip(tasks[0::2], tasks[1::2]):
            assert first.valid == second.valid
            if first.valid:
                assert (first.group, first.col0, first.k_blocks) == (second.group, second.col0, second.k_blocks)
                assert first.row_end > first.row0
                shadows += second.row_end == second.row0
        tb = launch.table
        odd = sum((tb.tile_start[g + 1] - tb.tile_start[g]) % 2 for g in range(e))
        assert shadows == odd * launch.tiles_n
    # the other modes ignore the bit
    assert not gsm.Launch(gsm.INPUT_GRAD, 700, 0, 360, 64, [100] * 7, gsm.PAIR).pair


def test_grouped_schedule_tile_choice():
    # n % 256 in 1..128: 128-wide tiles for the forward and input grad; the weight grad only with n128
    assert gsm.choose_tile(1408, 0) == 1 and gsm.choose_tile(1408, 0, gsm.INPUT_GRAD) == 1
    assert gsm.choose_tile(1408, 0, gsm.WEIGHT_GRAD) == 0 and gsm.choose_tile(1408, gsm.N128, gsm.WEIGHT_GRAD) == 1
    assert gsm.choose_tile(4096, gsm.N128) == 0 and gsm.choose_tile(2048, gsm.N128) == 0
    assert gsm.choose_tile(1536 - 64, gsm.N128) == 0  # n % 256 = 192: a 256-wide tail is 3/4 full
    assert gsm.choose_tile(128, 0) == 1 and gsm.choose_tile(136, 0) == 0  # the default padding model


def test_grouped_variant_parser():
    default = gsm.SPLIT | gsm.KSLICE  # the default's bits (gm.DEFAULT_BITS)
    assert gm.DEFAULT_BITS == default == gm.VARIANT_BITS["split"] | gm.VARIANT_BITS["kslice"]
    assert gm.variant_bits(None) == default and gm.variant_bits("") == default and gm.variant_bits("default") == default
    assert gm.variant_bits("nosplit") == gsm.KSLICE and gm.variant_bits("split") == default
    assert gm.variant_bits("nosplit+nokslice") == 0 and gm.variant_bits("nokslice") == gsm.SPLIT
    assert gm.variant_bits("dyn") == gsm.DYN | default
    assert gm.variant_bits("dyn+narrow") == gsm.DYN | gsm.NARROW | default
    assert gm.variant_bits("n128, dyn") == gsm.DYN | gsm.N128 | default
    assert gm.variant_bits("dyn+narrow+pipe+nosplit") == gsm.DYN | gsm.NARROW | gsm.PIPE | gsm.KSLICE
    assert gm.variant_bits("nosplit+pair") == gsm.PAIR | gsm.KSLICE
    with pytest.raises(ValueError, match="unknown variant"):
        gm.variant_bits("fast")
    with pytest.raises(ValueError, match="unknown variant 'nodyn'"):  # only a default bit can be cleared
        gm.variant_bits("nodyn")
    for v in gm.VARIANTS:
        assert gm.variant_bits(v) != gm.DEFAULT_BITS  # each names a schedule other than the default


def test_grouped_variant_env_is_read_at_trace_time(monkeypatch):
    import jax
    import jax.numpy as jnp

    x, w, gs = jnp.ones((16, 8)), jnp.ones((2, 8, 8)), jnp.asarray([10, 6], jnp.int32)
    monkeypatch.setenv(gm.VARIANT_ENV, "dyn+narrow")
    out = jax.jit(lambda a, b, s: gm.grouped_matmul(a, b, s))(x, w, gs)  # CPU: the reference path
    np.testing.assert_allclose(np.asarray(out), 8.0)
    monkeypatch.setenv(gm.VARIANT_ENV, "bogus")
    with pytest.raises(ValueError, match="PK_JAX_GROUPED_VARIANT"):
        gm.grouped_matmul(x, w, gs)


def bench_sizes(kind: str, seed: int = 0) -> list[int]:
    """Rows per expert of `bench moe` at T 4096, E 64, top-4 (one GPU): the busiest member's counts."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((4096, 64))
    if kind == "skewed":
        scores[:, [0, 32]] += 2.0
    ids = np.argsort(-scores, axis=-1)[:, :4]
    return [int(c) for c in np.bincount(ids.reshape(-1), minlength=64)]


@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_grouped_cost_model_at_e64_f1408(kind):
    """The bench's losing shape (m 16384, k 4096, n 1408, E 64): the forward pads no column by default (11 x
    128-wide tiles), so narrow has nothing to halve there; the claimed schedule is not worse than the static one
    in the model. (The model's 10 % gain for dyn+narrow over 256-wide tiles did not happen on H200: dyn+narrow
    0.68-0.80x the default in session 9, dyn 0.91x and n128 1.06x on 2x H200 in session 24.)"""
    sizes = bench_sizes(kind)
    launch = gsm.Launch(gsm.FORWARD, 16384, 0, 1408, 4096, sizes, 0)
    assert launch.bn == 128 and launch.tiles_n * launch.bn == 1408
    assert not any(launch.narrow(t) for t in gsm.Launch(gsm.FORWARD, 16384, 0, 1408, 4096, sizes, gsm.NARROW).tasks())
    base = launch.makespan()
    times = {v: gsm.Launch(gsm.FORWARD, 16384, 0, 1408, 4096, sizes, v).makespan() for v in VARIANT_BITS}
    assert all(t <= base * 1.001 for v, t in times.items() if v & gsm.DYN and not v & gsm.PAIR)  # pair: static


def test_grouped_cost_model_reproduces_the_group_size_probe():
    """The model's static makespans against scripts/grouped_probe.py on one H200 (session 26; m 32768, k 7168,
    n 2048, E 64, forward, time relative to 512 rows per group): 448 rows per group 1.10 (every 64-row tile on
    the CTAs i = 3 mod 4 of the round-robin), groups off the 128-row grid 1.02, counts cut to multiples of 64 1.15,
    multinomial counts 1.22 (the model reaches 1.15 there: the rest is not tile counts)."""
    def rel(sizes):
        return gsm.Launch(gsm.FORWARD, 32768, 0, 2048, 7168, sizes, 0).makespan() / even

    even = gsm.Launch(gsm.FORWARD, 32768, 0, 2048, 7168, [512] * 64, 0).makespan()
    rng = np.random.default_rng(0)
    multinomial = rng.multinomial(32768, np.full(64, 1 / 64))
    assert 1.05 < rel([448] * 64) < 1.15
    assert rel([448] + [512] * 62 + [576]) < 1.03
    assert 1.05 < rel([int(c) // 64 * 64 for c in multinomial]) < 1.2
    assert 1.1 < rel([int(c) for c in multinomial]) < 1.25

