"""Multicast (NVLink SHARP / multimem) pieces without hardware: the policy and transport plan for every
environment, the fd exchange between processes (0700 job directory, peer credentials, bounded waits),
and MulticastGroup's set-up order and refusals with a fake driver and fake or socket transports.

No test here touches a CUDA driver: the groups run on FakeDriver, and the opt-in variable is set only
around code whose driver is fake."""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import pk_jax
from pk_jax import _ext

if not pk_jax.extension_available():  # the fakes below subclass the extension's interfaces
    pytest.skip("CUDA extension not built", allow_module_level=True)
ext = _ext.ext

MULTICAST_VARS = ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                  "PK_JAX_ENABLE_MULTICAST")
REFUSING = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
MiB = 1 << 20


@pytest.fixture
def clean_env(monkeypatch):
    for v in MULTICAST_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


# The policy of a described environment that requests multicast: handed to the plan and to groups whose
# driver is a FakeDriver. No test sets the opt-in in the real environment (the real CUDA driver's steps
# check that environment again and refuse).
ALLOWED = ext.multicast_policy_of({"PK_JAX_ENABLE_MULTICAST": "1"})


def _plan(group_size, nbytes, supported, num_hosts=1, region_bytes=None, policy=ALLOWED):
    return ext.multicast_plan(group_size, nbytes, supported, num_hosts, -1 if region_bytes is None else region_bytes,
                              *policy)


# ----------------------------------------------------------------------------- policy and plan

def test_policy_and_plan_for_every_environment(clean_env):
    """3^4 described environments: a refusing variable always wins, then the opt-in decides."""
    assert pk_jax.runtime.multicast_policy() == ext.multicast_policy_of({})  # the real one: nothing set
    values = {v: (None, "0", "1") for v in MULTICAST_VARS}
    for combo in itertools.product(*values.values()):
        env = dict(zip(MULTICAST_VARS, combo))
        refused_by = [n for n, v in REFUSING.items() if env[n] == v]
        expect_allowed = not refused_by and env["PK_JAX_ENABLE_MULTICAST"] == "1"
        allowed, reason = ext.multicast_policy_of({k: v for k, v in env.items() if v is not None})
        assert allowed == expect_allowed, (env, reason)
        if refused_by:
            assert f"{refused_by[0]}={REFUSING[refused_by[0]]}" in reason, (env, reason)
        elif not expect_allowed:
            assert "not requested" in reason, (env, reason)
        choice, why = _plan(4, MiB, [True] * 4, policy=(allowed, reason))
        assert choice == ("multimem" if expect_allowed else "peer_to_peer"), (env, why)
        if not expect_allowed:
            assert why == f"multicast refused: {reason}", (env, why)


@pytest.mark.parametrize("group_size,nbytes,supported,kwargs,fragment", [
    (4, MiB, [True, True, False, True], {}, "member 2's GPU reports no multicast support"),
    (2, MiB, [False, False], {}, "member 0's GPU"),
    (4, MiB, [True] * 4, {"num_hosts": 2}, "spans 2 hosts"),
    (4, 0, [True] * 4, {}, "empty message"),
    (4, MiB + 8, [True] * 4, {}, "not a multiple of 16"),
    (4, 8 * MiB, [True] * 4, {"region_bytes": 4 * MiB}, "exceed the multicast region"),
    (1, MiB, [True], {}, "group of 2..8"),
    (9, MiB, [True] * 9, {}, "group of 2..8"),
])
def test_plan_falls_back_to_peer_to_peer(group_size, nbytes, supported, kwargs, fragment):
    choice, why = _plan(group_size, nbytes, supported, **kwargs)
    assert choice == "peer_to_peer" and fragment in why, why


def test_plan_chooses_multimem_when_everything_allows_it():
    for g in range(2, 9):
        choice, why = _plan(g, 4 * MiB, [True] * g, region_bytes=4 * MiB)
        assert choice == "multimem" and "unmeasured" in why, why


def test_plan_names_a_bad_supported_list(clean_env):
    with pytest.raises(ValueError, match="supported lists 3 GPUs for group_size=4"):
        pk_jax.runtime.multicast_plan(4, MiB, [True] * 3)


