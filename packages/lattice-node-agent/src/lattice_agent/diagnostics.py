"""NodeAgentService.Diagnose (``lattice diag``): the node-local facts of one allocation.

* **Mount health** of the directories the allocation works in here: its working directory
  (the submit directory when it exists on this node, else its work directory under the
  agent's ``work_dir``) and its scratch directory (``lattice_agent.scratch``), where they
  exist. Per directory: the mount it is on (``/proc/self/mountinfo``: mount point, file
  system type, source), ``statvfs`` (size, space and inodes available) and a timed probe:
  a small file created next to the job's files (``O_EXCL``, mode 0600), written, fsynced,
  read back, compared and removed, as the agent's user (a root-squashed NFS directory
  answers EACCES: the API marks that a warning). A probe runs in a thread and is given
  ``probe_timeout`` seconds: a hung mount (an NFS server gone) answers ``timed_out``,
  never a hung RPC. While a probe of a path is still stuck, the next one of that path
  reports ``timed_out`` at once instead of leaving another thread behind.
* **Latest values**: the allocation's last telemetry collection on this node
  (``TelemetryLoop.latest``), keys as the loop has them (catalog names, ``name{gpu=N}``
  for per-GPU series).
* **Block I/O latency histogram**: the eBPF source's cumulative histogram of the
  allocation's block requests (issue -> completion) since it was first measured here
  (``EbpfSource.io_histogram``), as buckets in microseconds with p50/p95/p99. Empty
  where eBPF does not run.

Health marks (ok/warning/critical) are the API's (``lattice_api.diagnostics``): this module
reports facts. The pure parts (mountinfo parsing, the mount of a path, histogram buckets)
are plain functions.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lattice_common.errors import NotFound
from lattice_common.proto.lattice import v1

from lattice_agent.telemetry.ebpf import EbpfSource, hist_percentile

log = logging.getLogger("lattice.agent.diagnostics")

__all__ = [
    "DEFAULT_PROBE_TIMEOUT",
    "PROBE_BYTES",
    "Diagnoser",
    "Mount",
    "latency_buckets",
    "mount_of",
    "parse_mountinfo",
    "probe_directory",
    "unescape_mount_field",
]

#: seconds one mount probe may take before the mount is reported hung
DEFAULT_PROBE_TIMEOUT = 5.0
MAX_PROBE_TIMEOUT = 60.0
#: bytes the probe writes (one page: the smallest write a file system really does)
PROBE_BYTES = 4096
PROBE_PREFIX = ".lattice-diag-"
ROLE_WORKDIR = "working directory"
ROLE_SCRATCH = "scratch"


# --------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/self/mountinfo``: where, what and from where."""

    mount_point: str
    fs_type: str
    source: str


def unescape_mount_field(field: str) -> str:
    """The kernel writes space, tab, newline and backslash in mountinfo fields as octal
    escapes (``\\040``); this reads them back. Anything else stays as it is."""
    out: list[str] = []
    i = 0
    while i < len(field):
        ch = field[i]
        if ch == "\\" and i + 4 <= len(field):
            digits = field[i + 1 : i + 4]
            if all(d in "01234567" for d in digits):
                out.append(chr(int(digits, 8)))
                i += 4
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a ``/proc/<pid>/mountinfo`` text, in its order (later lines are
    mounted over earlier ones). Lines that do not parse are skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 3:
            continue
        mounts.append(
            Mount(
                mount_point=unescape_mount_field(fields[4]),
                fs_type=unescape_mount_field(fields[sep + 1]),
                source=unescape_mount_field(fields[sep + 2]),
            )
        )
    return mounts


def _inside(path: str, mount_point: str) -> bool:
    if mount_point == "/":
        return path.startswith("/")
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def mount_of(path: str, mounts: Sequence[Mount]) -> Mount | None:
    """The mount ``path`` (absolute, symlinks resolved) is on: the longest mount point
    that contains it, the last such line when one is mounted over another."""
    best: Mount | None = None
    for m in mounts:
        if _inside(path, m.mount_point) and (
            best is None or len(m.mount_point) >= len(best.mount_point)
        ):
            best = m
    return best


def latency_buckets(slots: Sequence[int]) -> list[tuple[float, float, int]]:
    """A log2 histogram as the eBPF programs keep it (nanoseconds; slot 0: 0 ns, slot k:
    ``[2^(k-1), 2^k)``) as ``(low_us, high_us, count)`` buckets, from the first non-empty
    slot to the last (empty ones between them kept, so the shape shows)."""
    used = [k for k, n in enumerate(slots) if n > 0]
    if not used:
        return []
    out = []
    for k in range(used[0], used[-1] + 1):
        low = 0.0 if k == 0 else float(1 << (k - 1))
        high = 1.0 if k == 0 else float(1 << k)
        out.append((low / 1000.0, high / 1000.0, int(slots[k])))
    return out


