"""File-access events of audited allocations (spec: Telemetry Architecture, "Mode: audit
(sensitive vCluster) — All file access events (open, read, write, close) with user
identity"; Sensitive Workloads, Audit Trail: "Data access: every file open/read/write
(from eBPF audit telemetry)").

While at least one allocation on the node is in audit mode (``TelemetryLoop.mode``), the
eBPF program ``infra/ebpf/file_access.c`` is loaded (with Debian's bcc, as the metric
programs are: :func:`~lattice_agent.telemetry.ebpf.load_bcc`, :func:`~.ebpf.probe`) and
sees every ``openat``/``open``/``openat2`` of the audited allocations' tasks, filtered in
the kernel by a map of their thread ids (seeded here from the allocation's scope
``cgroup.procs``, else its process groups, as the /proc collector finds them; children
and threads are added at fork) or, for cgroup v2 scopes, their cgroup id. When no
allocation is audited any more the program is unloaded: nodes without sensitive work pay
nothing.

Each open becomes a record ``{time, allocation_id, node_id, user, uid, pid, tid, comm,
path, cwd, flags, result, count, source, suppressed}``: ``user`` is the allocation's
user (the identity the access is attributed to), ``flags`` the access (``r``, ``w``,
``rw``, ``path``) then ``create``, ``trunc``, ``append``, ``directory``
(:func:`decode_flags`), ``result`` the file descriptor or ``-errno``.

Floods are bounded (:class:`Dedup`): within a window (10 s) the first open of a
``(pid, path, flags, ok)`` goes out at once and its repeats are counted into one record
(``count``) at the window's end; an allocation opening more than ``max_keys`` (2000)
distinct files in a window has the rest summarised in one ``suppressed`` record with
their number. Records wait in a bounded buffer (:class:`Outbox`, 20,000) and are shipped
to the API (NodeService.ReportFileAccess, recorded in the audit log as ``file.access``)
in batches, retried with backoff while the API is unreachable; what the buffer or the
kernel's ring buffer cannot hold is dropped, counted, and reported with the next batch
(the audit log then says how many are missing). The API's answer names the allocations
of the node the cluster audits (sensitive ones): they are switched to audit mode here
(and stay there: modes are persisted).

Without eBPF (not root, no bcc, no headers, ``LATTICE_TELEMETRY_EBPF=off``) the node says
so loudly: an error in the log for each audited allocation, the gauge
``lattice_agent_file_access_ebpf{node_id}`` 0, and the heartbeat's telemetry note
(``lattice nodes ID``) ``file-access:proc-sampled``. Files are then *sampled*: every pass
(0.5 s) the audited processes' ``/proc/<pid>/fd`` are read and each newly open file is a
record with ``source`` ``proc-sampled`` (files opened and closed between two passes are
missed; the flags come from ``fdinfo``; ``result`` is the fd).

Not traced: reads, writes and closes themselves (the access mode of the open stands for
them; tracing every read/write syscall of the node is a cost audit mode does not need),
opens in the instant between an allocation's start and its pids being seeded (children
forked after the seeding are caught by the kernel side).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client import Counter, Gauge

from lattice_agent.telemetry.ebpf import BCC_DIR, load_bcc, probe, programs_dir
from lattice_agent.telemetry.members import members
from lattice_agent.telemetry.samples import MODE_AUDIT, Target

log = logging.getLogger("lattice.agent.telemetry.fileaudit")

__all__ = [
    "DROPPED",
    "EBPF",
    "EVENTS",
    "SHIPPED",
    "Dedup",
    "FileAudit",
    "FileEvent",
    "Outbox",
    "decode_flags",
    "node_service_report",
]

EVENTS = Counter(
    "lattice_agent_file_access_events_total",
    "File opens by audited allocations seen on this node (each repeat counted)",
    ["node_id"],
)
SHIPPED = Counter(
    "lattice_agent_file_access_records_shipped_total",
    "File-access records the API accepted for the audit log",
    ["node_id"],
)
DROPPED = Counter(
    "lattice_agent_file_access_dropped_total",
    "File-access events lost on this node: kernel_buffer (ring buffer full), "
    "agent_buffer (the agent's buffer full while the API was unreachable), rejected (the "
    "API refused them)",
    ["node_id", "reason"],
)
EBPF = Gauge(
    "lattice_agent_file_access_ebpf",
    "1 while file-access events of audited allocations come from eBPF; 0 while an "
    "audited allocation runs without it (its files are only sampled from /proc)",
    ["node_id"],
)

PROGRAM = "file_access.c"
SOURCE_EBPF = "ebpf"
SOURCE_SAMPLED = "proc-sampled"
PATH_MAX = 256  # must match FA_PATH_MAX in file_access.c
MAX_SLOTS = 256

# open(2) flags (asm-generic; x86_64, arm64, ppc64le and riscv64 agree on these)
O_ACCMODE = 0o3
O_WRONLY = 0o1
O_RDWR = 0o2
O_CREAT = 0o100
O_TRUNC = 0o1000
O_APPEND = 0o2000
O_DIRECTORY = 0o200000
O_PATH = 0o10000000


# --------------------------------------------------------------------------- pure parts


def decode_flags(flags: int) -> str:
    """open(2) flags as an audit reads them: the access (``r``, ``w``, ``rw``, or ``path``
    for an ``O_PATH`` descriptor that can neither read nor write) then ``create``,
    ``trunc``, ``append``, ``directory`` when set, comma-separated."""
    flags = int(flags)
    if flags & O_PATH:
        parts = ["path"]
    else:
        acc = flags & O_ACCMODE
        parts = ["r" if acc == 0 else "w" if acc == O_WRONLY else "rw"]
    for bit, name in ((O_CREAT, "create"), (O_TRUNC, "trunc"), (O_APPEND, "append")):
        if flags & bit:
            parts.append(name)
    if flags & O_DIRECTORY:
        parts.append("directory")
    return ",".join(parts)


@dataclass(frozen=True)
class FileEvent:
    """One open as a record (module docstring); ``count`` opens it stands for."""

    time: float
    allocation_id: str
    node_id: str
    user: str
    uid: int
    pid: int
    tid: int
    comm: str
    path: str
    flags: str
    result: int
    cwd: str = ""
    count: int = 1
    source: str = SOURCE_EBPF
    suppressed: bool = False

    @property
    def key(self) -> tuple[str, int, str, str, bool]:
        """What repeats of one open share: allocation, process, path, flags, success."""
        return (self.allocation_id, self.pid, self.path, self.flags, self.result >= 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "allocation_id": self.allocation_id,
            "node_id": self.node_id,
            "user": self.user,
            "uid": self.uid,
            "pid": self.pid,
            "tid": self.tid,
            "comm": self.comm,
            "path": self.path,
            "cwd": self.cwd,
            "flags": self.flags,
            "result": self.result,
            "count": self.count,
            "source": self.source,
            "suppressed": self.suppressed,
        }


@dataclass
class Dedup:
    """Repeats and floods bounded per window (module docstring); pure: times are passed
    in. ``offer`` answers what goes out at once, ``flush`` what a window leaves (the
    repeat counts and the suppressed summaries) once it ended, or always with
    ``force``. Every open offered is counted exactly once in what comes out."""

    window: float = 10.0
    max_keys: int = 2000  # distinct opens per allocation and window shipped one by one
    _start: float | None = None
    _repeats: dict[tuple[str, int, str, str, bool], FileEvent] = field(default_factory=dict)
    _seen: dict[tuple[str, int, str, str, bool], int] = field(default_factory=dict)
    _keys: dict[str, int] = field(default_factory=dict)  # allocation -> distinct keys
    _suppressed: dict[str, FileEvent] = field(default_factory=dict)

    def offer(self, ev: FileEvent, now: float) -> list[FileEvent]:
        out = self.flush(now)
        if self._start is None:
            self._start = now
        key = ev.key
        if key in self._seen:
            self._seen[key] += ev.count
            self._repeats[key] = ev  # the last one gives the record its time
            return out
        aid = ev.allocation_id
        if self._keys.get(aid, 0) >= self.max_keys:
            s = self._suppressed.get(aid)
            self._suppressed[aid] = replace(
                ev,
                count=(s.count if s is not None else 0) + ev.count,
                path="",
                cwd="",
                flags="",
                result=0,
                suppressed=True,
            )
            return out
        self._keys[aid] = self._keys.get(aid, 0) + 1
        self._seen[key] = 0
        out.append(ev)
        return out

    def flush(self, now: float, *, force: bool = False) -> list[FileEvent]:
        if self._start is None or (not force and now < self._start + self.window):
            return []
        out = [replace(self._repeats[k], count=n) for k, n in self._seen.items() if n > 0]
        out.extend(self._suppressed.values())
        self._start = None
        self._repeats.clear()
        self._seen.clear()
        self._keys.clear()
        self._suppressed.clear()
        return out


@dataclass
class Outbox:
    """The records waiting for the API, oldest first, at most ``limit``: what does not
    fit drops the oldest, counted in ``dropped`` until a report carries the number."""

    limit: int = 20_000
    _items: deque[FileEvent] = field(default_factory=deque)
    dropped: int = 0

    def put(self, records: Iterable[FileEvent]) -> int:
        """Queue ``records``; returns how many (old) records were dropped for them."""
        lost = 0
        for r in records:
            if len(self._items) >= self.limit:
                self._items.popleft()
                lost += 1
            self._items.append(r)
        self.dropped += lost
        return lost

    def peek(self, n: int) -> list[FileEvent]:
        return [self._items[i] for i in range(min(n, len(self._items)))]

    def done(self, n: int) -> None:
        """The first ``n`` records were delivered."""
        for _ in range(min(n, len(self._items))):
            self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


# --------------------------------------------------------------------------- processes


def _boot_offset() -> float:
    """Wall time minus CLOCK_BOOTTIME (the kernel stamps events with the latter)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


