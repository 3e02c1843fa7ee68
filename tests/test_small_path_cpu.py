"""The small-message path on CPU: its kernels' index math and LL protocol in a NumPy model under
random interleavings (tests/small_kernel_emulator.py), the trace-time choice of path by size and
group, errors that name the fix, and the fallback semantics of algorithm="small"."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pk_jax
from pk_jax import _small_path

import small_kernel_emulator as emu
from small_choice import assert_choice

ROOT = pathlib.Path(__file__).resolve().parents[1]
NP_DTYPES = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)]


def _inputs(kind: str, g: int, elems: int, dtype: np.dtype, rng: np.random.Generator) -> list[bytes]:
    total = elems * g if kind == "reduce_scatter" else elems
    return [rng.standard_normal(total).astype(np.float32).astype(dtype).tobytes() for _ in range(g)]


@pytest.mark.parametrize("g", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", NP_DTYPES, ids=lambda d: d.name)
def test_model_matches_reference_under_random_schedules(g, dtype):
    """A sequence of mixed small ops (so parities and epochs cycle) on every member, members running
    at random relative speeds: every output equals the rank-order float32 reference bit for bit,
    no writer overwrites an unread line, no deadlock."""
    rng = np.random.default_rng(g * 100 + dtype.itemsize)
    per_word = 4 // dtype.itemsize
    ops = []
    for k, elems in enumerate([1, 3, 7, 16, 33]):  # odd element counts: half words, 2 (mod 4) offsets
        kinds = ["all_reduce_one_shot", "all_gather", "reduce_scatter"]
        if (-(-elems // per_word)) % g == 0:
            kinds.append("all_reduce_two_shot")
        kind = kinds[k % len(kinds)]
        ops.append(emu.Op(kind, _inputs(kind, g, elems, dtype, rng), dtype))
    two_shot_elems = g * 8 * per_word  # 8 words per chunk
    ops.append(emu.Op("all_reduce_two_shot", _inputs("all_reduce_two_shot", g, two_shot_elems, dtype, rng), dtype))
    ops.append(emu.Op("all_reduce_one_shot", _inputs("all_reduce_one_shot", g, 5, dtype, rng), dtype))
    for seed in range(3):
        for op in ops:
            op.outs = [bytearray(b"\xa5" * op.out_bytes) for _ in range(g)]
        violations = emu.run(ops, lines=64, seed=seed)
        assert violations == []
        for op in ops:
            want = emu.reference(op)
            for r in range(g):
                assert bytes(op.outs[r]) == want[r], f"{op.kind} member {r} seed {seed}"


@pytest.mark.parametrize("seed", range(4))
def test_model_diverged_members_fail_instead_of_mixing_ops(seed):
    """Member 1 skips an all_gather and runs the all_reduce that member 0 reaches next (the multirank
    'skip' fault): the LL flag carries the op code, so whichever member reads first sees this epoch with
    the other op's code and fails (the kernel records kOpMismatch) instead of taking its payload."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(np.float32)
    xs = _inputs("all_gather", 2, 16, dt, rng)
    gather_first = emu.Op("all_gather", xs, dt)
    reduce_next = emu.Op("all_reduce_one_shot", xs, dt)
    with pytest.raises(emu.OpMismatch, match="all_gather while device 1 ran op code 3|all_reduce_one_shot while device 0 ran op code 1"):
        emu.run([[gather_first, reduce_next], [reduce_next]], lines=64, seed=seed)


def test_model_groups_of_different_axes_interleave():
    """A 2 x 2 mesh: row groups, column groups and the whole mesh (ranks not in slot order, as
    Group::slot allows) run small ops in one program order. Epochs are per device pair, so each pair's
    parity alternates only with the ops that pair shares: outputs still match bit for bit, no unread
    line is overwritten, nothing deadlocks."""
    dtype = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(7)
    rows, cols, mesh = [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[2, 0, 3, 1]]
    steps = [(rows, "all_reduce_one_shot", 7), (cols, "all_gather", 5), (mesh, "all_reduce_two_shot", 16),
             (rows, "reduce_scatter", 3), (mesh, "all_reduce_one_shot", 9), (cols, "all_reduce_two_shot", 8),
             (rows, "all_gather", 4), (cols, "reduce_scatter", 6), (mesh, "all_gather", 3)]
    ops = [emu.Op(kind, _inputs(kind, len(grp), elems, dtype, rng), dtype, slots=grp)
           for groups, kind, elems in steps for grp in groups]
    emu.check_interleaved(ops, range(4))


