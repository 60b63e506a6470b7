"""The /proc + cgroup collector: the node's telemetry source when eBPF is not in use (and
always kept as the fallback, ARCHITECTURE.md section 5).

An allocation's processes are those of its cgroup scope when it runs in one (every pid in
the scope's ``cgroup.procs``, including processes that left the process group), else those
whose process group is one of the target's ``pgids`` (a scan of /proc). Per allocation and
collection it answers:

* ``cpu_utilization`` — percent of ONE core, summed over the allocation's processes on this
  node: a job keeping 2 cores busy reads 200. From the scope's CPU usage counter (v1
  ``cpuacct.usage``, v2 ``cpu.stat usage_usec``) between two collections; without a scope,
  from ``utime+stime+cutime+cstime`` of ``/proc/<pid>/stat`` summed per process
  (:func:`group_delta`).
* ``memory_used`` — bytes: the scope's memory usage (v1 ``memory.usage_in_bytes``, page
  cache included; v2 ``memory.current``), else the sum of the processes' RSS.
* ``io_read_bytes`` / ``io_write_bytes`` — bytes per second: the scope's v2 ``io.stat``
  (``rbytes``/``wbytes``) or v1 ``blkio`` byte counters when the scope has them, else
  ``read_bytes``/``write_bytes`` of ``/proc/<pid>/io`` (storage traffic, not page-cache
  hits) summed per process.
* ``network_tx_bytes`` / ``network_rx_bytes`` — bytes per second, only when attributable:
  the allocation's processes (all but those in the agent's own namespace, such as the
  spawn wrapper) live in one network namespace that no other allocation shares; then
  ``/proc/<pid>/net/dev`` of that namespace, every interface but ``lo``. Otherwise they
  are left out.

Rates need two collections: the first of an allocation only sets the baseline (it answers
``memory_used`` alone). Per-process sums follow each pid (by its kernel start time) between
collections: a process born since the last one counts in full, one that ended counts what
was seen of it, and when it was reaped by a parent that is itself measured (its total then
appears in the parent's cumulative ``cutime``/``cstime`` and I/O) what was already counted
of it is taken out again, so a shell running many short commands is neither lost nor
counted twice. Work of processes reaped outside the allocation (reparented orphans) after
the last collection is lost; a scope has no such gap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lattice_agent.cgroups import CgroupManager, Scope
from lattice_agent.telemetry.samples import (
    CPU_UTILIZATION,
    IO_READ_BYTES,
    IO_WRITE_BYTES,
    MEMORY_USED,
    NETWORK_ERROR_RATE,
    NETWORK_RX_BYTES,
    NETWORK_TX_BYTES,
    Target,
)

log = logging.getLogger("lattice.agent.telemetry")

__all__ = [
    "PidCounters",
    "ProcCollector",
    "ProcInfo",
    "group_delta",
    "parse_blkio",
    "parse_io",
    "parse_io_stat",
    "parse_net_dev",
    "parse_net_dev_counters",
    "parse_stat",
]

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# --------------------------------------------------------------------------- parsers (pure)


@dataclass(frozen=True)
class ProcInfo:
    """What one ``/proc/<pid>/stat`` says that telemetry needs."""

    pid: int
    ppid: int
    pgrp: int
    start: int  # kernel start time (clock ticks since boot): tells a reused pid apart
    cpu_ticks: int  # utime + stime + cutime + cstime (waited-for children included)
    rss_pages: int


def parse_stat(pid: int, data: bytes) -> ProcInfo | None:
    """``/proc/<pid>/stat`` (the command name may hold spaces and parentheses)."""
    try:
        rest = data[data.rindex(b")") + 2 :].split()
        # rest[0] is field 3 (state): field N is rest[N - 3]
        ticks = sum(int(rest[i]) for i in (11, 12, 13, 14))
        return ProcInfo(pid, int(rest[1]), int(rest[2]), int(rest[19]), ticks, int(rest[21]))
    except (ValueError, IndexError):
        return None


def parse_io(text: str) -> tuple[int, int] | None:
    """``read_bytes`` and ``write_bytes`` of ``/proc/<pid>/io``."""
    got: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("read_bytes", "write_bytes"):
            with contextlib.suppress(ValueError):
                got[key] = int(value)
    if len(got) != 2:
        return None
    return got["read_bytes"], got["write_bytes"]


def parse_io_stat(text: str) -> tuple[int, int]:
    """cgroup v2 ``io.stat``: ``rbytes`` and ``wbytes`` summed over devices."""
    r = w = 0
    for line in text.splitlines():
        for item in line.split()[1:]:
            key, _, value = item.partition("=")
            with contextlib.suppress(ValueError):
                if key == "rbytes":
                    r += int(value)
                elif key == "wbytes":
                    w += int(value)
    return r, w


def parse_blkio(text: str) -> tuple[int, int]:
    """cgroup v1 ``blkio.throttle.io_service_bytes``: ``MAJ:MIN Read|Write N`` summed."""
    r = w = 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3:
            with contextlib.suppress(ValueError):
                if parts[1] == "Read":
                    r += int(parts[2])
                elif parts[1] == "Write":
                    w += int(parts[2])
    return r, w


def parse_net_dev(text: str) -> dict[str, tuple[int, int]]:
    """``/proc/<pid>/net/dev``: interface -> (rx bytes, tx bytes)."""
    return {k: (v[0], v[1]) for k, v in parse_net_dev_counters(text).items()}


def parse_net_dev_counters(text: str) -> dict[str, tuple[int, int, int, int]]:
    """``/proc/<pid>/net/dev``: interface -> (rx bytes, tx bytes, packets both ways,
    errors both ways: errs + drop + fifo + frame/colls + carrier)."""
    out: dict[str, tuple[int, int, int, int]] = {}
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")
        if not sep:
            continue
        cols = rest.split()
        if len(cols) >= 16:
            with contextlib.suppress(ValueError):
                n = [int(x) for x in cols[:16]]
                errors = sum(n[2:6]) + sum(n[10:14])
                out[name.strip()] = (n[0], n[8], n[1] + n[9], errors)
        elif len(cols) >= 9:
            with contextlib.suppress(ValueError):
                out[name.strip()] = (int(cols[0]), int(cols[8]), 0, 0)
    return out


# --------------------------------------------------------------------------- per-process sums


@dataclass(frozen=True)
class PidCounters:
    """One process's cumulative counters at one collection (None: could not be read)."""

    start: int
    ppid: int
    cpu_ticks: int | None = None
    read_bytes: int | None = None
    write_bytes: int | None = None