# --------------------------------------------------------------------------- the kernel side


class _Kernel:
    """``file_access.c`` loaded with bcc; every method runs in a worker thread."""

    def __init__(self, programs: Path, bcc_dir: Path) -> None:
        self.programs = programs
        self.bcc_dir = bcc_dir
        self._bcc: ModuleType | None = None
        self._bpf: Any = None
        self._events: list[tuple[Any, ...]] = []
        self._lost_seen = 0
        self.seeded: dict[int, set[int]] = {}  # slot -> pids put in the map
        self.cgroups: dict[int, int] = {}  # slot -> cgroup id registered

    def load(self) -> None:
        bcc = load_bcc(self.bcc_dir)
        text = (self.programs / PROGRAM).read_text()
        cflags = ["-Wno-unused-function"]
        events = self._tracefs_events()
        for name, define in (
            ("sys_enter_open", "LATTICE_FA_OPEN"),
            ("sys_enter_openat2", "LATTICE_FA_OPENAT2"),
        ):
            if events is not None and (events / "syscalls" / name / "format").is_file():
                cflags.append(f"-D{define}")
        b = bcc.BPF(text=text.encode(), cflags=cflags)  # tracepoints attach themselves
        self._bcc, self._bpf = bcc, b
        self._audited = b[b"audited"]
        self._cgroups = b[b"audited_cgroups"]
        self._config = b[b"fa_config"]
        self._lost = b[b"fa_lost"]
        ring = b[b"file_events"]

        def on_event(_ctx: Any, data: Any, _size: int) -> None:
            e = ring.event(data)
            self._events.append(
                (
                    e.time_ns,
                    e.tgid,
                    e.tid,
                    e.uid,
                    e.slot,
                    e.flags,
                    e.result,
                    bytes(e.comm),
                    bytes(e.path),
                )
            )

        ring.open_ring_buffer(on_event)
        self._on_event = on_event  # bcc keeps a weak hold only

    @staticmethod
    def _tracefs_events() -> Path | None:
        for d in (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing")):
            if (d / "events" / "syscalls").is_dir():
                return d / "events"
        return None

    def close(self) -> None:
        if self._bpf is not None:
            with contextlib.suppress(Exception):
                self._bpf.cleanup()
        self._bpf = None
        self.seeded.clear()
        self.cgroups.clear()

    def seed(self, slot: int, pids: Iterable[int]) -> None:
        """Put ``pids`` in the filter for ``slot`` (those already there keep their entry)."""
        assert self._bcc is not None
        done = self.seeded.setdefault(slot, set())
        update = self._bcc.libbcc.lib.bpf_update_elem
        value = ctypes.c_uint32(slot)
        now = set(pids)
        for pid in now - done:
            key = ctypes.c_uint32(pid)
            update(self._audited.map_fd, ctypes.byref(key), ctypes.byref(value), 0)
        done |= now
        if len(done) > 4 * len(now) + 64:  # forget pids long gone
            done &= now

    def set_cgroup(self, slot: int, directory: Path | None) -> None:
        old = self.cgroups.pop(slot, None)
        if old is not None:
            with contextlib.suppress(Exception):
                del self._cgroups[ctypes.c_uint64(old)]
        if directory is not None:
            with contextlib.suppress(OSError):
                cg = os.stat(directory).st_ino  # the cgroup id on v2
                self._cgroups[ctypes.c_uint64(cg)] = ctypes.c_uint32(slot)
                self.cgroups[slot] = cg
        with contextlib.suppress(Exception):
            self._config[ctypes.c_int(0)] = ctypes.c_uint32(len(self.cgroups))

    def drop(self, slot: int) -> None:
        """The allocation left audit mode: its tasks (seeded or inherited) leave the map."""
        self.set_cgroup(slot, None)
        self.seeded.pop(slot, None)
        with contextlib.suppress(Exception):
            for k, v in list(self._audited.items()):
                if v.value == slot:
                    with contextlib.suppress(KeyError):
                        del self._audited[k]

    def poll(self) -> tuple[list[tuple[Any, ...]], int]:
        """The events since the last poll, and how many the ring buffer had no room for."""
        self._bpf.ring_buffer_consume()
        got, self._events = self._events, []
        lost = 0
        with contextlib.suppress(Exception):
            lost = sum(int(x) for x in self._lost[ctypes.c_int(0)])
        new, self._lost_seen = max(0, lost - self._lost_seen), lost
        return got, new


# --------------------------------------------------------------------------- the shell


Report = Callable[[list[dict[str, Any]], int], Awaitable[Sequence[str]]]


@dataclass
class _Audited:
    slot: int
    target: Target | None = None
    cgroup_dir: Path | None = None
    sampled_fds: set[tuple[int, int, str]] = field(default_factory=set)


class FileAudit:
    """The node's file-access auditing (module docstring).

    ``mode_of(alloc_id)`` is the telemetry loop's mode, ``set_audit(alloc_id)`` switches
    one to audit mode (the cluster says it is audited); ``assigned()`` the allocations
    the desired state puts here, ``targets()`` those running (with their processes);
    ``report(records, dropped)`` ships a batch and answers the allocations the cluster
    audits (None: no API, records are only logged). ``use_ebpf`` None = :func:`probe`."""

    def __init__(
        self,
        node_id: str,
        *,
        mode_of: Callable[[str], str],
        set_audit: Callable[[str], object],
        assigned: Callable[[], Iterable[str]],
        targets: Callable[[], Iterable[Target]],
        report: Report | None,
        use_ebpf: bool | None = None,
        programs: Path | None = None,
        bcc_dir: Path = BCC_DIR,
        proc_root: Path | str = "/proc",
        interval: float = 0.5,
        ship_interval: float = 1.0,
        window: float = 10.0,
        max_keys: int = 2000,
        buffer_limit: int = 20_000,
        batch: int = 500,
        classify_every: float = 60.0,
    ) -> None:
        self.node_id = node_id
        self._mode_of = mode_of
        self._set_audit = set_audit
        self._assigned = assigned
        self._targets = targets
        self._report = report
        # None: probe() when an allocation is first audited (bcc is not even imported
        # on nodes that never audit)
        self.use_ebpf = use_ebpf
        self.ebpf_reason = "" if use_ebpf is not False else "switched off"
        self.programs = programs or programs_dir()
        self.bcc_dir = Path(bcc_dir)
        self.proc = Path(proc_root)
        self.interval = interval
        self.ship_interval = ship_interval
        self.batch = batch
        self.classify_every = classify_every
        self.dedup = Dedup(window, max_keys)
        self.outbox = Outbox(buffer_limit)
        self._kernel: _Kernel | None = None
        self._lock = threading.Lock()
        self._audited: dict[str, _Audited] = {}
        self._free: deque[int] = deque(range(MAX_SLOTS))
        self._said: set[str] = set()
        self._known: frozenset[str] = frozenset()
        self._classified_at = -1e18
        self._next_ship = 0.0
        self._backoff = 0.0
        self._failures = 0
        self._offset = _boot_offset()

    # --- what the node says ---------------------------------------------------------

    @property
    def active(self) -> bool:
        return bool(self._audited)

    def watching(self, alloc_id: str) -> bool:
        """Whether the kernel filter holds the allocation's processes (eBPF only)."""
        a = self._audited.get(alloc_id)
        k = self._kernel
        return a is not None and k is not None and bool(k.seeded.get(a.slot))

    @property
    def source(self) -> str:
        return SOURCE_EBPF if self._kernel is not None else SOURCE_SAMPLED

    def notes(self) -> list[str]:
        """For the heartbeat's telemetry note: how file access is audited, while it is."""
        if not self._audited:
            return []
        if self._kernel is not None:
            return ["file-access:ebpf"]
        return ["file-access:proc-sampled"]

    # --- one pass ---------------------------------------------------------------------

    def audit_set(self) -> dict[str, Target | None]:
        """The allocations in audit mode here, with their running target (None: not
        running yet)."""
        running = {t.alloc_id: t for t in self._targets()}
        ids = set(self._assigned()) | set(running)
        return {aid: running.get(aid) for aid in sorted(ids) if self._mode_of(aid) == MODE_AUDIT}

    def step(
        self, wanted: Mapping[str, Target | None] | None = None, now: float | None = None
    ) -> list[FileEvent]:
        """One pass (in a worker thread, ``wanted`` = :meth:`audit_set` taken on the event
        loop): follow the audited set, seed the filter, read the events (or sample
        /proc); answers what goes out now (deduplicated)."""
        if wanted is None:
            wanted = self.audit_set()
        with self._lock:
            raw = self._pass(wanted)
        now = time.time() if now is None else now
        out: list[FileEvent] = []
        for ev in raw:
            out.extend(self.dedup.offer(ev, now))
        out.extend(self.dedup.flush(now))
        if raw:
            EVENTS.labels(self.node_id).inc(sum(e.count for e in raw))
        return out

    def _pass(self, wanted: Mapping[str, Target | None]) -> list[FileEvent]:
        # what the kernel holds first: the last opens of an allocation that just ended
        # are attributed before it leaves the table (and before an unload)
        drained = self._read_kernel(seed=False) if self._kernel is not None else []
        for gone in set(self._audited) - set(wanted):
            a = self._audited.pop(gone)
            if self._kernel is not None:
                self._kernel.drop(a.slot)
            self._free.append(a.slot)
            log.info("allocation %s: file-access auditing ended", gone)
        for aid, t in wanted.items():
            a = self._audited.get(aid)
            if a is None:
                if not self._free:
                    self._say(
                        "full",
                        "more than %d audited allocations: the rest are not audited",
                        MAX_SLOTS,
                    )
                    continue
                a = self._audited[aid] = _Audited(self._free.popleft())
                log.info("allocation %s: file-access auditing started", aid)
            a.target = t if t is not None else a.target
        if not self._audited:
            if self._kernel is not None:
                self._kernel.close()
                self._kernel = None
                log.info("file-access eBPF program unloaded: no allocation is audited")
            EBPF.labels(self.node_id).set(0)
            return drained
        if self.use_ebpf is None:
            ok, why = probe()
            if ok and self.programs is None:
                ok, why = False, "eBPF C sources not found (infra/ebpf)"
            self.use_ebpf, self.ebpf_reason = ok, why
        if self.use_ebpf and self._kernel is None:
            self._load()
        if self._kernel is None:
            EBPF.labels(self.node_id).set(0)
            for aid in self._audited:
                self._say(
                    f"sampled:{aid}",
                    "AUDIT: allocation %s is audited but eBPF is unavailable (%s): its file "
                    "accesses are only SAMPLED from /proc/<pid>/fd; opens between two samples "
                    "are missed",
                    aid,
                    self.ebpf_reason,
                )
            return drained + self._sample()
        EBPF.labels(self.node_id).set(1)
        return drained + self._read_kernel()

    def _load(self) -> None:
        assert self.programs is not None
        k = _Kernel(self.programs, self.bcc_dir)
        t0 = time.monotonic()
        try:
            k.load()
        except Exception as e:
            self.use_ebpf = False
            self.ebpf_reason = f"{PROGRAM} failed to load: {type(e).__name__}: {e}"
            log.error("file-access auditing: %s", self.ebpf_reason)
            k.close()
            return
        self._kernel = k
        self._offset = _boot_offset()
        log.info("file-access eBPF program loaded in %.2f s", time.monotonic() - t0)

    def _read_kernel(self, *, seed: bool = True) -> list[FileEvent]:
        """The kernel's events since the last read (``seed``: first bring the filter up
        to date with the audited allocations' processes)."""
        k = self._kernel
        assert k is not None
        if seed:
            targets = [a.target for a in self._audited.values() if a.target is not None]
            pids = members(targets, self.proc)
            for aid, a in self._audited.items():
                if a.target is None:
                    continue
                k.seed(a.slot, pids.get(aid, ()))
                v2 = _v2_dir(a.target)
                if v2 != a.cgroup_dir:
                    k.set_cgroup(a.slot, v2)
                    a.cgroup_dir = v2
        raw, lost = k.poll()
        if lost:
            DROPPED.labels(self.node_id, "kernel_buffer").inc(lost)
            self.outbox.dropped += lost
            log.error("file-access: the kernel ring buffer was full: %d events lost", lost)
        by_slot = {a.slot: (aid, a) for aid, a in self._audited.items()}
        out: list[FileEvent] = []
        for time_ns, tgid, tid, uid, slot, flags, result, comm, path in raw:
            found = by_slot.get(slot)
            if found is None:
                continue  # an allocation that left audit mode since
            aid, a = found
            text = path.split(b"\0", 1)[0].decode(errors="replace")
            out.append(
                FileEvent(
                    time=self._offset + time_ns / 1e9,
                    allocation_id=aid,
                    node_id=self.node_id,
                    user=a.target.labels.user if a.target is not None else "",
                    uid=int(uid),
                    pid=int(tgid),
                    tid=int(tid),
                    comm=comm.split(b"\0", 1)[0].decode(errors="replace"),
                    path=text,
                    cwd="" if text.startswith("/") else self._cwd(int(tgid)),
                    flags=decode_flags(int(flags)),
                    result=int(result),
                )
            )
        return out

    def _cwd(self, pid: int) -> str:
        with contextlib.suppress(OSError):
            return os.readlink(self.proc / str(pid) / "cwd")
        return ""

    def _sample(self) -> list[FileEvent]:
        """The fallback: newly open files of the audited processes (module docstring)."""
        targets = [a.target for a in self._audited.values() if a.target is not None]
        pids = members(targets, self.proc)
        now = time.time()
        out: list[FileEvent] = []
        for aid, a in self._audited.items():
            if a.target is None:
                continue
            current: set[tuple[int, int, str]] = set()
            for pid in pids.get(aid, ()):
                fd_dir = self.proc / str(pid) / "fd"
                try:
                    fds = os.listdir(fd_dir)
                    status = (self.proc / str(pid) / "status").read_text()
                    comm = (self.proc / str(pid) / "comm").read_text().strip()
                except OSError:
                    continue
                uid = _status_uid(status)
                for name in fds:
                    try:
                        target = os.readlink(fd_dir / name)
                    except OSError:
                        continue
                    if not target.startswith("/"):
                        continue  # pipes, sockets, anon inodes: not files
                    entry = (pid, int(name), target)
                    current.add(entry)
                    if entry in a.sampled_fds:
                        continue
                    out.append(
                        FileEvent(
                            time=now,
                            allocation_id=aid,
                            node_id=self.node_id,
                            user=a.target.labels.user,
                            uid=uid,
                            pid=pid,
                            tid=pid,
                            comm=comm,
                            path=target,
                            flags=decode_flags(_fd_flags(self.proc, pid, name)),
                            result=int(name),
                            source=SOURCE_SAMPLED,
                        )
                    )
            a.sampled_fds = current
        return out

    def _say(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            log.error(msg, *args)

    def close(self) -> None:
        with self._lock:
            if self._kernel is not None:
                self._kernel.close()
                self._kernel = None

    # --- shipping ---------------------------------------------------------------------

    async def ship(self, *, force_classify: bool = False) -> bool:
        """One report: the oldest batch (maybe none, to learn which allocations are
        audited); False when the API could not be reached (the batch stays)."""
        if self._report is None:
            for r in self.outbox.peek(len(self.outbox)):
                log.info("file access (no API to report to): %s", r.as_dict())
            self.outbox.done(len(self.outbox))
            return True
        batch = self.outbox.peek(self.batch)
        dropped = self.outbox.dropped
        try:
            audited = await self._report([r.as_dict() for r in batch], dropped)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._failures += 1
            if self._failures in (1, 10) or self._failures % 100 == 0:
                log.warning(
                    "file-access report failed (%s); %d records wait (attempt %d)",
                    e,
                    len(self.outbox),
                    self._failures,
                )
            return False
        self._failures = 0
        self.outbox.done(len(batch))
        self.outbox.dropped -= dropped
        SHIPPED.labels(self.node_id).inc(len(batch))
        self._classified_at = time.monotonic()
        wanted = set(self._assigned())
        for aid in audited:
            if aid in wanted and self._mode_of(aid) != MODE_AUDIT:
                log.info("allocation %s is audited by the cluster: telemetry mode audit", aid)
                self._set_audit(aid)
        return True

    def _classify_due(self) -> bool:
        known = frozenset(self._assigned())
        changed = bool(known - self._known)
        self._known = known
        return bool(known) and (
            changed or time.monotonic() - self._classified_at >= self.classify_every
        )

    async def run(self) -> None:
        """Pass every ``interval`` and ship every ``ship_interval`` (backing off while the
        API is unreachable) until cancelled; what is queued at the end is logged."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    out = await asyncio.to_thread(self.step, self.audit_set())
                    lost = self.outbox.put(out)
                    if lost:
                        DROPPED.labels(self.node_id, "agent_buffer").inc(lost)
                        self._say("buffer", "file-access buffer full: oldest records dropped")
                    now = loop.time()
                    classify = self._classify_due()
                    if (
                        len(self.outbox) or self.outbox.dropped or classify
                    ) and now >= self._next_ship:
                        if await self.ship():
                            self._backoff = 0.0
                            self._said.discard("buffer")
                            # a full batch left: the next one goes at the next pass
                            self._next_ship = now + (
                                0.0 if len(self.outbox) >= self.batch else self.ship_interval
                            )
                        else:
                            self._backoff = min(max(self._backoff * 2, 1.0), 30.0)
                            self._next_ship = now + self._backoff
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("file-access auditing pass failed; continuing")
                await asyncio.sleep(self.interval)
        finally:
            if len(self.outbox):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.ship(), 2.0)
            await asyncio.to_thread(self.close)


def node_service_report(
    stub: Callable[[], Any], node_id: str, *, ready: Callable[[], bool] = lambda: True
) -> Report:
    """The agent's :data:`Report`: NodeService.ReportFileAccess through ``stub()`` (a
    NodeServiceStub with the agent's credentials); refused events are counted as dropped
    (``rejected``) and logged. ``ready()`` False (not registered yet) fails the call."""
    from lattice_common.proto.lattice import v1

    async def report(records: list[dict[str, Any]], dropped: int) -> list[str]:
        if not ready():
            raise ConnectionError("the node is not registered yet")
        resp = await stub().report_file_access(
            v1.ReportFileAccessRequest(
                node_id=node_id,
                dropped=dropped,
                events=[
                    v1.FileAccessEvent(**{k: v for k, v in r.items() if k in _WIRE})
                    for r in records
                ],
            ),
            timeout=10,
        )
        for r in resp.rejected:
            DROPPED.labels(node_id, "rejected").inc(r.count)
            log.warning("file-access events refused by the API: %s (%d)", r.reason, r.count)
        return list(resp.audited_allocations)

    return report


# FileEvent fields on the wire (node and user are the caller's and the quorum's)
_WIRE = frozenset(
    {
        "time",
        "allocation_id",
        "uid",
        "pid",
        "tid",
        "comm",
        "path",
        "cwd",
        "flags",
        "result",
        "count",
        "source",
        "suppressed",
    }
)


def _v2_dir(t: Target) -> Path | None:
    if t.scope is None:
        return None
    d = t.scope.dirs.get("")
    return d if d is not None and d.is_dir() else None


def _status_uid(status: str) -> int:
    for line in status.splitlines():
        if line.startswith("Uid:"):
            with contextlib.suppress(IndexError, ValueError):
                return int(line.split()[1])
    return -1  # unknown


def _fd_flags(proc: Path, pid: int, fd: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / str(pid) / "fdinfo" / fd).read_text().splitlines():
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    return 0