def test_small_max_bytes_matches_control_block():
    text = (ROOT / "kernels/pk/control_block.h").read_text()
    shift = int(re.search(r"kLLLines = 1 << (\d+);", text).group(1))
    assert _small_path.SMALL_MAX_BYTES == 4 << shift


@pytest.mark.parametrize("nbytes,g,want", [
    (4, 2, "small_one_shot"),
    (512 << 10, 2, "small_one_shot"),
    ((512 << 10) + 4, 2, "small_chunked"),  # past the LL limit: plain stores + chunk flags
    (1 << 20, 2, "small_chunked"),
    ((1 << 20) + 4, 2, "small_chunked"),   # above the LL area, inside the chunk-flag one
    (8 << 20, 2, "small_chunked"),
    ((8 << 20) + 16, 2, None),             # above the chunk-flag area: bulk
    (64 << 10, 8, "small_one_shot"),       # 7 x 64 KiB sent
    (256 << 10, 8, "small_two_shot"),      # 7 x 256 KiB too much for one-shot; 2 x 7/8 x 256 KiB fits
    (1 << 20, 8, "small_chunked"),         # two-shot would send 1.75 MiB; 7 MiB by chunk flags
    ((256 << 10) + 4, 8, "small_chunked"),  # words not divisible by 8: no two-shot
    (2 << 20, 8, None),                    # 14 MiB to send: bulk
    (6, 4, "small_one_shot"),              # 2 words (3 bf16): one-shot only
])
def test_auto_all_reduce_choice(monkeypatch, nbytes, g, want):
    """The ladder below the pipelined chunk flags and the LL128 lines (off here; the others by group in
    tests/test_small_pipelined_cpu.py and test_ll128_choice_by_group_and_env)."""
    monkeypatch.setenv("PK_JAX_AR_PIPELINED", "0")
    monkeypatch.setenv("PK_JAX_AR_LL128", "0")
    assert _small_path.all_reduce_choice(nbytes, g, auto=True) == want


def _collective_variants(jaxpr) -> list[int]:
    """`variant` of every pk_collective equation, looking inside nested jaxprs (shard_map's body)."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == "pk_collective":
            found.append(e.params["spec"].variant)
        for v in e.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                found += _collective_variants(inner)
    return found


def _variant(fn, shape, dtype=jnp.bfloat16):
    """The variant the API chose for fn over 8 members, x of global `shape` sharded along dim 0."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    f = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    found = _collective_variants(jax.make_jaxpr(f)(jax.ShapeDtypeStruct(shape, dtype)).jaxpr)
    assert len(found) == 1
    return found[0]


def test_auto_keeps_the_bulk_path_when_the_small_one_is_off(monkeypatch):
    monkeypatch.setenv("PK_JAX_SMALL_PATH", "0")
    monkeypatch.delenv("PK_JAX_AR_LL128", raising=False)
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (8 * 4, 1024)) == 0
    assert _variant(lambda v: pk_jax.all_gather(v, "x", tiled=True), (8 * 4, 64)) == 0
    assert _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="small"), (8 * 4, 1024)) == \
        _small_path.VARIANT_SMALL_LL128


