"""pk_jax.initialize()'s start-up exchange, run by real CPU processes over jax.distributed's key-value
store with a fake native runtime (tests/mp_scripts/init_exchange.py): the domain plan, which peers get
mapped, and that every region's address delta is where the peer process mapped it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pk_jax.distributed import plan_domain

SCRIPT = Path(__file__).parent / "mp_scripts" / "init_exchange.py"
ROOT = Path(__file__).parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, hosts: list[str], pcis: list[str], gpus_per_process: int = 1, **env_extra) -> list[dict]:
    port, n = _free_port(), len(hosts)
    procs = []
    for r in range(n):
        env = dict(os.environ, PK_JAX_HOST_KEY=hosts[r], FAKE_PCI=pcis[r], PYTHONPATH=str(ROOT),
                   FAKE_GPUS_PER_PROCESS=str(gpus_per_process), PK_JAX_INIT_TIMEOUT_S="30", JAX_PLATFORMS="cpu",
                   **env_extra)
        env.pop("XLA_FLAGS", None)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(r), str(n), str(port), str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]


def _mapped(process: int, owner: int, region: int) -> int:  # the fake driver's rule (init_exchange.py)
    return (process + 1) << 40 | owner << 20 | region << 12


def test_plan_domain_groups_processes_by_host_and_counts_shared_gpus():
    procs = [{"host": "b", "devices": [{"id": 0, "pci": "x"}]}, {"host": "a", "devices": [{"id": 1, "pci": "y"}]},
             {"host": "b", "devices": [{"id": 2, "pci": "x"}]}]
    plan = plan_domain(procs, 2)
    assert plan.host_of == (1, 0, 1)
    assert plan.local_ranks == (0, 2)
    assert plan.slot_of == {0: 0, 2: 1} and plan.process_of == {0: 0, 2: 2}
    assert plan.ranks_per_gpu == 2
    with pytest.raises(RuntimeError, match="at most 8"):
        plan_domain([{"host": "h", "devices": [{"id": i, "pci": str(i)} for i in range(9)]}], 0)


def test_exchange_maps_same_host_peers_and_sets_every_delta(tmp_path):
    # Processes 0, 1, 3 on host A (0 and 1 share a GPU), process 2 alone on host B.
    hosts, pcis = ["A", "A", "B", "A"], ["gpu0", "gpu0", "gpu0", "gpu1"]
    res = _run(tmp_path, hosts, pcis)
    ids = {r: 100 + r for r in range(4)}
    for r, out in enumerate(res):
        info, calls = out["info"], out["calls"]
        assert info["ranks"] == 4 and info["rank"] == r and info["kernels"]
        assert info["host_of"] == [0, 0, 1, 0]
        local = [0, 1, 3] if r != 2 else [2]
        assert info["local_ranks"] == local
        assert info["ranks_per_gpu"] == (2 if r != 2 else 1)
        slot = {ids[p]: i for i, p in enumerate(local)}
        assert calls["add"] == [[0, ids[r], slot[ids[r]], r, 0xDEAD0000 + ids[r]]]
        # Every same-host peer mapped once, with the handles it published; nothing across hosts.
        attached = {a[0]: a for a in calls["attach"]}
        assert sorted(attached) == sorted(ids[p] for p in local if p != r)
        for p in local:
            if p != r:
                d = ids[p]
                assert attached[d][1:] == [slot[d], p, f"ctrl{d}", [f"xla{d}", f"stage{d}"], [[], []]]
        # Our regions as each peer process mapped them.
        expect = sorted([ids[r], i, slot[ids[p]], _mapped(p, ids[r], i)] for p in local if p != r for i in range(2))
        assert sorted(calls["delta"]) == expect
        assert calls["finish"] == [r]
        assert calls["probes_alive"] == [True], "the probe buffer (XLA's exported region) was freed"


@pytest.mark.parametrize("chunks", [1, 3])
def test_exchange_passes_fds_of_regions_shared_by_posix_fd(tmp_path, chunks):
    # Processes 0, 1, 3 on host A, 2 alone on host B; XLA's region of every device goes by fd.
    hosts, pcis = ["A", "A", "B", "A"], ["gpu0", "gpu0", "gpu0", "gpu1"]
    res = _run(tmp_path, hosts, pcis, FAKE_VMM_CHUNKS=str(chunks), XDG_RUNTIME_DIR=str(tmp_path))
    ids = {r: 100 + r for r in range(4)}
    for r, out in enumerate(res):
        info, calls = out["info"], out["calls"]
        local = [0, 1, 3] if r != 2 else [2]
        assert info["staging"] is False
        assert info["sharing"] == "posix_fd"
        attached = {a[0]: a for a in calls["attach"]}
        assert sorted(attached) == sorted(ids[p] for p in local if p != r)
        for d, a in attached.items():
            # Each chunk's fd is the very file its owner opened, in chunk order; the staging heap has none.
            assert a[4] == [f"vmm{d}", f"stage{d}"]
            assert a[5] == [[f"dev{d}/chunk{c}" for c in range(chunks)], []]
        assert calls["open_chunk_fds"] == [], "an fd of a chunk (ours or a peer's) stayed open"
        # Host A's lowest rank made the job directory and removed it; a host with one process makes none.
        assert ("job_dir" in calls) == (r == 0)
        if r == 0:
            assert calls["job_dir_exists"] is False
            assert os.path.dirname(calls["job_dir"]) == str(tmp_path)
        if r != 2:
            assert calls["endpoint"] == [local.index(r), 3, True]
        else:
            assert "endpoint" not in calls


def test_fd_sharing_can_be_turned_off(tmp_path):
    res = _run(tmp_path, ["A", "A"], ["gpu0", "gpu0"], FAKE_VMM_CHUNKS="2", PK_JAX_FD_SHARING="0",
               XDG_RUNTIME_DIR=str(tmp_path))
    for out in res:
        assert out["info"]["sharing"] == "cuda_ipc"  # the fake's other answer
        assert "job_dir" not in out["calls"] and "endpoint" not in out["calls"]
        assert all(a[5] == [[], []] for a in out["calls"]["attach"])


def test_fd_message_format():
    from pk_jax._fd_exchange import fd_payload, parse_fd_payload

    assert fd_payload(7, 0, 12) == b"pk_jax-fd/1 7 0 12"
    assert parse_fd_payload(fd_payload(7, 0, 12)) == (7, 0, 12)
    for bad in [b"", b"pk_jax-fd/1 7 0", b"pk_jax-fd/2 7 0 1", b"pk_jax-fd/1 7 0 -1", b"pk_jax-fd/1 7 0 1 2",
                b"0:fd:", b"pk_jax-fd/1 a 0 1", b"\xff\xfe"]:
        with pytest.raises(ValueError, match="unexpected fd message"):
            parse_fd_payload(bad)


def test_sharing_message_names_the_method_chunks_and_size():
    from pk_jax.distributed import _sharing_message

    assert _sharing_message("posix_fd", 1, 3 << 30) == "XLA's memory shared by POSIX fd (1 chunk, 3072 MiB)"
    assert _sharing_message("posix_fd", 4, 5 << 20) == "XLA's memory shared by POSIX fd (4 chunks, 5 MiB)"
    assert _sharing_message("cuda_ipc", 0, 64 << 20) == "XLA's memory shared by CUDA IPC (64 MiB)"


def test_exchange_with_two_gpus_per_process(tmp_path):
    res = _run(tmp_path, ["A", "A"], ["p0", "p1"], gpus_per_process=2)
    for r, out in enumerate(res):
        info, calls = out["info"], out["calls"]
        assert info["domain_device_ids"] == [100, 101, 102, 103] and info["ranks_per_gpu"] == 1
        other = 1 - r
        mine, theirs = [100 + 2 * r, 101 + 2 * r], [100 + 2 * other, 101 + 2 * other]
        # Both of the other process's GPUs see our regions at the one address that process mapped them.
        expect = sorted([d, i, s, _mapped(other, d, i)] for d in mine for i in range(2) for s in (theirs[0] - 100,
                                                                                                 theirs[1] - 100))
        assert sorted(calls["delta"]) == expect


def test_cpu_processes_get_the_layout_only(tmp_path):
    res = _run(tmp_path, ["A", "B"], ["-", "-"], FAKE_NATIVE="none")
    for r, out in enumerate(res):
        assert out["info"]["kernels"] is False and out["info"]["host_of"] == [0, 1]
        assert out["info"]["local_ranks"] == [r] and out["calls"] == {}


def _fake_info(monkeypatch, host_of, ranks_per_gpu=1):
    from pk_jax import distributed

    info = distributed.DistributedInfo(len(host_of), 0, (0,), ranks_per_gpu, (0,), tuple(host_of), 0.0)
    monkeypatch.setattr(distributed, "_info", info)
    return distributed


def test_axis_inside_hosts_runs_kernels_axis_across_hosts_does_not(monkeypatch):
    from pk_jax.sharding import GroupTable

    # 2 hosts x 2 processes x 1 GPU; mesh ("dp", "tp") = (2, 2), device id = process index, dp across hosts.
    dist = _fake_info(monkeypatch, [0, 0, 1, 1])
    process_of = {i: i for i in range(4)}
    tp = GroupTable((0, 1, 2, 3), (2, 2), (1,), all_local=False)
    dp = GroupTable((0, 1, 2, 3), (2, 2), (0,), all_local=False)
    both = GroupTable((0, 1, 2, 3), (2, 2), (0, 1), all_local=False)
    assert dist.groups_within_hosts(tp, process_of)
    assert not dist.groups_within_hosts(dp, process_of)
    assert not dist.groups_within_hosts(both, process_of)


def test_lax_fallback_raises_only_when_ranks_share_a_gpu(monkeypatch):
    from pk_jax import runtime

    _fake_info(monkeypatch, [0, 0], ranks_per_gpu=1)
    runtime.lax_fallback_allowed("all_gather", "some reason")  # one process per GPU: NCCL can carry it
    _fake_info(monkeypatch, [0, 0], ranks_per_gpu=2)
    with pytest.raises(RuntimeError, match="all_gather: cannot fall back to jax.lax .*duplicate GPU"):
        runtime.lax_fallback_allowed("all_gather", "some reason")


def test_single_process_initialize_is_a_no_op():
    import pk_jax

    info = pk_jax.initialize()
    assert info.ranks == 1 and info.rank == 0 and pk_jax.initialize() is info