# --------------------------------------------------------------------------- the probe


def _why(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


def probe_directory(path: str, mounts: Sequence[Mount] = ()) -> v1.MountHealth:
    """statvfs and the write+fsync+read probe of ``path`` (blocking: run it in a thread).
    Failures are in the answer (``error``, ``read_only``), never raised."""
    real = os.path.realpath(path)
    m = mount_of(real, mounts)
    out = v1.MountHealth(
        path=path,
        mount_point=m.mount_point if m else "",
        fs_type=m.fs_type if m else "",
        source=m.source if m else "",
    )
    t0 = time.perf_counter()
    try:
        st = os.statvfs(path)
        out.total_bytes = st.f_blocks * st.f_frsize
        out.free_bytes = st.f_bavail * st.f_frsize
        out.total_inodes = st.f_files
        out.free_inodes = st.f_favail
    except OSError as e:
        out.error = f"statvfs: {_why(e)}"
        out.probe_seconds = time.perf_counter() - t0
        return out
    name = os.path.join(path, PROBE_PREFIX + secrets.token_hex(6))
    payload = secrets.token_bytes(PROBE_BYTES)
    t0 = time.perf_counter()
    fd = -1
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
            fd = -1
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            back = os.read(fd, PROBE_BYTES + 1)
        finally:
            os.close(fd)
            fd = -1
        if back != payload:
            out.error = "the probe file read back differs from what was written"
    except OSError as e:
        out.read_only = e.errno == errno.EROFS
        out.error = _why(e)
    finally:
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("diagnostics: could not remove probe file %s: %s", name, _why(e))
    out.probe_seconds = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------- the service part


class Diagnoser:
    """Answers Diagnose for the allocations of one node.

    ``allocation``: the desired state's allocation by id (None: not on this node);
    ``running``: whether its entrypoint runs here; ``work_dir``/``scratch``: where the
    agent puts its work and scratch directories (``scratch`` has ``path(alloc_id)``);
    ``telemetry``: the telemetry loop (``latest``, ``sources``), None without one."""

    def __init__(
        self,
        node_id: str,
        *,
        allocation: Callable[[str], object | None],
        running: Callable[[str], bool] = lambda _: False,
        work_dir: Path | None = None,
        scratch: Any = None,
        telemetry: Any = None,
        mountinfo: Path = Path("/proc/self/mountinfo"),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node_id = node_id
        self.allocation = allocation
        self.running = running
        self.work_dir = Path(work_dir).absolute() if work_dir is not None else None
        self.scratch = scratch
        self.telemetry = telemetry
        self.mountinfo = mountinfo
        self.clock = clock
        # probes still running per path (a hung mount): not started again meanwhile
        self._stuck: dict[str, asyncio.Future[v1.MountHealth]] = {}

    # --- where the allocation works here ---------------------------------------------------

    def directories(self, alloc_id: str, alloc: object) -> list[tuple[str, str]]:
        """``(role, path)`` of the allocation's working directory and scratch that exist on
        this node, without duplicates."""
        out: list[tuple[str, str]] = []
        spec = getattr(alloc, "spec", None)
        submit_dir = getattr(spec, "submit_dir", "") or ""
        candidates: list[tuple[str, str]] = []
        if submit_dir and os.path.isabs(submit_dir):
            candidates.append((ROLE_WORKDIR, submit_dir))
        if self.work_dir is not None:
            candidates.append((ROLE_WORKDIR, str(self.work_dir / alloc_id)))
        if self.scratch is not None:
            try:
                candidates.append((ROLE_SCRATCH, str(self.scratch.path(alloc_id))))
            except ValueError:
                pass
        seen: set[str] = set()
        have_workdir = False
        for role, path in candidates:
            if role == ROLE_WORKDIR and have_workdir:
                continue
            try:
                if not os.path.isdir(path):
                    continue
            except OSError:
                continue
            if path in seen:
                continue
            seen.add(path)
            have_workdir = have_workdir or role == ROLE_WORKDIR
            out.append((role, path))
        return out

    def _mounts(self) -> list[Mount]:
        try:
            return parse_mountinfo(self.mountinfo.read_text())
        except OSError as e:
            log.warning("diagnostics: cannot read %s: %s", self.mountinfo, _why(e))
            return []

    async def _probe(
        self, role: str, path: str, mounts: list[Mount], timeout: float
    ) -> v1.MountHealth:
        stuck = self._stuck.get(path)
        if stuck is not None and not stuck.done():
            m = mount_of(os.path.abspath(path), mounts)
            return v1.MountHealth(
                role=role,
                path=path,
                mount_point=m.mount_point if m else "",
                fs_type=m.fs_type if m else "",
                source=m.source if m else "",
                timed_out=True,
                probe_seconds=timeout,
                error="an earlier probe of this directory has not finished (hung mount?)",
            )
        fut = asyncio.ensure_future(asyncio.to_thread(probe_directory, path, mounts))
        try:
            got = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            self._stuck[path] = fut
            fut.add_done_callback(lambda _f, p=path: self._forget_stuck(p, _f))
            log.warning("diagnostics: probe of %s did not finish within %g s", path, timeout)
            m = mount_of(os.path.abspath(path), mounts)
            return v1.MountHealth(
                role=role,
                path=path,
                mount_point=m.mount_point if m else "",
                fs_type=m.fs_type if m else "",
                source=m.source if m else "",
                timed_out=True,
                probe_seconds=timeout,
                error=f"the probe did not finish within {timeout:g} s",
            )
        got.role = role
        return got

    def _lookup_hung(self, alloc_id: str, alloc: object, timeout: float) -> v1.MountHealth:
        spec = getattr(alloc, "spec", None)
        path = getattr(spec, "submit_dir", "") or (
            str(self.work_dir / alloc_id) if self.work_dir is not None else ""
        )
        log.warning("diagnostics: looking up the directories of %s hung", alloc_id)
        return v1.MountHealth(
            role=ROLE_WORKDIR,
            path=path,
            timed_out=True,
            probe_seconds=timeout,
            error=f"looking the directory up did not finish within {timeout:g} s",
        )

    def _forget_stuck(self, path: str, fut: asyncio.Future[v1.MountHealth]) -> None:
        if self._stuck.get(path) is fut:
            del self._stuck[path]

    # --- telemetry facts ---------------------------------------------------------------------

    def _ebpf(self) -> EbpfSource | None:
        for src in getattr(self.telemetry, "sources", ()) or ():
            if isinstance(src, EbpfSource):
                return src
        return None

    def _io_histogram(self, alloc_id: str) -> Sequence[int] | None:
        src = self._ebpf()
        if src is None:
            return None
        return src.io_histogram(alloc_id)

    # --- the RPC -----------------------------------------------------------------------------

    async def diagnose(self, request: v1.DiagnoseRequest) -> v1.NodeDiagnosis:
        alloc_id = request.allocation_id
        alloc = self.allocation(alloc_id) if alloc_id else None
        if alloc is None:
            raise NotFound(
                f"allocation {alloc_id} is not on node {self.node_id}",
                details={"node": self.node_id},
                hint="`lattice status ID` shows the allocation's nodes.",
            )
        timeout = request.probe_timeout_seconds or DEFAULT_PROBE_TIMEOUT
        timeout = min(max(timeout, 0.1), MAX_PROBE_TIMEOUT)
        mounts = await asyncio.to_thread(self._mounts)
        try:
            # in a thread: looking at a directory on a hung mount blocks
            dirs = await asyncio.wait_for(
                asyncio.to_thread(self.directories, alloc_id, alloc), timeout
            )
        except TimeoutError:
            probes = [self._lookup_hung(alloc_id, alloc, timeout)]
        else:
            probes = await asyncio.gather(*(self._probe(r, p, mounts, timeout) for r, p in dirs))
        out = v1.NodeDiagnosis(
            node_id=self.node_id,
            allocation_id=alloc_id,
            timestamp=self.clock(),
            mounts=list(probes),
            runs_here=bool(self.running(alloc_id)),
        )
        reading = self.telemetry.latest(alloc_id) if self.telemetry is not None else None
        if reading is not None:
            out.latest = {k: float(v) for k, v in reading.values.items()}
            out.latest_timestamp = float(reading.at)
        # the source's lock may be held by a collection in its worker thread
        slots = await asyncio.to_thread(self._io_histogram, alloc_id)
        if slots:
            buckets = latency_buckets(slots)
            if buckets:
                out.io_latency = [
                    v1.LatencyBucket(low_us=lo, high_us=hi, count=n) for lo, hi, n in buckets
                ]
                for q, field in (
                    (50.0, "io_latency_p50_us"),
                    (95.0, "io_latency_p95_us"),
                    (99.0, "io_latency_p99_us"),
                ):
                    p = hist_percentile(slots, q)
                    if p is not None:
                        setattr(out, field, p / 1000.0)
        return out