def test_api_picks_small_path_by_size(monkeypatch):
    monkeypatch.delenv("PK_JAX_SMALL_PATH", raising=False)  # on by default
    monkeypatch.delenv("PK_JAX_AR_LL128", raising=False)
    # 8 members, bf16: per-device shapes are the global ones / 8 along dim 0.
    ll128 = _small_path.VARIANT_SMALL_LL128  # all_reduce's first pick up to ll128_auto_max_bytes
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (8 * 4, 1024)) == ll128          # 8 KiB
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (8 * 1024, 1024)) == ll128       # 2 MiB
    monkeypatch.setenv("PK_JAX_AR_LL128", "0")  # the ladder below it
    small, two, bulk = _small_path.VARIANT_SMALL, _small_path.VARIANT_SMALL_TWO_SHOT, 0
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (8 * 4, 1024)) == small            # 8 KiB
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (8 * 128, 1024)) == two            # 256 KiB
    pipe = _small_path.VARIANT_SMALL_PIPELINED  # from 512 KiB at G >= 3 (the chunk flags' two-shot)
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (8 * 1024, 1024)) == pipe          # 2 MiB
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (8 * 512, 1024)) == pipe           # 1 MiB
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (8 * 8192, 1024)) == 1             # 16 MiB: bulk two-shot
    assert _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="small_chunked"), (8 * 4, 1024)) == \
        _small_path.VARIANT_SMALL_CHUNKED
    assert _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="one_shot"), (8 * 4, 1024)) == bulk
    assert _variant(lambda v: pk_jax.all_gather(v, "x", tiled=True), (8 * 4, 64)) == small
    assert _variant(lambda v: pk_jax.all_gather(v, "x", axis=1, tiled=True), (8 * 4, 64)) == bulk  # not contiguous
    assert _variant(lambda v: pk_jax.all_gather(v, "x", tiled=True, algorithm="bulk"), (8 * 4, 64)) == bulk
    assert _variant(lambda v: pk_jax.reduce_scatter(v, "x", tiled=True), (8 * 16, 64)) == small
    assert _variant(lambda v: pk_jax.reduce_scatter(v, "x", scatter_dimension=1, tiled=True), (8 * 16, 64)) == bulk


def test_small_path_errors_name_the_fix():
    with pytest.raises(ValueError, match="algorithm='small' serves"):
        _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="small"), (8 * 8192, 1024))  # 16 MiB
    with pytest.raises(ValueError, match="algorithm='small_one_shot' serves 1..1048576 bytes"):
        _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="small_one_shot"), (8 * 1024, 1024))  # 2 MiB
    with pytest.raises(ValueError, match="divisible by the group size 8"):
        _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="small_two_shot"), (8, 3))
    with pytest.raises(ValueError, match="not contiguous"):
        _variant(lambda v: pk_jax.all_gather(v, "x", axis=1, tiled=True, algorithm="small"), (8 * 4, 64))
    with pytest.raises(ValueError, match="use 'auto', 'small' or 'bulk'"):
        _variant(lambda v: pk_jax.reduce_scatter(v, "x", tiled=True, algorithm="fast"), (8 * 16, 64))