@pytest.mark.parametrize("var", list(REFUSING) + ["PK_JAX_ENABLE_MULTICAST"])
def test_cuda_driver_and_runtime_set_up_refuse_first(clean_env, var):
    """The real driver's creating steps and create_local_multicast_group refuse before any CUDA call."""
    if var in REFUSING:
        clean_env.setenv(var, REFUSING[var])
    supported, create, physical, local_group = ext.cuda_multicast_refusals([0, 1], MiB)
    for why in (supported, create, physical):
        assert why.startswith("pk_jax: multicast refused:") and var in why, why
    assert local_group.startswith("multicast refused:") and var in local_group, local_group


def test_multimem_kernels_refuse_to_launch_without_configure(clean_env):
    assert ext.multimem_launch_refused()


# ----------------------------------------------------------------------------- fd passing

def _ext_path() -> str:
    return importlib.util.find_spec("pk_jax._pk_jax_ext").origin


@pytest.fixture
def job_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = ext.fd_create_job_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_job_dir_is_private(job_dir, tmp_path):
    st = os.lstat(job_dir)
    assert os.path.dirname(job_dir) == str(tmp_path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    ext.fd_check_job_dir(job_dir)


def test_job_dir_check_rejects_open_linked_or_foreign_dirs(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(RuntimeError, match="mode 0755; it must be 0700"):
        ext.fd_check_job_dir(str(open_dir))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(private)
    with pytest.raises(RuntimeError, match="not a directory"):
        ext.fd_check_job_dir(str(link))
    if os.geteuid() == 0:
        os.chown(private, 65534, 65534)
        with pytest.raises(RuntimeError, match="belongs to uid 65534"):
            ext.fd_check_job_dir(str(private))


def test_peer_credential_check():
    me = os.geteuid()
    assert ext.fd_check_peer(1234, me, me, []) == ""
    assert ext.fd_check_peer(1234, me, me, [1, 1234]) == ""
    assert "runs as uid" in ext.fd_check_peer(1234, me + 1, me, [])
    assert "runs as uid" in ext.fd_check_peer(1234, me + 1, me, [1234])  # a job pid under another uid
    assert "not a process of this job" in ext.fd_check_peer(99, me, me, [1, 1234])


CHILD = textwrap.dedent("""
    import importlib.util, os, sys
    spec = importlib.util.spec_from_file_location("_pk_jax_ext", sys.argv[1])
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    job_dir, mode = sys.argv[2], sys.argv[3]
    ep = ext.FdEndpoint(job_dir, 1, [os.getppid(), os.getpid()] if mode == "pids" else [])
    if mode == "intruder":  # same uid, but not a process of the job
        ep.send(0, -1, b"let me in", 5000)
        sys.exit(0)
    sender, fd, payload = ep.receive(5000)
    data = os.pread(fd, 100, 0)
    r, w = os.pipe()
    os.write(w, b"child read: " + data)
    os.close(w)
    ep.send(0, r, b"pipe from " + payload, 5000)
""")


def _start_child(job_dir: str, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, _ext_path(), job_dir, mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("mode", ["uid_only", "pids"])
def test_fds_cross_between_two_processes(job_dir, mode):
    ep = ext.FdEndpoint(job_dir, 0)
    child = _start_child(job_dir, mode)
    try:
        if mode == "pids":
            ep.set_job_pids([os.getpid(), child.pid])
        memfd = os.memfd_create("pk_jax_test")
        os.write(memfd, b"hello through SCM_RIGHTS")
        ep.send(1, memfd, b"memfd", 10000)
        os.close(memfd)  # the child holds its own copy
        sender, fd, payload = ep.receive(10000)
        assert (sender, payload) == (1, b"pipe from memfd")
        assert os.read(fd, 100) == b"child read: hello through SCM_RIGHTS"
        os.close(fd)
        assert ep.rejected == 0
    finally:
        out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err.decode()


def test_connection_from_outside_the_job_is_rejected(job_dir):
    ep = ext.FdEndpoint(job_dir, 0, [os.getpid(), 1])  # rank 1 is "pid 1": the child is an intruder
    child = _start_child(job_dir, "intruder")
    try:
        with pytest.raises(RuntimeError, match=r"rejected 1 connection\(s\); last: peer pid \d+ is not a process"):
            ep.receive(1500)
        assert ep.rejected == 1
    finally:
        child.communicate(timeout=30)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="needs root to run a process as another uid")
def test_other_user_cannot_reach_the_socket(job_dir):
    ep = ext.FdEndpoint(job_dir, 0)
    probe = "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])"
    r = subprocess.run(["/usr/bin/python3", "-c", probe, ep.path], user=65534, capture_output=True, timeout=30)
    assert r.returncode != 0 and b"PermissionError" in r.stderr, r.stderr.decode()
    with pytest.raises(RuntimeError, match="no message from a job peer"):
        ep.receive(200)
    assert ep.rejected == 0  # it never got as far as a connection


def test_waits_are_bounded(job_dir):
    ep = ext.FdEndpoint(job_dir, 0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0: no message from a job peer within 300 ms"):
        ep.receive(300)
    with pytest.raises(RuntimeError, match="rank 3 did not listen .* within 300 ms"):
        ep.send(3, -1, b"", 300)
    assert time.monotonic() - start < 5.0


# ----------------------------------------------------------------------------- MulticastGroup

class FakeDriver(ext.MulticastDriver):
    """Records every call; handles are small integers, addresses distinct; the multicast handle travels
    as a memfd holding its number (as a real one travels as an fd)."""

    def __init__(self, supported: bool = True, mc_granularity: int = 2 * MiB, alloc_granularity: int = 2 * MiB,
                 fail: str | None = None, base: int = 0x100):
        super().__init__()
        self.calls: list[tuple] = []
        self.live: set[int] = set()    # handles and addresses made and not yet released
        self.supported, self.mc_gran, self.alloc_gran, self.fail = supported, mc_granularity, alloc_granularity, fail
        self.next = base

    def _call(self, name, *args):
        self.calls.append((name, *args))
        if name == self.fail:
            raise RuntimeError(f"injected failure in {name}")

    def _new(self) -> int:
        self.next += 1
        self.live.add(self.next)
        return self.next

    def multicast_supported(self, device):
        self._call("multicast_supported", device)
        return self.supported

    def multicast_granularity(self, num_devices, nbytes):
        self._call("multicast_granularity", num_devices, nbytes)
        return self.mc_gran

    def allocation_granularity(self, device):
        self._call("allocation_granularity", device)
        return self.alloc_gran

    def create_multicast(self, num_devices, nbytes):
        self._call("create_multicast", num_devices, nbytes)
        return self._new()

    def export_fd(self, handle):
        self._call("export_fd", handle)
        fd = os.memfd_create("fake_multicast")
        os.write(fd, str(handle).encode())
        return fd

    def import_fd(self, fd):
        self._call("import_fd")
        handle = int(os.pread(fd, 32, 0))
        self.live.add(handle)
        return handle

    def add_device(self, multicast, device):
        self._call("add_device", multicast, device)

    def create_physical(self, device, nbytes):
        self._call("create_physical", device, nbytes)
        return self._new()

    def bind(self, multicast, device, physical, nbytes):
        self._call("bind", multicast, device, physical, nbytes)

    def unbind(self, multicast, device, nbytes):
        self._call("unbind", multicast, device, nbytes)

    def map(self, handle, device, nbytes, alignment):
        self._call("map", handle, device, nbytes, alignment)
        return self._new() << 32

    def unmap(self, address, nbytes):
        self._call("unmap", address, nbytes)
        self.live.remove(address >> 32)

    def release(self, handle):
        self._call("release", handle)
        self.live.remove(handle)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class RecordingTransport(ext.MulticastTransport):
    """One process: agrees with itself, records the calls."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def all_agree(self, mine):
        self.calls.append("all_agree")
        return mine

    def share_fd(self, fd):
        self.calls.append("share_fd")
        return fd

    def barrier(self):
        self.calls.append("barrier")


def _create_local(driver, transport, devices=(0, 1), nbytes=3 * MiB, policy=ALLOWED):
    return ext.multicast_group_create(len(devices), list(devices), True, True, nbytes, policy, driver, transport)


@pytest.mark.parametrize("var", list(REFUSING) + ["PK_JAX_ENABLE_MULTICAST"])
def test_group_refused_by_policy_touches_no_driver(var):
    env = {"PK_JAX_ENABLE_MULTICAST": "1", var: REFUSING[var]} if var in REFUSING else {}
    driver, transport = FakeDriver(), RecordingTransport()
    group, why = _create_local(driver, transport, policy=ext.multicast_policy_of(env))
    assert group is None and why.startswith("multicast refused:") and (var in why), why
    assert driver.calls == []
    assert transport.calls == ["all_agree"]  # a refusal is still announced to the other processes


def test_group_refused_for_unsupported_device():
    driver = FakeDriver(supported=False)
    group, why = _create_local(driver, RecordingTransport())
    assert group is None and "GPU 0 reports no multicast support" in why
    assert driver.names() == ["multicast_supported"]


def test_group_refused_for_malformed_request():
    driver = FakeDriver()
    group, why = _create_local(driver, RecordingTransport(), devices=(0, 0))
    assert group is None and "lists a device twice" in why and driver.calls == []
    group, why = ext.multicast_group_create(2, [0], True, True, MiB, ALLOWED, driver, RecordingTransport())
    assert group is None and "single-process group must list all" in why and driver.calls == []


def test_single_process_group_set_up_order_and_tear_down():
    driver = FakeDriver(mc_granularity=2 * MiB, alloc_granularity=512 << 10)
    group, why = _create_local(driver, RecordingTransport(), devices=(0, 1), nbytes=3 * MiB)
    assert group is not None, why
    assert group.bytes == 4 * MiB  # 3 MiB rounded up to lcm(2 MiB, 512 KiB)
    names = driver.names()
    assert "export_fd" not in names and "import_fd" not in names  # one process: nothing to exchange
    assert names.count("create_multicast") == 1
    last_add = max(i for i, n in enumerate(names) if n == "add_device")
    first_bind = names.index("bind")
    assert last_add < first_bind  # the whole team joins before any memory is bound
    mc = next(c for c in driver.calls if c[0] == "create_multicast")
    assert mc[1:] == (2, 4 * MiB)
    members = group.members
    assert [m[0] for m in members] == [0, 1]
    addresses = [a for m in members for a in (m[2], m[3])]
    assert len(set(addresses)) == 4 and all(a for a in addresses)
    group.close()
    assert driver.live == set()  # every handle and mapping released
    assert driver.names().count("unbind") == 2


def test_group_set_up_failure_is_undone():
    driver = FakeDriver(fail="map")
    group, why = _create_local(driver, RecordingTransport())
    assert group is None and "multicast set-up failed at bind_and_map: RuntimeError: injected failure in map" in why
    assert driver.live == set()
    assert ("unbind", 0x101, 0, 4 * MiB) in driver.calls  # the bound member was unbound first


def _run_ranks(job_dir, drivers, timeout_ms=5000, nbytes=3 * MiB):
    """Ranks as threads (each a 'process') joined by SocketTransport over real sockets: the multicast
    handle crosses as an fd (SCM_RIGHTS)."""
    endpoints = [ext.FdEndpoint(job_dir, r) for r in range(len(drivers))]
    transports = [ext.SocketTransport(e, len(drivers), timeout_ms) for e in endpoints]
    results: list = [None] * len(drivers)

    def rank(r):
        results[r] = ext.multicast_group_create(len(drivers), [r], r == 0, False, nbytes, ALLOWED, drivers[r],
                                                transports[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(drivers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results


def test_two_process_group_exchanges_the_handle(job_dir):
    drivers = [FakeDriver(base=0x100), FakeDriver(base=0x900)]
    (g0, why0), (g1, why1) = _run_ranks(job_dir, drivers)
    assert g0 is not None and g1 is not None, (why0, why1)
    root_handle = 0x101  # driver 0's first handle: the multicast object it created
    assert drivers[0].names().count("export_fd") == 1 and "create_multicast" not in drivers[1].names()
    assert ("add_device", root_handle, 0) in drivers[0].calls
    assert ("add_device", root_handle, 1) in drivers[1].calls  # rank 1 imported the root's object
    assert ("bind", root_handle, 1, 0x901, 4 * MiB) in drivers[1].calls
    g0.close()
    g1.close()
    assert drivers[0].live == set() and drivers[1].live == set()


def test_one_process_refusing_refuses_the_group(job_dir):
    drivers = [FakeDriver(), FakeDriver(supported=False)]
    (g0, why0), (g1, why1) = _run_ranks(job_dir, drivers)
    assert g0 is None and why0 == "multicast refused by another process of the group"
    assert g1 is None and "reports no multicast support" in why1
    assert drivers[0].names() == ["multicast_supported"]


def test_failure_in_one_process_undoes_both(job_dir):
    drivers = [FakeDriver(), FakeDriver(base=0x900, fail="bind")]
    (g0, why0), (g1, why1) = _run_ranks(job_dir, drivers)
    assert g0 is None and why0 == "multicast set-up failed at bind_and_map in another process"
    assert g1 is None and "bind_and_map: RuntimeError: injected failure in bind" in why1
    assert drivers[0].live == set() and drivers[1].live == set()
