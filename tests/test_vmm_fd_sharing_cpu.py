"""Sharing XLA's virtual-memory region by POSIX fd (ffi/vmm_share.h), the host logic without a GPU: the
walk over contiguous chunks around the probe pointer (on a fake driver given as a list of mappings) and
the region descriptor the peers decode. The fd exchange itself runs between real processes in
tests/test_distributed_cpu.py; the driver calls need a GPU (tests/launch_scripts/gpu_ranks.py)."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

import pk_jax
from pk_jax import _ext

if not pk_jax.extension_available():
    pytest.skip("CUDA extension not built", allow_module_level=True)
ext = _ext.ext

G = 2 << 20  # granularity
BASE = 0x7F00_0000_0000


def chunks_at(start, sizes, why=None):
    """Contiguous mappings from `start`: [(base, size, why_not_shareable)]."""
    out, at = [], start
    for i, s in enumerate(sizes):
        out.append((at, s, (why or {}).get(i, "")))
        at += s
    return out


def walk(ptr, max_bytes, maps, alignment=G):
    return ext.vmm_walk_chunks(ptr, max_bytes, alignment, maps)


def test_cap_zero_takes_only_the_probes_chunk():
    maps = chunks_at(BASE, [4 * G, 8 * G, 2 * G])
    assert walk(BASE + 4 * G + 123, 0, maps) == (BASE + 4 * G, 8 * G, [(0, 8 * G)], "")


def test_walks_contiguous_chunks_both_ways():
    maps = chunks_at(BASE, [4 * G, 8 * G, 2 * G])
    begin, size, chunks, why = walk(BASE + 5 * G, 1 << 40, maps)
    assert why == "" and begin == BASE and size == 14 * G
    assert chunks == [(0, 4 * G), (4 * G, 8 * G), (12 * G, 2 * G)]


def test_cap_takes_forward_chunks_first():
    maps = chunks_at(BASE, [4 * G, 8 * G, 2 * G])
    # 10 G: the probe's 8 G chunk and the 2 G one after it fit; the 4 G one before does not.
    assert walk(BASE + 4 * G, 10 * G, maps) == (BASE + 4 * G, 10 * G, [(0, 8 * G), (8 * G, 2 * G)], "")
    # A cap below the probe's own chunk still shares that chunk (nothing around it).
    assert walk(BASE + 4 * G, G, maps) == (BASE + 4 * G, 8 * G, [(0, 8 * G)], "")


def test_walk_stops_at_a_gap_a_foreign_chunk_or_a_misaligned_one():
    gap = chunks_at(BASE, [2 * G]) + chunks_at(BASE + 3 * G, [2 * G]) + chunks_at(BASE + 5 * G, [2 * G])
    assert walk(BASE + 3 * G, 1 << 40, gap) == (BASE + 3 * G, 4 * G, [(0, 2 * G), (2 * G, 2 * G)], "")
    foreign = chunks_at(BASE, [2 * G, 2 * G, 2 * G], why={0: "lives on device 1", 2: "no POSIX-fd handles"})
    assert walk(BASE + 2 * G, 1 << 40, foreign) == (BASE + 2 * G, 2 * G, [(0, 2 * G)], "")
    odd = chunks_at(BASE, [2 * G, G // 2])
    assert walk(BASE, 1 << 40, odd) == (BASE, 2 * G, [(0, 2 * G)], "")


def test_walk_refusals_name_the_reason():
    maps = chunks_at(BASE, [2 * G], why={0: "was not created with POSIX-fd handles"})
    assert walk(BASE, 1 << 40, maps)[3] == "was not created with POSIX-fd handles"
    assert "no virtual-memory mapping holds" in walk(BASE - 1, 1 << 40, maps)[3]
    assert "not aligned to the granularity" in walk(BASE + G // 4, 0, chunks_at(BASE + G // 4, [G]))[3]
    assert walk(BASE, 0, [])[:3] == (0, 0, [])


def test_walk_stops_at_the_chunk_limit():
    n = ext.vmm_max_chunks
    maps = chunks_at(BASE, [G] * (n + 10))
    begin, size, chunks, why = walk(BASE, 1 << 40, maps, alignment=G)
    assert why == "" and begin == BASE and len(chunks) == n and size == n * G


def test_descriptor_round_trip():
    text = ext.vmm_encode_descriptor(10 * G, G, [(0, 8 * G), (8 * G, 2 * G)])
    assert text == f"pk_jax-vmm/1 size={10 * G} align={G} chunks=0+{8 * G},{8 * G}+{2 * G}"
    assert ext.vmm_decode_descriptor(text) == (10 * G, G, [(0, 8 * G), (8 * G, 2 * G)])
    assert ext.vmm_is_descriptor(text.encode())
    assert not ext.vmm_is_descriptor(bytes(64))  # a legacy IPC handle


@pytest.mark.parametrize("text, defect", [
    ("pk_jax-vmm/2 size=4 align=2 chunks=0+4", "does not start with"),
    ("pk_jax-vmm/1 size=4 align=2", "expected ' chunks='"),
    ("pk_jax-vmm/1 size=4 align=2 chunks=", "expected a number for chunk offset"),
    ("pk_jax-vmm/1 size=4 align=2 chunks=0+2,4+2", "not contiguous"),
    ("pk_jax-vmm/1 size=4 align=2 chunks=0+0", "is empty"),
    ("pk_jax-vmm/1 size=4 align=0 chunks=0+4", "multiple of the alignment"),
    ("pk_jax-vmm/1 size=6 align=4 chunks=0+6", "multiple of the alignment"),
    ("pk_jax-vmm/1 size=8 align=2 chunks=0+4", "cover 4 bytes, not the region's 8"),
    ("pk_jax-vmm/1 size=4 align=2 chunks=0+4 ", "expected ','"),
    ("pk_jax-vmm/1 size=99999999999999999999 align=2 chunks=0+4", "overflows"),
])
def test_descriptor_defects_are_named(text, defect):
    with pytest.raises(RuntimeError, match="malformed virtual-memory region descriptor: .*" + re.escape(defect)):
        ext.vmm_decode_descriptor(text)


def test_descriptor_chunk_limit():
    n = ext.vmm_max_chunks + 1
    text = ext.vmm_encode_descriptor(n * G, G, [(i * G, G) for i in range(n)])
    with pytest.raises(RuntimeError, match="more than"):
        ext.vmm_decode_descriptor(text)


class _DictKV:
    """jax.distributed's key-value store for ranks run as threads of this process."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def put(self, key, value):
        with self.cond:
            self.values[key] = value
            self.cond.notify_all()

    def get(self, key, timeout):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.values, timeout):
                raise TimeoutError(key)
            return self.values[key]


