"""Process-group control: signals, membership via /proc, the subreaper, reaping.

Every allocation runs in its own session, so its pgid is the wrapper's pid. The whole group
is signalled at once; when the wrapper ends, the rest of its group is killed too (as Slurm
kills stray job processes at the end of a step) and the runtime waits until the group is
empty. By default the agent makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``) so
that grandchildren orphaned by the kill are reparented to it and reaped here, even under a
PID 1 that does not reap (containers). Processes that leave the group (``setsid`` daemons)
escape this; cgroups are the tool for those.

A restarted agent is no longer the parent of the processes it reattaches to. The exits of
processes this agent spawned itself are seen at once through a pidfd registered with the
event loop (what asyncio's own ``PidfdChildWatcher`` does); otherwise liveness is polled with
``kill(pid, 0)`` plus a zombie and pid-reuse check (the kernel start time in /proc).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lattice_agent.lifecycle import signal_exit_code

log = logging.getLogger("lattice.agent.runtime")

__all__ = [
    "ProcStat",
    "ProcessGroup",
    "SignalDisposition",
    "become_subreaper",
    "group_exists",
    "group_members",
    "proc_stat",
    "signal_disposition",
    "signal_members",
    "status_to_exit_code",
    "unexeced_forks",
]

LIVENESS_POLL = 0.25  # seconds between kill(pid, 0) checks for processes we did not spawn
_CHILD_POLL = 0.1  # without pidfd: seconds between checks of our own child
_HAVE_PROC = os.path.isdir("/proc/self")
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class ProcStat:
    state: str
    ppid: int
    pgrp: int
    starttime: int


def proc_stat(pid: int) -> ProcStat | None:
    """State, parent, process group and kernel start time of ``pid`` (None: gone or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        rest = data[data.rindex(b")") + 2 :].split()
        return ProcStat(rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[19]))
    except (OSError, ValueError, IndexError):
        return None


def group_members(pgid: int) -> list[tuple[int, ProcStat]]:
    members: list[tuple[int, ProcStat]] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        if not name.isdigit():
            continue
        st = proc_stat(int(name))
        if st is not None and st.pgrp == pgid:
            members.append((int(name), st))
    return members


@dataclass(frozen=True)
class SignalDisposition:
    """What a signal would do to a job's processes, leaving out those ``ours``
    recognises by their command line (the agent's wrapper, the group leader, and its
    entrypoint shell, which trap it, and their forks that have not exec'd yet):
    ``catching``, the processes with a handler; ``dying``, those it would end by its
    default action (neither caught nor ignored). ``known`` is False without /proc."""

    catching: tuple[int, ...] = ()
    dying: tuple[int, ...] = ()
    known: bool = True


def signal_disposition(
    pgid: int, sig: int, ours: Callable[[bytes], bool] = lambda _cmdline: False
) -> SignalDisposition:
    """``sig`` for the live processes of group ``pgid`` (``SigCgt``/``SigIgn`` in
    /proc/<pid>/status)."""
    if not _HAVE_PROC:
        return SignalDisposition(known=False)
    bit = 1 << (sig - 1)
    catching, dying = [], []
    for pid, st in group_members(pgid):
        if st.state in ("Z", "X"):
            continue
        mask, cmdline = _signal_masks(pid), _cmdline(pid)
        # gone meanwhile, in the middle of an exec (no command line yet: its handlers
        # are about to be reset), or the agent's own shell
        if mask is None or not cmdline or ours(cmdline):
            continue
        caught, ignored = mask
        if caught & bit:
            catching.append(pid)
        elif not ignored & bit:
            dying.append(pid)
    return SignalDisposition(tuple(catching), tuple(dying))


def signal_members(pgid: int, pids: Iterable[int], sig: int) -> int:
    """Send ``sig`` to each of ``pids`` still in group ``pgid`` (a pid reused since is
    left alone); how many got it."""
    sent = 0
    for pid in pids:
        st = proc_stat(pid)
        if st is None or st.pgrp != pgid:
            continue
        try:
            os.kill(pid, sig)
        except OSError:
            continue
        sent += 1
    return sent


def unexeced_forks(pgid: int, is_wrapper: Callable[[bytes], bool]) -> list[int]:
    """The members of group ``pgid`` other than its leader that ``is_wrapper`` knows by
    their command line: forks of the wrapper that have not exec'd their command yet."""
    out = []
    for pid, st in group_members(pgid):
        if pid != pgid and st.state not in ("Z", "X") and is_wrapper(_cmdline(pid)):
            out.append(pid)
    return out


