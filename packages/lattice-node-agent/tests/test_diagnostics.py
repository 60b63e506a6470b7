"""NodeAgentService.Diagnose (``lattice diag``'s node-local facts): the pure parts
(mountinfo, the mount of a path, latency buckets; property-tested), the probe on real
directories, a hung mount's probe given up on (and not started again while it hangs),
and the RPC served on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpclib
import pytest
from grpclib.client import Channel
from grpclib.server import Server
from hypothesis import given
from hypothesis import strategies as st
from lattice_agent import diagnostics
from lattice_agent.diagnostics import (
    Diagnoser,
    Mount,
    latency_buckets,
    mount_of,
    parse_mountinfo,
    probe_directory,
    unescape_mount_field,
)
from lattice_agent.scratch import Scratch
from lattice_agent.service import NodeAgentService
from lattice_agent.telemetry import TelemetryLoop
from lattice_agent.telemetry.ebpf import IO_LATENCY_P99, EbpfSource, hist_percentile, probe
from lattice_agent.telemetry.samples import AllocLabels, Target
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation, AllocationSpec

pytestmark = pytest.mark.timeout(60)

SAMPLE = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:22 / /proc rw,nosuid shared:12 - proc proc rw
40 22 0:35 / /scratch rw,relatime shared:20 - tmpfs tmpfs rw,size=1024k
41 22 0:36 / /home/my\\040files rw shared:21 - nfs4 srv:/export/home\\040x rw
42 40 0:37 / /scratch/job rw - xfs /dev/nvme0n1 rw
"""


def _escape(text: str) -> str:
    out = []
    for ch in text:
        out.append(f"\\{ord(ch):03o}" if ch in " \t\n\\" else ch)
    return "".join(out)


segment = st.text(
    st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/"),
    min_size=1,
    max_size=8,
).map(lambda s: s.replace("\x00", "x"))


@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=30))
def test_unescape_reads_back_what_the_kernel_escapes(text: str) -> None:
    assert unescape_mount_field(_escape(text)) == text


def test_parse_mountinfo_sample() -> None:
    mounts = parse_mountinfo(SAMPLE + "garbage line\n")
    assert [m.mount_point for m in mounts] == [
        "/",
        "/proc",
        "/scratch",
        "/home/my files",
        "/scratch/job",
    ]
    assert mounts[3] == Mount("/home/my files", "nfs4", "srv:/export/home x")
    assert mount_of("/scratch/job/a1", mounts) == Mount("/scratch/job", "xfs", "/dev/nvme0n1")
    assert mount_of("/scratch/jobs", mounts) == Mount("/scratch", "tmpfs", "tmpfs")
    assert mount_of("/home/my files/u", mounts).fs_type == "nfs4"  # type: ignore[union-attr]
    assert mount_of("/etc", mounts).mount_point == "/"  # type: ignore[union-attr]
    assert mount_of("/etc", []) is None


@given(
    st.lists(st.lists(segment, min_size=1, max_size=3), min_size=1, max_size=6),
    st.lists(segment, min_size=1, max_size=5),
)
def test_mount_of_is_the_longest_containing_mount_point(
    points: list[list[str]], path: list[str]
) -> None:
    mounts = [Mount("/", "ext4", "/dev/root")] + [
        Mount("/" + "/".join(p), "fs", "src") for p in points
    ]
    target = "/" + "/".join(path)
    got = mount_of(target, mounts)
    assert got is not None
    containing = [
        m.mount_point
        for m in mounts
        if m.mount_point == "/" or target == m.mount_point or target.startswith(m.mount_point + "/")
    ]
    assert got.mount_point == max(containing, key=len)


@given(st.lists(st.integers(0, 1000), max_size=40))
def test_latency_buckets_keep_every_request(slots: list[int]) -> None:
    buckets = latency_buckets(slots)
    assert sum(n for _, _, n in buckets) == sum(slots)
    for (lo, hi, _), (lo2, _, _) in itertools.pairwise(buckets):
        assert lo < hi == lo2  # contiguous, increasing
    if buckets:
        assert buckets[0][2] > 0 and buckets[-1][2] > 0
        p99 = hist_percentile(slots, 99.0)
        assert p99 is not None and buckets[0][0] <= p99 / 1000.0 <= buckets[-1][1]