def test_small_algorithms_keep_fallback_semantics():
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))

    def run(fn, x, out_spec):
        return np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=out_spec,
                                                check_vma=False))(x).astype(jnp.float32))

    x = jax.random.normal(jax.random.key(3), (8 * 5, 3), jnp.float32).astype(jnp.bfloat16)
    for algorithm in ("small", "small_chunked"):
        np.testing.assert_allclose(run(lambda v: pk_jax.all_reduce(v, "x", algorithm=algorithm), x, P()),
                                   run(lambda v: jax.lax.psum(v, "x"), x, P()), rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(run(lambda v: pk_jax.all_gather(v, "x", tiled=True, algorithm="small"), x, P()),
                                  run(lambda v: jax.lax.all_gather(v, "x", tiled=True), x, P()))
    x = jax.random.normal(jax.random.key(4), (8 * 8, 3), jnp.float32).astype(jnp.float16)  # 8 rows per device
    np.testing.assert_allclose(
        run(lambda v: pk_jax.reduce_scatter(v, "x", tiled=True, algorithm="small"), x, P("x")),
        run(lambda v: jax.lax.psum_scatter(v, "x", tiled=True), x, P("x")), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("nbytes,g,mode,want", [
    (4, 2, None, "small_ll128"),                # default "auto": at every G from 1 byte ...
    (1 << 20, 2, None, "small_ll128"),
    (8 << 20, 2, None, "small_ll128"),          # ... to every size the path serves at G = 2
    ((8 << 20) + 4, 2, None, None),             # then the bulk path
    (4096, 4, None, "small_ll128"),             # ... to LL128_AUTO_MAX_BYTES from G = 3
    (2 << 20, 4, None, "small_ll128"),
    ((2 << 20) + 8, 4, None, "small_pipelined"),  # from G = 3 the pipelined chunk flags (they lead at 8 MiB)
    (1 << 20, 8, None, "small_ll128"),
    (1 << 20, 2, "0", "small_chunked"),
    (8 << 20, 2, "1", "small_ll128"),           # "1": first wherever it serves, at any G
    (1 << 20, 8, "1", "small_ll128"),
    ((8 << 20) + 16, 2, "1", None),
])
def test_ll128_choice_by_group_and_env(monkeypatch, nbytes, g, mode, want):
    monkeypatch.delenv("PK_JAX_AR_PIPELINED", raising=False)
    assert_choice(monkeypatch, "PK_JAX_AR_LL128", mode, nbytes, g, want)
    assert all(_small_path.ll128_auto_max_bytes(g) <= _small_path.CHUNKED_MAX_BYTES for g in range(2, 9))



def test_ll128_all_reduce_lowers_to_its_variant_and_follows_its_env(monkeypatch):
    """algorithm="small_ll128" lowers to variant 6 from 4 B to 8 MiB and refuses more, naming the fix; auto and "small"
    take it first at any G under PK_JAX_AR_LL128=1, and the variable accepts only auto / 0 / 1."""
    ll = _small_path.VARIANT_SMALL_LL128
    assert ll == 6 and _small_path.ALL_REDUCE_VARIANTS["small_ll128"] == ll
    for shape in [(8 * 1, 2), (8 * 5, 3), (8 * 4096, 1024)]:  # 4 B .. 8 MiB of bf16 per member
        assert _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="small_ll128"), shape) == ll
    with pytest.raises(ValueError, match=r"algorithm='small_ll128' serves 1..8388608 bytes; x has 16777216\. "):
        _variant(lambda v: pk_jax.all_reduce(v, "x", algorithm="small_ll128"), (8 * 8192, 1024))
    for var in ("PK_JAX_AR_PIPELINED", "PK_JAX_SMALL_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PK_JAX_AR_LL128", "0")
    assert _small_path.all_reduce_choice(1 << 20, 2, auto=True) == "small_chunked"
    monkeypatch.setenv("PK_JAX_AR_LL128", "1")
    for nbytes, g in [(4, 2), (1 << 20, 2), (8 << 20, 2), (1 << 20, 8)]:
        assert _small_path.all_reduce_choice(nbytes, g, auto=True) == "small_ll128"
    assert _small_path.all_reduce_choice((8 << 20) + 16, 2, auto=True) is None
    assert _variant(lambda v: pk_jax.all_reduce(v, "x"), (8 * 4, 1024)) == ll
    monkeypatch.setenv("PK_JAX_AR_LL128", "yes")
    with pytest.raises(ValueError, match="PK_JAX_AR_LL128"):
        _small_path.all_reduce_choice(1 << 20, 2, auto=True)


def test_auto_leaves_ll128_out_where_ranks_share_a_gpu(monkeypatch):
    """Ranks sharing one GPU (the MPS test mode) do not get LL128 from auto or "small" (line atomicity is an NVLink
    property); a forced "small_ll128" and PK_JAX_AR_LL128=1 still run it there."""
    from pk_jax import distributed

    for var in ("PK_JAX_AR_LL128", "PK_JAX_AR_PIPELINED"):
        monkeypatch.delenv(var, raising=False)
    assert _small_path.all_reduce_choice(64 << 10, 2, auto=True) == "small_ll128"
    monkeypatch.setattr(distributed, "shares_gpu", lambda: True)
    assert not _small_path.ll128_lines_whole()
    assert _small_path.all_reduce_choice(64 << 10, 2, auto=True) == "small_one_shot"
    assert _small_path.all_reduce_choice(1 << 20, 2, auto=False) == "small_chunked"
    monkeypatch.setenv("PK_JAX_AR_LL128", "1")
    assert _small_path.all_reduce_choice(64 << 10, 2, auto=True) == "small_ll128"
