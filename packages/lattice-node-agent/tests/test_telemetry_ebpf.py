"""The eBPF source against real processes and the real kernel: a pipe ping-pong between two
processes of one group (context switches, run-queue latency), an idle process, a writer
with fsync (block I/O latency), a process touching fresh memory (page faults), a child
that leaves its process group by setsid (still counted: inherited at fork), a process in
its own cgroup v2 directory sending and receiving UDP over a veth pair (network bytes by
cgroup); the loop choosing the source; probe() saying why not without raising; the
histogram percentile on its own. The kernel tests skip, with probe()'s reason, where eBPF
cannot run (not root, no bcc, no headers, no tracefs: scripts/bootstrap-ebpf)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from lattice_agent.cgroups import Scope
from lattice_agent.telemetry import ebpf as ebpf_mod
from lattice_agent.telemetry.ebpf import (
    CONTEXT_SWITCHES,
    IO_LATENCY_P99,
    PAGE_FAULTS,
    RUNQUEUE_LATENCY_P99,
    EbpfSource,
    hist_percentile,
    probe,
)
from lattice_agent.telemetry.samples import (
    NETWORK_RX_BYTES,
    NETWORK_TX_BYTES,
    AllocLabels,
    Target,
)
from prometheus_client import REGISTRY

OK, WHY = probe()
needs_ebpf = pytest.mark.skipif(not OK, reason=f"eBPF cannot run here: {WHY}")


# --------------------------------------------------------------------------- pure parts


def test_hist_percentile() -> None:
    assert hist_percentile([0] * 40, 99) is None
    assert hist_percentile([5] + [0] * 39, 99) == 0.0  # every value 0 ns
    counts = [0] * 40
    counts[11] = 100  # [1024, 2048) ns
    p = hist_percentile(counts, 99)
    assert p is not None and 1024 <= p <= 2048
    counts[20] = 1  # one outlier in [2^19, 2^20): above the p99 rank of 101
    p99 = hist_percentile(counts, 99)
    p100 = hist_percentile(counts, 100)
    assert p99 is not None and p100 is not None
    assert p99 < 2048 <= (1 << 19) <= p100 <= (1 << 20)
    assert hist_percentile(counts, 50) <= p99  # type: ignore[operator]


def test_probe_says_why_not_without_raising(tmp_path: Path) -> None:
    ok, why = probe(tracefs=[tmp_path / "no-tracefs"], euid=0, environ={})
    if "sources not found" not in why:  # (a packaged agent without infra/ebpf says that)
        assert not ok and "tracefs not mounted" in why, why
    ok, why = probe(euid=1000, environ={})
    assert not ok and "not root" in why
    ok, why = probe(environ={"LATTICE_TELEMETRY_EBPF": "off"})
    assert not ok and "switched off" in why
    if OK:  # the remaining checks come after root and tracefs
        ok, why = probe(modules=tmp_path)
        if not Path("/sys/kernel/kheaders.tar.xz").exists():
            assert not ok and "no kernel headers" in why, why
        ok, why = probe(bcc_dir=tmp_path / "bcc")
        assert not ok and "bcc not importable" in why, why


def test_loop_uses_ebpf_only_when_probe_ok(monkeypatch: pytest.MonkeyPatch) -> None:
    from lattice_agent.telemetry.loop import telemetry_loop
    from lattice_common.config import TelemetryConfig

    with_tsdb = TelemetryConfig(tsdb_endpoint="http://127.0.0.1:9")
    monkeypatch.setenv("LATTICE_TELEMETRY_EBPF", "off")
    loop = telemetry_loop(with_tsdb, targets=list)
    assert [s.name for s in loop.sources] == ["proc"]
    assert REGISTRY.get_sample_value("lattice_agent_telemetry_source", {"source": "ebpf"}) == 0
    monkeypatch.delenv("LATTICE_TELEMETRY_EBPF")
    # no TSDB: nothing would keep the series, bcc is not loaded
    assert [s.name for s in telemetry_loop(TelemetryConfig(), targets=list).sources] == ["proc"]
    ok = probe()[0]
    loop = telemetry_loop(with_tsdb, targets=list)
    assert [s.name for s in loop.sources] == (["proc", "ebpf"] if ok else ["proc"])
    gauge = REGISTRY.get_sample_value("lattice_agent_telemetry_source", {"source": "ebpf"})
    assert gauge == (1 if ok else 0)


# --------------------------------------------------------------------------- real kernel


def _start(code: str, *args: str) -> subprocess.Popen[bytes]:
    """A Python child in its own session (pgid = pid), as the runtime starts allocations."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], start_new_session=True
    )