def group_delta(
    prev: Mapping[int, PidCounters],
    now: Mapping[int, PidCounters],
    value: Callable[[PidCounters], int | None],
) -> float:
    """How much a group of processes consumed between two collections, from each
    process's cumulative counter (see the module docstring): increments of processes seen
    both times, the whole counter of processes born since, minus what was already counted
    of processes reaped in between by a parent that is still in the group (their total
    has moved into the parent's counter). Never negative."""
    total = 0
    for pid, c in now.items():
        v = value(c)
        if v is None:
            continue
        p = prev.get(pid)
        if p is not None and p.start == c.start:
            pv = value(p)
            if pv is not None:
                total += max(0, v - pv)
        else:
            total += v
    for pid, p in prev.items():
        c = now.get(pid)
        if c is not None and c.start == p.start:
            continue  # still here
        pv = value(p)
        if pv is not None and _reaped_inside(p, prev, now):
            total -= pv
    return float(max(0, total))


def _reaped_inside(
    gone: PidCounters, prev: Mapping[int, PidCounters], now: Mapping[int, PidCounters]
) -> bool:
    """Whether a process that vanished was reaped, directly or through parents that
    vanished too, by a process of the group that is still there."""
    seen: set[int] = set()
    p = gone
    while p.ppid not in seen:
        seen.add(p.ppid)
        then, still = prev.get(p.ppid), now.get(p.ppid)
        if then is None:
            return False  # its parent was never measured: reaped outside the group
        if still is not None and still.start == then.start:
            return True
        p = then  # the parent is gone as well: its total went on up
    return False


# --------------------------------------------------------------------------- the collector


@dataclass
class _State:
    mono: float
    pids: dict[int, PidCounters] = field(default_factory=dict)
    cg_cpu: float | None = None
    cg_io: tuple[int, int] | None = None
    net: tuple[str, int, int, int, int] | None = None  # (netns, rx, tx, packets, errors)