def _signal_masks(pid: int) -> tuple[int, int] | None:
    """(SigCgt, SigIgn) of ``pid``; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return int(fields[b"SigCgt"], 16), int(fields[b"SigIgn"], 16)
    except (OSError, KeyError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def status_to_exit_code(status: int) -> int:
    """A ``waitpid`` status as the exit code the runtime reports (128+N for signal N)."""
    code = os.waitstatus_to_exitcode(status)
    return signal_exit_code(-code) if code < 0 else code


_subreaper_done = False


def become_subreaper() -> None:
    """Adopt orphaned descendants (once per process; a no-op where prctl is missing)."""
    global _subreaper_done
    if _subreaper_done:
        return
    _subreaper_done = True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as e:  # not Linux
        log.info("child subreaper not available: %s", e)


class ProcessGroup:
    """One allocation's process group, led by its wrapper (pid == pgid).

    ``is_child``: spawned by this agent process, so it can be waited for; ``wait_code`` is
    the wrapper's exit code once this agent has reaped it.
    """

    def __init__(
        self, name: str, pid: int, *, pgid: int = 0, proc_start: int | None, is_child: bool
    ) -> None:
        self.name = name
        self.pid = pid
        self.pgid = pgid or pid
        self.proc_start = proc_start
        self.is_child = is_child
        self.wait_code: int | None = None

    def signal(self, sig: int) -> None:
        if self.pgid <= 1:
            return
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as e:
            log.error("cannot signal process group %d of %s: %s", self.pgid, self.name, e)

    def signal_disposition(
        self, sig: int, ours: Callable[[bytes], bool] = lambda _cmdline: False
    ) -> SignalDisposition:
        """What ``sig`` would do to its processes (see :func:`signal_disposition`)."""
        return signal_disposition(self.pgid, sig, ours) if self.pgid > 1 else SignalDisposition()

    def unexeced_forks(self, is_wrapper: Callable[[bytes], bool]) -> list[int]:
        """Forks of the wrapper before their exec (see :func:`unexeced_forks`)."""
        return unexeced_forks(self.pgid, is_wrapper) if self.pgid > 1 else []

    async def signal_after_exec(
        self,
        pids: Iterable[int],
        sig: int,
        is_wrapper: Callable[[bytes], bool],
        timeout: float = 2.0,
    ) -> int:
        """``sig`` to each of ``pids`` (forks of the wrapper when the group got ``sig``)
        once it has exec'd its command; how many got it. Such a fork may have taken the
        group's signal in the wrapper's trap, and the command it then execs never saw
        it (a SIGTERM lost so: the job ends by SIGKILL after the whole grace)."""
        left, sent = set(pids), 0
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            for pid in list(left):
                st = proc_stat(pid)
                if st is None or st.pgrp != self.pgid or st.state in ("Z", "X"):
                    left.discard(pid)  # ended (the signal reached it after the trap)
                    continue
                cmdline = _cmdline(pid)
                if cmdline and not is_wrapper(cmdline):
                    left.discard(pid)
                    try:
                        os.kill(pid, sig)
                        sent += 1
                    except OSError:
                        pass
        return sent

    def signal_members(self, pids: Iterable[int], sig: int) -> int:
        """``sig`` to those of ``pids`` still in the group (see :func:`signal_members`)."""
        return signal_members(self.pgid, pids, sig) if self.pgid > 1 else 0

    def leader_alive(self) -> bool:
        if self.is_child:
            try:
                res = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                self.is_child = False
            else:
                return res is None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        if not _HAVE_PROC:
            return True
        st = proc_stat(self.pid)
        if st is None or st.state in ("Z", "X"):
            return False
        # a different process that got the same pid
        return self.proc_start is None or st.starttime == self.proc_start

    async def wait_leader(self) -> None:
        """Return when the wrapper has ended (without reaping it: the zombie pins the pgid)."""
        if self.is_child:
            await self._wait_child()
        while self.leader_alive():
            await asyncio.sleep(LIVENESS_POLL)

    async def _wait_child(self) -> None:
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            while self.leader_alive():
                await asyncio.sleep(_CHILD_POLL)
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        try:
            loop.add_reader(fd, ready)
            try:
                await fut
            finally:
                loop.remove_reader(fd)
        finally:
            os.close(fd)

    async def wait_quiet(self, timeout: float) -> None:
        """Wait up to ``timeout`` for every member of the group to have ended."""
        deadline = time.monotonic() + max(0.0, timeout)
        while time.monotonic() < deadline:
            if not _HAVE_PROC:
                if not group_exists(self.pgid):
                    return
            elif not any(st.state not in ("Z", "X") for _, st in group_members(self.pgid)):
                return
            await asyncio.sleep(0.05)

    async def reap(self, timeout: float) -> bool:
        """SIGKILL the group and wait until it is empty, reaping members that are our children.

        Zombies whose parent is neither us nor in the group are left to that parent.
        """
        self.signal(signal.SIGKILL)
        if self.is_child and self._reap_leader_alone():
            return True
        me = os.getpid()
        deadline = time.monotonic() + timeout
        while True:
            if not group_exists(self.pgid):
                self._reap(self.pid)
                return True
            if not _HAVE_PROC:
                self._reap(self.pid)
                pending = group_exists(self.pgid)
            else:
                members = group_members(self.pgid)
                pids = {pid for pid, _ in members}
                pending = False
                for pid, st in members:
                    if st.state not in ("Z", "X"):
                        pending = True
                    elif st.ppid == me:
                        self._reap(pid)
                    elif st.ppid in pids:
                        pending = True  # its parent will reap it or hand it to us
                if pending:
                    self.signal(signal.SIGKILL)  # also whatever forked meanwhile
            if not pending:
                return not group_exists(self.pgid) or _HAVE_PROC
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)

    def _reap_leader_alone(self) -> bool:
        """The common end, without a scan of /proc: reap the wrapper (already gone when
        this is called) and find its group empty. While other members are left, the
        pgid stays pinned by them (the kernel frees a pid only once no process uses it
        as its pid, pgid or sid), so the full scan that follows still names the group."""
        self._reap(self.pid)
        return self.wait_code is not None and not group_exists(self.pgid)

    def _reap(self, pid: int) -> None:
        try:
            wpid, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if wpid == pid and pid == self.pid:
            self.wait_code = status_to_exit_code(status)
