"""The /proc + cgroup collector against real processes: a CPU burner, a writer with fsync
(and a read back from disk), a memory hog, a shell running short children (reaped inside
the group: counted once), a process in a real cgroup v1 scope, one in its own network
namespace; plus the parsers and the per-process sums on their own."""

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
from lattice_agent.cgroups import CgroupsV1, Limits
from lattice_agent.telemetry.proc import (
    CLK_TCK,
    PidCounters,
    ProcCollector,
    group_delta,
    parse_blkio,
    parse_io,
    parse_io_stat,
    parse_net_dev,
    parse_net_dev_counters,
    parse_stat,
)
from lattice_agent.telemetry.samples import AllocLabels, Target

MIB = 1 << 20


def _start(code: str, **kw) -> subprocess.Popen[bytes]:
    """A Python child in its own session (pgid = pid), as the runtime starts allocations."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], start_new_session=True, **kw
    )


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:  # each in its own session: the whole group goes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def _target(p: subprocess.Popen[bytes], aid: str = "a1") -> Target:
    return Target(AllocLabels(aid, "node-001", "t", "u", "v"), (p.pid,))


def _wait_file(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


# --------------------------------------------------------------------------- real processes


def test_busy_process_shows_cpu_and_idle_one_does_not(procs: list) -> None:
    busy = _start("import time\nt = time.time() + 4\nwhile time.time() < t: pass\n")
    idle = _start("import time; time.sleep(4)")
    procs += [busy, idle]
    c = ProcCollector()
    targets = [_target(busy, "busy"), _target(idle, "idle")]
    time.sleep(0.2)
    first = c.collect(targets)
    assert "cpu_utilization" not in first.get("busy", {})  # the first one is a baseline
    time.sleep(1.5)
    out = c.collect(targets)
    print("busy:", out["busy"], "idle:", out["idle"])
    assert out["busy"]["cpu_utilization"] > 50
    assert out["busy"]["cpu_utilization"] < 130  # one thread: about one core
    assert out["idle"]["cpu_utilization"] < 10
    assert out["busy"]["memory_used"] > 1 * MIB  # RSS of a Python interpreter


def test_memory_of_a_process_holding_200_mib(procs: list, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    hog = _start(
        f"""
        import pathlib, time
        block = b"x" * (200 << 20)  # written, so resident
        pathlib.Path({str(ready)!r}).touch()
        time.sleep(30)
        """
    )
    procs.append(hog)
    _wait_file(ready)
    out = ProcCollector().collect([_target(hog)])
    print("memory_used:", out["a1"]["memory_used"] / MIB, "MiB")
    assert 200 * MIB <= out["a1"]["memory_used"] < 400 * MIB


def test_writer_with_fsync_and_read_from_disk(procs: list, tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    go, wrote, read = tmp_path / "go", tmp_path / "wrote", tmp_path / "read"
    io = _start(
        f"""
        import os, pathlib, time
        while not pathlib.Path({str(go)!r}).exists():
            time.sleep(0.01)
        chunk = os.urandom(1 << 20)
        fd = os.open({str(data)!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for _ in range(16):
            os.write(fd, chunk)
            os.fsync(fd)
        os.close(fd)
        pathlib.Path({str(wrote)!r}).touch()
        while not pathlib.Path({str(read)!r}).exists():
            time.sleep(0.01)
        fd = os.open({str(data)!r}, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: out of the cache
        while os.read(fd, 1 << 20):
            pass
        os.close(fd)
        time.sleep(30)
        """
    )
    procs.append(io)
    c = ProcCollector()
    t = _target(io)
    time.sleep(0.2)
    c.collect([t])  # baseline
    t0 = time.monotonic()
    go.touch()
    _wait_file(wrote)
    out = c.collect([t])["a1"]
    dt = time.monotonic() - t0
    written = out["io_write_bytes"] * dt
    print(f"io_write_bytes {out['io_write_bytes'] / MIB:.1f} MiB/s over {dt:.2f}s")
    assert written >= 12 * MIB  # 16 MiB written and synced (generous: the window is wider)
    assert out["io_read_bytes"] * dt < 4 * MIB
    t0 = time.monotonic()
    read.touch()
    time.sleep(1.0)
    out = c.collect([t])["a1"]
    dt = time.monotonic() - t0
    print(f"io_read_bytes {out['io_read_bytes'] / MIB:.1f} MiB/s over {dt:.2f}s")
    assert out["io_read_bytes"] * dt >= 8 * MIB
    assert out["io_write_bytes"] * dt < 4 * MIB


def test_short_children_reaped_inside_are_counted_once(procs: list) -> None:
    """A shell running six 0.3 s CPU bursts one after another: each child's time is seen
    while it runs, then again in the shell's cutime once reaped; the sum must count it once."""
    burst = "import time\nt = time.time() + 0.3\nwhile time.time() < t: pass\n"
    sh = subprocess.Popen(
        ["sh", "-c", f'for i in 1 2 3 4 5 6; do "{sys.executable}" -c "$0"; done; sleep 5', burst],
        start_new_session=True,
    )
    procs.append(sh)
    c = ProcCollector()
    t = _target(sh)
    c.collect([t])
    integrated = 0.0
    last = time.monotonic()
    while True:
        time.sleep(0.25)
        now = time.monotonic()
        out = c.collect([t]).get("a1", {})
        integrated += out.get("cpu_utilization", 0.0) / 100.0 * (now - last)
        last = now
        with open(f"/proc/{sh.pid}/stat", "rb") as f:
            info = parse_stat(sh.pid, f.read())
        # the loop is done when the shell sits in `sleep` (its only child then)
        children = [p for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == sh.pid]
        if info is not None and _comm_of_children(children) == {"sleep"}:
            break
    assert info is not None
    actual = info.cpu_ticks / CLK_TCK  # the shell's own time plus its reaped children's
    print(f"integrated {integrated:.2f} s of CPU, the kernel says {actual:.2f} s")
    assert actual > 1.0  # six 0.3 s bursts (wall clock; less CPU on a busy machine)
    assert 0.7 * actual <= integrated <= 1.3 * actual


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            info = parse_stat(pid, f.read())
    except OSError:
        return 0
    return info.ppid if info else 0


def _comm_of_children(pids: list[str]) -> set[str]:
    out = set()
    for p in pids:
        try:
            out.add(Path(f"/proc/{p}/comm").read_text().strip())
        except OSError:
            pass
    return out


def test_a_group_that_is_gone_answers_nothing(procs: list) -> None:
    p = _start("pass")
    p.wait(10)
    assert ProcCollector().collect([_target(p)]) == {}


# --------------------------------------------------------------------------- real cgroup v1

_V1 = Path("/sys/fs/cgroup")


def _v1_writable() -> str:
    if (_V1 / "cgroup.controllers").exists():
        return "pure cgroup v2 host (this test exercises v1)"
    if not (_V1 / "memory").is_dir() or not (_V1 / "cpuacct").exists():
        return "no cgroup v1 memory/cpuacct controllers at /sys/fs/cgroup"
    if not os.access(_V1 / "memory", os.W_OK):
        return "/sys/fs/cgroup/memory is not writable (needs root)"
    return ""


@pytest.fixture
def real_cg() -> Iterator[CgroupsV1]:
    why = _v1_writable()
    if why:
        pytest.skip(why)
    cg = CgroupsV1(_V1, slice_name=f"lattice-telemetry-{uuid.uuid4().hex[:8]}.slice")
    yield cg
    for scope in cg.orphans(set()):
        cg.remove(scope)
    for mount in cg.controllers.values():
        d = mount / cg.slice
        if d.is_dir():
            d.rmdir()


def test_scope_counters_of_a_real_v1_cgroup(real_cg: CgroupsV1, procs: list) -> None:
    """In a scope, CPU and memory come from the cgroup and membership from cgroup.procs:
    a process that left the process group (setsid) still counts."""
    scope = real_cg.create("cgtel", Limits(memory_bytes=1 << 30, pids_max=64))
    files = " ".join(f"'{p}'" for p in real_cg.procs_files(scope))
    burner = "import time\nt = time.time() + 4\nwhile time.time() < t: pass\n"
    # the wrapper joins the scope, then starts the burner in a session of its own
    wrapper = (
        f'for f in {files}; do echo $$ > "$f" || exit 125; done; '
        f'exec setsid "{sys.executable}" -c "$0"'
    )
    p = subprocess.Popen(["sh", "-c", wrapper, burner], start_new_session=True)
    procs.append(p)
    try:
        c = ProcCollector(real_cg)
        # wrong pgid on purpose: the scope decides who belongs
        t = Target(AllocLabels("cgtel", "node-001"), (999_999_999,), scope)
        time.sleep(0.3)
        c.collect([t])
        time.sleep(1.5)
        out = c.collect([t])["cgtel"]
        print("scope:", out)
        assert out["cpu_utilization"] > 50
        assert out["memory_used"] > 0
        assert out["memory_used"] == pytest.approx(
            int((scope.dirs["memory"] / "memory.usage_in_bytes").read_text()), rel=0.5
        )
        assert "io_write_bytes" in out  # v1 here has no blkio scope: per-process /proc/<pid>/io
    finally:
        p.kill()
        p.wait(10)
        real_cg.remove(scope)


# --------------------------------------------------------------------------- network


def test_network_only_for_a_namespace_of_its_own(procs: list, tmp_path: Path) -> None:
    if not (shutil.which("unshare") and shutil.which("ip")) or os.geteuid() != 0:
        pytest.skip("needs root, unshare and ip (network namespaces)")
    ready = tmp_path / "ready"
    sender = f"""
        import pathlib, socket, time
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        pathlib.Path({str(ready)!r}).touch()
        t = time.time() + 4
        while time.time() < t:
            s.sendto(b"x" * 1000, ("10.200.0.2", 9))
            time.sleep(0.0002)
        time.sleep(5)
    """
    setup = (
        "ip link add v0 type veth peer name v1 && ip link set v0 up && ip link set v1 up && "
        "ip addr add 10.200.0.1/24 dev v0 && "
        "ip neigh add 10.200.0.2 lladdr 02:00:00:00:00:02 dev v0 && "
        f'exec "{sys.executable}" -c "$0"'
    )
    # a wrapper in the node's namespace, the sender in one of its own (as a job would)
    inner = ["unshare", "--net", "sh", "-c", setup, textwrap.dedent(sender)]
    ns = subprocess.Popen(
        ["sh", "-c", '"$@"; true', "sh", *inner],
        start_new_session=True,
    )
    host = _start("import time; time.sleep(10)")
    procs += [ns, host]
    _wait_file(ready)
    c = ProcCollector()
    targets = [_target(ns, "ns"), _target(host, "host")]
    c.collect(targets)
    time.sleep(1.2)
    out = c.collect(targets)
    print("ns:", out["ns"])
    assert out["ns"]["network_tx_bytes"] > 1 * MIB
    assert out["ns"]["network_rx_bytes"] > 1 * MIB  # the veth peer receives it
    assert "network_tx_bytes" not in out["host"]  # the node's namespace: not attributable
    assert 0.0 <= out["ns"]["network_error_rate"] <= 100.0  # packets moved: a rate exists
    # one namespace measured for two allocations: not attributable to either
    shared = ProcCollector()
    both = [_target(ns, "x"), _target(ns, "y")]
    shared.collect(both)
    time.sleep(0.3)
    out = shared.collect(both)
    assert out["x"]["cpu_utilization"] >= 0
    assert "network_tx_bytes" not in out["x"] and "network_tx_bytes" not in out["y"]


# --------------------------------------------------------------------------- pure parts


def test_parsers() -> None:
    stat = b"42 (my (odd) prog) S 1 42 42 0 -1 4194560 1 0 0 0 7 3 2 1 20 0 1 0 555 1000 77 x"
    info = parse_stat(42, stat)
    assert info is not None
    assert (info.ppid, info.pgrp, info.start, info.cpu_ticks, info.rss_pages) == (
        1,
        42,
        555,
        13,
        77,
    )
    assert parse_stat(1, b"garbage") is None
    io = "rchar: 10\nwchar: 20\nsyscr: 1\nsyscw: 2\nread_bytes: 4096\nwrite_bytes: 8192\n"
    assert parse_io(io) == (4096, 8192)
    assert parse_io("rchar: 1\n") is None
    assert parse_io_stat("8:0 rbytes=100 wbytes=50 rios=1\n259:0 rbytes=1 wbytes=2\n") == (
        101,
        52,
    )
    assert parse_blkio("8:0 Read 10\n8:0 Write 20\n8:0 Total 30\nTotal 30\n") == (10, 20)
    dev = (
        "Inter-|   Receive\n face |bytes    packets\n"
        "    lo:  100 1 0 0 0 0 0 0  100 1 0 0 0 0 0 0\n"
        "  eth0: 2000 5 0 0 0 0 0 0 3000 7 0 0 0 0 0 0\n"
    )
    assert parse_net_dev(dev) == {"lo": (100, 100), "eth0": (2000, 3000)}
    bad = (
        "Inter-|   Receive\n face |bytes    packets\n"
        "  eth0: 2000 90 3 2 0 1 0 0 3000 100 4 0 0 1 0 0\n"
    )
    # rx errs 3 + drop 2 + frame 1, tx errs 4 + colls 1: 11 errors in 190 good packets
    assert parse_net_dev_counters(bad) == {"eth0": (2000, 3000, 190, 11)}


def _c(start: int, ppid: int, cpu: int | None) -> PidCounters:
    return PidCounters(start=start, ppid=ppid, cpu_ticks=cpu)


def cpu(c: PidCounters) -> int | None:
    return c.cpu_ticks


def test_group_delta_follows_each_process() -> None:
    prev = {10: _c(1, 1, 100), 11: _c(2, 10, 50)}
    # 10 grew by 5; 11 grew by 7; 12 was born (20 all new)
    now = {10: _c(1, 1, 105), 11: _c(2, 10, 57), 12: _c(3, 10, 20)}
    assert group_delta(prev, now, cpu) == 32
    # 11 ended (final 60) and 10 reaped it: 10's counter now holds 60 of children
    now2 = {10: _c(1, 1, 107 + 60), 12: _c(3, 10, 20)}
    assert group_delta(now, now2, cpu) == (107 - 105) + (60 - 57)
    # a chain: 12 ran 13, both gone, reaped by 12 then 10: counted once
    prev3 = {10: _c(1, 1, 100), 12: _c(3, 10, 20), 13: _c(4, 12, 30)}
    now3 = {10: _c(1, 1, 100 + 25 + 35)}  # 12 ended at 25 (own) + 35 (13's final)
    assert group_delta(prev3, now3, cpu) == (25 - 20) + (35 - 30)
    # reaped outside the group (reparented to the agent): what was seen stays counted
    prev4 = {10: _c(1, 1, 100), 20: _c(9, 1, 40)}
    assert group_delta(prev4, {10: _c(1, 1, 101)}, cpu) == 1
    # a reused pid is a new process
    assert group_delta({10: _c(1, 1, 500)}, {10: _c(2, 1, 3)}, cpu) == 3
    # unreadable counters are neither a baseline nor new
    assert group_delta({10: _c(1, 1, None)}, {10: _c(1, 1, 50)}, cpu) == 0
    assert group_delta({}, {}, cpu) == 0