class ProcCollector:
    """The ``proc`` telemetry source (:class:`~lattice_agent.telemetry.samples.Source`)."""

    name = "proc"

    def __init__(
        self,
        cgroups: CgroupManager | None = None,
        *,
        proc_root: Path | str = "/proc",
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cgroups = cgroups
        self.proc = Path(proc_root)
        self._mono = monotonic
        self._state: dict[str, _State] = {}
        self._own_netns = self._netns_of("self")

    # --- Source -------------------------------------------------------------------------

    def forget(self, alloc_id: str) -> None:
        self._state.pop(alloc_id, None)

    def collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        now = self._mono()
        scoped = {t.alloc_id: t.scope for t in targets if self._in_scope(t)}
        by_pgid = self._scan() if len(scoped) < len(targets) else {}
        members: dict[str, list[ProcInfo]] = {}
        for t in targets:
            scope = scoped.get(t.alloc_id)
            if scope is not None:
                members[t.alloc_id] = self._scope_members(scope)
            else:
                members[t.alloc_id] = [i for g in t.pgids for i in by_pgid.get(g, ())]
        netns = {aid: self._foreign_netns(ms) for aid, ms in members.items()}
        ns_users: dict[str, int] = {}
        for found in netns.values():
            if found is not None:
                ns_users[found[0]] = ns_users.get(found[0], 0) + 1
        out: dict[str, dict[str, float]] = {}
        for t in targets:
            aid = t.alloc_id
            ms = members[aid]
            scope = scoped.get(aid)
            if scope is None and not ms:
                continue  # nothing of it here (yet, or any more)
            found = netns[aid]
            if found is not None and ns_users[found[0]] > 1:
                found = None  # shared with another allocation: not attributable
            values = self._measure(aid, now, scope, ms, found)
            if values:
                out[aid] = values
        return out

    # --- one allocation -------------------------------------------------------------------

    def _measure(
        self,
        aid: str,
        now: float,
        scope: Scope | None,
        ms: list[ProcInfo],
        netns: tuple[str, int] | None,
    ) -> dict[str, float]:
        prev = self._state.get(aid)
        st = _State(mono=now)
        values: dict[str, float] = {}
        cg = self.cgroups
        usage = cg.usage(scope) if cg is not None and scope is not None else None
        st.cg_cpu = usage.cpu_seconds if usage is not None else None
        st.cg_io = self._scope_io(scope) if scope is not None else None
        per_pid = st.cg_cpu is None or st.cg_io is None
        if per_pid:
            st.pids = self._counters(ms, io=st.cg_io is None)
        if netns is not None:
            st.net = self._net(netns[1], netns[0])
        # memory: a level, no baseline needed
        if usage is not None and usage.memory_current is not None:
            values[MEMORY_USED] = float(usage.memory_current)
        elif ms:
            values[MEMORY_USED] = float(sum(i.rss_pages for i in ms) * PAGE_SIZE)
        self._state[aid] = st
        if prev is None or now <= prev.mono:
            return values
        dt = now - prev.mono
        # cpu
        if st.cg_cpu is not None and prev.cg_cpu is not None:
            if st.cg_cpu >= prev.cg_cpu:
                values[CPU_UTILIZATION] = 100.0 * (st.cg_cpu - prev.cg_cpu) / dt
        elif st.cg_cpu is None and prev.cg_cpu is None:
            ticks = group_delta(prev.pids, st.pids, lambda c: c.cpu_ticks)
            values[CPU_UTILIZATION] = 100.0 * ticks / CLK_TCK / dt
        # io
        if st.cg_io is not None and prev.cg_io is not None:
            r, w = st.cg_io[0] - prev.cg_io[0], st.cg_io[1] - prev.cg_io[1]
            if r >= 0 and w >= 0:
                values[IO_READ_BYTES] = r / dt
                values[IO_WRITE_BYTES] = w / dt
        elif st.cg_io is None and prev.cg_io is None and self._io_readable(st.pids):
            values[IO_READ_BYTES] = group_delta(prev.pids, st.pids, lambda c: c.read_bytes) / dt
            values[IO_WRITE_BYTES] = group_delta(prev.pids, st.pids, lambda c: c.write_bytes) / dt
        # network (its own namespace only)
        if st.net is not None and prev.net is not None and st.net[0] == prev.net[0]:
            rx, tx = st.net[1] - prev.net[1], st.net[2] - prev.net[2]
            if rx >= 0 and tx >= 0:
                values[NETWORK_RX_BYTES] = rx / dt
                values[NETWORK_TX_BYTES] = tx / dt
            packets, errors = st.net[3] - prev.net[3], st.net[4] - prev.net[4]
            if packets > 0 and errors >= 0:  # percent of the packets in the interval
                values[NETWORK_ERROR_RATE] = 100.0 * errors / (packets + errors)
        return values

    @staticmethod
    def _io_readable(pids: Mapping[int, PidCounters]) -> bool:
        return any(c.read_bytes is not None for c in pids.values())

    # --- reading ----------------------------------------------------------------------

    def _in_scope(self, t: Target) -> bool:
        cg = self.cgroups
        return cg is not None and cg.available and t.scope is not None and cg.exists(t.scope)

    def _stat(self, pid: int) -> ProcInfo | None:
        try:
            with open(self.proc / str(pid) / "stat", "rb") as f:
                return parse_stat(pid, f.read())
        except OSError:
            return None

    def _scan(self) -> dict[int, list[ProcInfo]]:
        """Every process on the node by process group (one pass over /proc)."""
        by_pgid: dict[int, list[ProcInfo]] = {}
        try:
            names = os.listdir(self.proc)
        except OSError:
            return by_pgid
        for name in names:
            if name.isdigit():
                info = self._stat(int(name))
                if info is not None:
                    by_pgid.setdefault(info.pgrp, []).append(info)
        return by_pgid

    def _scope_members(self, scope: Scope) -> list[ProcInfo]:
        assert self.cgroups is not None
        pids: set[int] = set()
        for procs in self.cgroups.procs_files(scope):
            try:
                pids.update(int(x) for x in procs.read_text().split() if x.isdigit())
            except OSError:
                continue
            break  # every controller lists the same processes: one file is enough
        return [i for pid in sorted(pids) if (i := self._stat(pid)) is not None]

    def _counters(self, ms: Iterable[ProcInfo], *, io: bool) -> dict[int, PidCounters]:
        out: dict[int, PidCounters] = {}
        for i in ms:
            rw = self._pid_io(i.pid) if io else None
            out[i.pid] = PidCounters(
                i.start,
                i.ppid,
                i.cpu_ticks,
                rw[0] if rw is not None else None,
                rw[1] if rw is not None else None,
            )
        return out

    def _pid_io(self, pid: int) -> tuple[int, int] | None:
        try:
            return parse_io((self.proc / str(pid) / "io").read_text())
        except OSError:  # gone, or not ours to read (needs ptrace access)
            return None

    def _scope_io(self, scope: Scope) -> tuple[int, int] | None:
        """The scope's own block I/O counters, when it has them."""
        d = scope.dirs.get("")
        if d is not None:
            with contextlib.suppress(OSError):
                return parse_io_stat((d / "io.stat").read_text())
        d = scope.dirs.get("blkio")
        if d is not None:
            with contextlib.suppress(OSError):
                return parse_blkio((d / "blkio.throttle.io_service_bytes").read_text())
        return None

    def _foreign_netns(self, ms: list[ProcInfo]) -> tuple[str, int] | None:
        """The one network namespace, other than the agent's, that the allocation's
        processes live in, and a pid inside it (None: none, or several)."""
        found: dict[str, int] = {}
        for i in ms:
            ns = self._netns_of(str(i.pid))
            if ns and ns != self._own_netns:
                found.setdefault(ns, i.pid)
        if len(found) != 1 or not self._own_netns:
            return None
        return next(iter(found.items()))

    def _netns_of(self, pid: str) -> str:
        try:
            return os.readlink(self.proc / pid / "ns" / "net")
        except OSError:
            return ""

    def _net(self, pid: int, netns: str) -> tuple[str, int, int, int, int] | None:
        try:
            text = (self.proc / str(pid) / "net" / "dev").read_text()
        except OSError:
            return None
        ifaces = [v for k, v in parse_net_dev_counters(text).items() if k != "lo"]
        return (netns, *(sum(v[i] for v in ifaces) for i in range(4)))  # type: ignore[return-value]