def test_probe_of_a_real_directory(tmp_path: Path) -> None:
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    got = probe_directory(str(tmp_path), mounts)
    assert got.error == "" and not got.timed_out
    assert got.total_bytes > 0 and 0 < got.free_bytes <= got.total_bytes
    assert got.probe_seconds > 0 and got.mount_point and got.fs_type
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    missing = probe_directory(str(tmp_path / "missing"), mounts)
    assert missing.error.startswith("statvfs: ") and "No such file" in missing.error
    (tmp_path / "file").write_text("x")
    not_dir = probe_directory(str(tmp_path / "file"), mounts)
    assert not_dir.error  # statvfs works on a file; creating in it does not


def _alloc(alloc_id: str, submit_dir: str = "") -> Allocation:
    spec = AllocationSpec(entrypoint="x", tenant="t", vcluster="v", submit_dir=submit_dir)
    return Allocation(id=alloc_id, spec=spec)


def test_directories_are_the_workdir_and_scratch_that_exist(tmp_path: Path) -> None:
    scratch = Scratch(tmp_path / "scratch")
    d = Diagnoser("n1", allocation=lambda _: None, work_dir=tmp_path / "work", scratch=scratch)
    assert d.directories("a1", _alloc("a1")) == []
    (tmp_path / "work" / "a1").mkdir(parents=True)
    scratch.path("a1").mkdir(parents=True)
    assert d.directories("a1", _alloc("a1")) == [
        ("working directory", str(tmp_path / "work" / "a1")),
        ("scratch", str(scratch.path("a1"))),
    ]
    submit = tmp_path / "home" / "proj"
    submit.mkdir(parents=True)
    assert d.directories("a1", _alloc("a1", str(submit)))[0] == ("working directory", str(submit))