class _SocketsOnly:
    """The native calls exchange_fds makes: the real job directory and endpoints."""

    def fd_create_job_dir(self):
        return ext.fd_create_job_dir()

    def fd_endpoint(self, job_dir, index, pids):
        return ext.FdEndpoint(job_dir, index, list(pids))


def _two_ranks(monkeypatch, tmp_path, sent, announced, label=(10, 11), timeout=5.0):
    """Ranks 0 and 1 (threads) exchange fds of files: rank r owns device 10 + r, sends `sent[r]` chunks
    labelled as device `label[r]`'s and announces `announced[r]` chunks to the other. Returns per rank
    ({key: file content}, error)."""
    from pk_jax import _fd_exchange, distributed

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    kv = _DictKV()
    monkeypatch.setattr(distributed._kv, "put", kv.put)
    monkeypatch.setattr(distributed._kv, "get", kv.get)
    plan = distributed.DomainPlan((0, 0), (0, 1), {10: 0, 11: 1}, {10: 0, 11: 1}, 1)
    results = [None, None]

    def rank(r):
        fds = []
        for c in range(sent[r]):
            path = tmp_path / f"chunk-{r}-{c}"
            path.write_text(f"rank{r}/chunk{c}")
            fds.append(os.open(path, os.O_RDONLY))
        try:
            got = _fd_exchange.exchange_fds(_SocketsOnly(), plan, r, {label[r]: [fds, []]},
                                            {11 - r: {"chunks": [announced[1 - r], 0]}}, timeout, "t/")
            results[r] = ({k: os.pread(fd, 64, 0).decode() for k, fd in got.items()}, None)
            _fd_exchange.close_fds(got.values())
        except Exception as e:  # noqa: BLE001
            results[r] = (None, e)
        finally:
            _fd_exchange.close_fds(fds)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    _fd_exchange.remove_job_dir()
    return results


def test_exchange_fds_between_two_ranks(monkeypatch, tmp_path):
    (got0, err0), (got1, err1) = _two_ranks(monkeypatch, tmp_path, sent=[2, 1], announced=[2, 1])
    assert err0 is None and err1 is None
    assert got0 == {(11, 0, 0): "rank1/chunk0"}
    assert got1 == {(10, 0, 0): "rank0/chunk0", (10, 0, 1): "rank0/chunk1"}
    assert not [p for p in os.listdir(tmp_path) if p.startswith("pk_jax-")], "the job directory was left behind"


def test_exchange_fds_rejects_an_fd_nobody_announced(monkeypatch, tmp_path):
    # Rank 1 labels its chunk as device 12's, which no rank announced: rank 0 refuses it, naming it.
    (_, err0), (got1, err1) = _two_ranks(monkeypatch, tmp_path, sent=[1, 1], announced=[1, 1], label=(10, 12),
                                         timeout=2.0)
    assert isinstance(err0, RuntimeError) and "unexpected or repeated fd for (12, 0, 0)" in str(err0)
    assert err1 is None and got1 == {(10, 0, 0): "rank0/chunk0"}


def test_exchange_fds_wait_for_a_missing_chunk_is_bounded(monkeypatch, tmp_path):
    # Rank 1 announced 2 chunks but sends 1: rank 0 gives up after its timeout instead of hanging.
    t0 = time.monotonic()
    (_, err0), _ = _two_ranks(monkeypatch, tmp_path, sent=[1, 1], announced=[1, 2], timeout=1.0)
    assert isinstance(err0, RuntimeError) and "no message from a job peer within 1000 ms" in str(err0)
    assert time.monotonic() - t0 < 10