def _kill(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(10)


def _target(aid: str, *pgids: int, scope: Scope | None = None) -> Target:
    return Target(AllocLabels(aid, "node-ebpf", "t", "u", "v"), tuple(pgids), scope)


def _proc_counts(pgid: int) -> tuple[int, int]:
    """Context switches and page faults (minor + major) so far of a process group's
    single-threaded processes, as /proc counts them."""
    switches = faults = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{name}/stat").read_bytes()
            rest = stat[stat.rindex(b")") + 2 :].split()
            if int(rest[2]) != pgid:
                continue
            status = Path(f"/proc/{name}/status").read_text()
            faults += int(rest[7]) + int(rest[9])
            for line in status.splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    switches += int(line.split()[1])
    return switches, faults


def _block_dir(*candidates: Path) -> Path | None:
    """The first directory whose filesystem sits on a block device (not tmpfs/overlay)."""
    for d in candidates:
        with contextlib.suppress(OSError):
            st = os.stat(d)
            if Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").exists():
                return d
    return None


@pytest.fixture(scope="module")
def source() -> Iterator[EbpfSource]:
    if not OK:
        pytest.skip(f"eBPF cannot run here: {WHY}")
    s = EbpfSource(overhead_interval=3600)
    assert s.start(), "the programs did not load"
    yield s
    s.close()


_WAIT_GO = """
import os, pathlib, sys, time
go = pathlib.Path(sys.argv[1])
while not go.exists():
    time.sleep(0.01)
"""

# the child dies with its parent (PR_SET_PDEATHSIG) and stops at end of file
_PING_PONG = """
r1, w1 = os.pipe(); r2, w2 = os.pipe()
if os.fork() == 0:
    __import__("ctypes").CDLL(None).prctl(1, 9)
    while os.read(r1, 1):
        os.write(w2, b"x")
    os._exit(0)
end = time.monotonic() + 20
while time.monotonic() < end:
    os.write(w1, b"x"); os.read(r2, 1)
"""


@pytest.fixture(scope="module")
def measured(source: EbpfSource, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One window of every workload at once: a first collection (it seeds the programs
    with the processes), go, a baseline collection, 1.5 s, the measured one; /proc's
    counts over the same window; the workloads are gone before the tests look."""
    tmp = tmp_path_factory.mktemp("ebpf")
    go = tmp / "go"
    io_dir = _block_dir(tmp, Path.cwd(), Path.home(), Path("/var/tmp"))
    workloads = {
        "pingpong": _WAIT_GO + _PING_PONG,
        "faults": _WAIT_GO
        + """
import mmap
end = time.monotonic() + 20
while time.monotonic() < end:  # fresh anonymous memory, one byte per page
    m = mmap.mmap(-1, 64 << 20)
    for off in range(0, 64 << 20, 4096):
        m[off] = 1
    m.close()
""",
        # leaves the group: setsid, then a ping-pong of its own (and its own child)
        "escapee": _WAIT_GO
        + "if os.fork() == 0:\n"
        + "    __import__('ctypes').CDLL(None).prctl(1, 9)\n"
        + "    os.setsid()\n"
        + textwrap.indent(_PING_PONG, "    ")
        + "    os._exit(0)\ntime.sleep(30)\n",
    }
    if io_dir is not None:
        data = io_dir / f".lattice-ebpf-test-{uuid.uuid4().hex[:8]}"
        workloads["writer"] = (
            _WAIT_GO
            + f"""
fd = os.open({str(data)!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
block = os.urandom(4096)
end = time.monotonic() + 20
while time.monotonic() < end:
    os.pwrite(fd, block, 0)
    os.fsync(fd)
"""
        )
    procs = {name: _start(code, str(go)) for name, code in workloads.items()}
    procs["idle"] = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        targets = [_target(name, p.pid) for name, p in procs.items()]
        time.sleep(0.3)  # every process started (the python ones wait for go)
        first = source.collect(targets)  # seeds: what they fork from now on is theirs
        go.touch()
        time.sleep(0.2)  # running
        pp, fa = procs["pingpong"].pid, procs["faults"].pid
        before = _proc_counts(pp)[0], _proc_counts(fa)[1]
        t0 = time.monotonic()
        source.collect(targets)
        time.sleep(1.5)
        out = source.collect(targets)
        dt = time.monotonic() - t0
        after = _proc_counts(pp)[0], _proc_counts(fa)[1]
        proc_rates = {
            "switches": (after[0] - before[0]) / dt,
            "faults": (after[1] - before[1]) / dt,
        }
        print({k: {m: round(v, 1) for m, v in vs.items()} for k, vs in out.items()})
        print("/proc:", proc_rates)
    finally:
        for p in procs.values():
            _kill(p)
        if io_dir is not None:
            with contextlib.suppress(OSError):
                data.unlink()
    yield {"first": first, "out": out, "io_dir": io_dir, "proc": proc_rates}


@needs_ebpf
def test_first_collection_is_a_baseline(measured: dict) -> None:
    assert measured["first"] == {}


@needs_ebpf
def test_ping_pong_switches_and_idle_does_not(measured: dict) -> None:
    out = measured["out"]
    assert out["pingpong"][CONTEXT_SWITCHES] > 1000
    # the same thing /proc/<pid>/status counts (voluntary + involuntary)
    assert out["pingpong"][CONTEXT_SWITCHES] == pytest.approx(measured["proc"]["switches"], rel=0.2)
    assert out["pingpong"][RUNQUEUE_LATENCY_P99] > 0
    assert out["idle"][CONTEXT_SWITCHES] < 5  # asleep the whole window
    assert out["idle"][PAGE_FAULTS] < 5
    assert RUNQUEUE_LATENCY_P99 not in out["idle"]  # never woken: no value, not 0


@needs_ebpf
def test_child_that_left_the_process_group_is_still_counted(measured: dict) -> None:
    # the escapee's own process does nothing but sleep; its setsid child ping-pongs
    # in another process group, which a /proc scan by pgid would not find
    assert measured["out"]["escapee"][CONTEXT_SWITCHES] > 1000


@needs_ebpf
def test_touching_fresh_memory_faults(measured: dict) -> None:
    out = measured["out"]
    assert out["faults"][PAGE_FAULTS] > 1000
    assert out["faults"][PAGE_FAULTS] == pytest.approx(measured["proc"]["faults"], rel=0.2)
    assert out["faults"][PAGE_FAULTS] > 100 * max(out["idle"][PAGE_FAULTS], 1)


@needs_ebpf
def test_fsync_writes_show_block_latency(measured: dict) -> None:
    if measured["io_dir"] is None:
        pytest.skip("no writable directory on a block device (tmpfs/overlay only)")
    out = measured["out"]
    assert out["writer"][IO_LATENCY_P99] > 0
    assert IO_LATENCY_P99 not in out["idle"]
    assert IO_LATENCY_P99 not in out["pingpong"]  # no I/O of its own


@needs_ebpf
def test_overhead_is_measured(source: EbpfSource, measured: dict) -> None:
    pct = source.measure_overhead()
    assert pct is not None and 0 < pct < 100
    assert REGISTRY.get_sample_value(
        "lattice_agent_ebpf_overhead_percent", {"node_id": "node-ebpf"}
    ) == pytest.approx(pct)


@needs_ebpf
def test_forget_frees_the_slot(source: EbpfSource) -> None:
    p = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        t = _target(f"forget-{uuid.uuid4().hex[:6]}", p.pid)
        source.collect([t])
        slot = source._allocs[t.alloc_id].slot
        assert any(v.slot == slot for v in source._tasks.values())
        source.forget(t.alloc_id)
        source.collect([])
        assert not any(v.slot == slot for v in source._tasks.values())
        assert slot in source._free
    finally:
        _kill(p)


def test_programs_that_do_not_load_turn_the_source_off(tmp_path: Path) -> None:
    if not OK:
        pytest.skip(f"eBPF cannot run here: {WHY}")
    src_dir = ebpf_mod.programs_dir()
    assert src_dir is not None
    for f in src_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "sched.c").write_text("this is not C;\n")
    states: list[bool] = []
    s = EbpfSource(programs=tmp_path, on_state=states.append)
    assert s.collect([_target("x", os.getpid())]) == {}
    assert states == [False] and not s.loaded
    assert s.collect([_target("x", os.getpid())]) == {}  # said once, not retried
    assert states == [False]


# --------------------------------------------------------------------------- cgroup v2 + net


def _v2_root() -> Path | None:
    for d in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (d / "cgroup.procs").is_file() and (d / "cgroup.subtree_control").exists():
            return d
    return None


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@pytest.fixture
def veth() -> Iterator[tuple[str, str]]:
    """A veth pair: this side 10.251.<n>.1 here, the peer .2 in namespace ns."""
    if shutil.which("ip") is None:
        pytest.skip("no ip(8)")
    tag = uuid.uuid4().hex[:6]
    ns, here, peer = f"lteb-{tag}", f"lteb{tag}a", f"lteb{tag}b"
    n = int(tag[:2], 16)
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", here, "type", "veth", "peer", "name", peer)
        _sh("ip", "link", "set", peer, "netns", ns)
        _sh("ip", "addr", "add", f"10.251.{n}.1/30", "dev", here)
        _sh("ip", "link", "set", here, "up")
        _sh("ip", "-n", ns, "addr", "add", f"10.251.{n}.2/30", "dev", peer)
        _sh("ip", "-n", ns, "link", "set", peer, "up")
    except (subprocess.SubprocessError, OSError) as e:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _sh("ip", "link", "del", here)
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _sh("ip", "netns", "del", ns)
        pytest.skip(f"cannot make a veth pair: {e}")
    try:
        yield ns, f"10.251.{n}"
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _sh("ip", "link", "del", here)
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _sh("ip", "netns", "del", ns)


@needs_ebpf
def test_v2_scope_by_cgroup_id_with_network_bytes(
    source: EbpfSource, veth: tuple[str, str], tmp_path: Path
) -> None:
    root = _v2_root()
    if root is None:
        pytest.skip("no cgroup v2 hierarchy")
    ns, net = veth
    cg = root / f"lattice-ebpf-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    go = tmp_path / "go"
    # joins the v2 cgroup first (sockets belong to the cgroup they are created in), then
    # receives datagrams from the peer namespace and sends its own there
    member = _start(
        f"""
import pathlib
pathlib.Path({str(cg / "cgroup.procs")!r}).write_text(str(__import__("os").getpid()))
"""
        + _WAIT_GO
        + f"""
import socket
rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
rx.bind(("{net}.1", 0))
# written aside and renamed: the test must never read a created but still empty file
pathlib.Path(sys.argv[1] + ".port.tmp").write_text(str(rx.getsockname()[1]))
__import__("os").replace(sys.argv[1] + ".port.tmp", sys.argv[1] + ".port")
tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
rx.settimeout(0.01)
end = time.monotonic() + 20
while time.monotonic() < end:
    tx.sendto(b"y" * 1000, ("{net}.2", 9))
    with __import__("contextlib").suppress(OSError):
        rx.recv(65536)
""",
        str(go),
    )
    sender = None
    try:
        scope = Scope("v2", {"": cg})
        t = _target("v2", scope=scope)  # no process group: by cgroup only
        deadline = time.monotonic() + 10
        while str(member.pid) not in (cg / "cgroup.procs").read_text():
            assert time.monotonic() < deadline, "the member never joined its cgroup"
            time.sleep(0.01)
        source.collect([t])  # registers the cgroup id, attaches the net programs
        assert source._allocs["v2"].cgroup_id == os.stat(cg).st_ino
        go.touch()
        port_file = Path(str(go) + ".port")
        while not port_file.exists():
            assert time.monotonic() < deadline, "the member never bound its socket"
            time.sleep(0.01)
        sender = subprocess.Popen(
            [
                "ip", "netns", "exec", ns, sys.executable, "-c",
                "import socket, time\n"
                "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                "end = time.monotonic() + 20\n"
                "while time.monotonic() < end:\n"
                f"    s.sendto(b'z' * 1200, ('{net}.1', {int(port_file.read_text())}))\n"
                "    time.sleep(0.001)\n",
            ],
            start_new_session=True,
        )  # fmt: skip
        source.collect([t])  # the baseline for the network series (attached before it)
        time.sleep(1.2)
        out = source.collect([t])["v2"]
        print(out)
        assert out[CONTEXT_SWITCHES] > 10
        assert out[NETWORK_TX_BYTES] > 10_000  # 1000-byte datagrams + headers
        assert out[NETWORK_RX_BYTES] > 10_000
    finally:
        for p in (member, sender):
            if p is not None:
                _kill(p)
        source.forget("v2")
        source.collect([])  # purge
        for _ in range(100):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.05)