async def test_a_hung_probe_is_given_up_and_not_repeated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mount that never answers (an NFS server gone) is stood in for by a probe that
    blocks until released: the RPC answers within its timeout, and while the probe
    hangs no second thread is started for the same directory."""
    release = threading.Event()
    started: list[str] = []
    real = diagnostics.probe_directory

    def hung(path: str, mounts: Any = ()) -> v1.MountHealth:
        started.append(path)
        release.wait(30)
        return real(path, mounts)

    monkeypatch.setattr(diagnostics, "probe_directory", hung)
    (tmp_path / "work" / "a1").mkdir(parents=True)
    alloc = _alloc("a1")
    d = Diagnoser(
        "n1", allocation=lambda i: alloc if i == "a1" else None, work_dir=tmp_path / "work"
    )
    req = v1.DiagnoseRequest(allocation_id="a1", probe_timeout_seconds=0.3)
    try:
        t0 = time.monotonic()
        (m,) = (await d.diagnose(req)).mounts
        assert time.monotonic() - t0 < 5
        assert m.timed_out and "did not finish within 0.3 s" in m.error
        (m2,) = (await d.diagnose(req)).mounts
        assert m2.timed_out and "earlier probe" in m2.error
        assert len(started) == 1
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while d._stuck and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    (m3,) = (await d.diagnose(req)).mounts
    assert not m3.timed_out and m3.error == "" and len(started) == 2


async def test_diagnose_rpc_on_loopback(tmp_path: Path) -> None:
    alloc = _alloc("a1")
    assigned = {"a1": alloc}
    (tmp_path / "work" / "a1").mkdir(parents=True)
    service = NodeAgentService(
        "n1",
        None,  # type: ignore[arg-type]
        tmp_path,
        allocation=assigned.get,
        diagnostics=Diagnoser("n1", allocation=assigned.get, work_dir=tmp_path / "work"),
    )
    server = Server([service])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    channel = Channel("127.0.0.1", port)
    try:
        stub = v1.NodeAgentServiceStub(channel, timeout=10)
        got = await stub.diagnose(v1.DiagnoseRequest(allocation_id="a1"))
        assert got.node_id == "n1" and got.allocation_id == "a1"
        (m,) = got.mounts
        assert m.role == "working directory" and m.path == str(tmp_path / "work" / "a1")
        assert m.error == "" and m.free_bytes > 0
        assert not got.latest and not got.io_latency and got.io_latency_p99_us is None
        with pytest.raises(grpclib.GRPCError) as e:
            await stub.diagnose(v1.DiagnoseRequest(allocation_id="other"))
        assert e.value.status == grpclib.Status.NOT_FOUND
        assert "allocation other is not on node n1" in (e.value.message or "")
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


def test_probe_files_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe file is created 0600 with O_EXCL, so nobody else reads or swaps it."""
    seen: list[int] = []
    real_open = os.open

    def watching(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        fd = real_open(path, flags, mode, **kw)
        if flags & os.O_CREAT:
            seen.append(os.fstat(fd).st_mode & 0o777)
            assert flags & os.O_EXCL and flags & os.O_NOFOLLOW
        return fd

    monkeypatch.setattr(os, "open", watching)
    assert probe_directory(str(tmp_path)).error == ""
    assert seen == [0o600]


# --------------------------------------------------------------------------- real kernel

_EBPF_OK, _EBPF_WHY = probe()

_WRITER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
block = os.urandom(4096)
end = time.monotonic() + 30
while time.monotonic() < end:
    os.pwrite(fd, block, 0)
    os.fsync(fd)
"""


def _block_dir(*candidates: Path) -> Path | None:
    for d in candidates:
        try:
            st = os.stat(d)
        except OSError:
            continue
        if Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").exists():
            return d
    return None


@pytest.mark.skipif(not _EBPF_OK, reason=f"eBPF cannot run here: {_EBPF_WHY}")
async def test_io_latency_histogram_of_a_job_that_fsyncs(tmp_path: Path) -> None:
    """A job writing with fsync, measured by the real eBPF source in a real telemetry
    loop: Diagnose answers its block I/O latency histogram and percentiles."""
    io_dir = _block_dir(tmp_path, Path.cwd(), Path("/var/tmp"))
    if io_dir is None:
        pytest.skip("no writable directory on a block device (tmpfs/overlay only)")
    data = io_dir / f".lattice-diag-test-{os.getpid()}"
    job = subprocess.Popen([sys.executable, "-c", _WRITER, str(data)], start_new_session=True)
    source = EbpfSource(overhead_interval=3600)
    alloc = _alloc("io1")
    loop = TelemetryLoop(
        lambda: [Target(AllocLabels("io1", "n1", "t", "u", "v"), (job.pid,))],
        [source],
        interval=0.2,
        window_seconds=1.0,
    )
    task = asyncio.create_task(loop.run())
    d = Diagnoser("n1", allocation=lambda i: alloc if i == "io1" else None, telemetry=loop)
    try:
        deadline = time.monotonic() + 30
        got = v1.NodeDiagnosis()
        while time.monotonic() < deadline:
            got = await d.diagnose(v1.DiagnoseRequest(allocation_id="io1"))
            if got.io_latency and sum(b.count for b in got.io_latency) >= 20:
                break
            await asyncio.sleep(0.3)
        assert got.io_latency, "no block I/O latency measured"
        p50, p95, p99 = got.io_latency_p50_us, got.io_latency_p95_us, got.io_latency_p99_us
        assert p50 is not None and p95 is not None and p99 is not None
        assert 0 < p50 <= p95 <= p99
        assert got.io_latency[0].low_us <= p50 and p99 <= got.io_latency[-1].high_us
        assert got.latest.get(IO_LATENCY_P99, 0) > 0  # the loop's own reading agrees
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        source.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(10)
        with contextlib.suppress(OSError):
            data.unlink()
