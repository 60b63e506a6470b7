"""The node agent's process runtime: allocations as real process groups that outlive the agent.

The specification asks that running allocations survive an agent restart (systemd
``KillMode=process``: only the agent dies, its workloads keep running) and that a restarted
agent reattaches to them from ``agent-state.json``. A restarted agent is no longer the parent
of those processes, so nothing that depends on the parent-child relationship may carry state
that must survive. That shapes three choices here:

* **Output goes to files, not pipes.** A pipe's read end lives in the agent; when the agent
  dies the workload gets ``SIGPIPE``/``EPIPE`` on its next write and its output is lost. So
  stdout and stderr are opened by the agent as ``<log_dir>/<alloc>/stdout.log`` and
  ``stderr.log`` and handed to the child as fds 1 and 2. The agent only *tails* those files
  into an in-memory ring buffer (for ``tail``/``follow``); a new agent resumes tailing where
  the files are.
* **The exit status goes through a file.** Only the parent can ``waitpid()`` a child; after a
  restart the new agent can see a process vanish (``kill(pid, 0)``) but not how it ended.
  The user's command therefore runs under a tiny ``/bin/sh`` wrapper that writes the real
  status to ``<work_dir>/<alloc>/exit_code`` when the command ends. The entrypoint is arbitrary
  user text: it is passed to ``/bin/sh -c`` as an argument (argv), never pasted into shell
  source, so quotes, ``$(...)`` and the like keep their ordinary shell meaning.
  The wrapper catches (does not ignore) ``SIGTERM``, so a group-wide SIGTERM lets the user
  command end and the wrapper still records its status; caught signals are reset to default
  on exec, so the user command sees the normal disposition.
* **Identity and intent are persisted.** pid, pgid, the kernel start time of the pid (against
  pid reuse), ``started_at``, the walltime, the log paths, a termination in progress and the
  exit once known are written atomically (tmp + fsync + rename, mode 0600) after every change.

Exit codes: a normal exit reports the command's status (0..255). A process ended by signal
N reports **128 + N** (143 for SIGTERM, 137 for SIGKILL) - the value a POSIX shell puts in
``$?`` - whether the status came from the exit file, from ``waitpid`` or, after a restart with
no exit file, from the last signal this runtime sent. With no exit file, no wait status and no
signal sent by us, the exit code is ``None`` and the reason ``lost_on_agent_restart``.

Process groups: every allocation runs in its own session (``setsid``), so its pgid is the
wrapper's pid. Walltime and ``stop()`` send SIGTERM to the group, wait the grace period, then
SIGKILL the group. When the wrapper ends (for any reason) the rest of its group is killed too
(as Slurm kills stray job processes at the end of a step), and the runtime waits until the
group is empty before it reports ``exited``. By default the agent makes itself a child
subreaper (``PR_SET_CHILD_SUBREAPER``) so that grandchildren orphaned by the kill are reparented
to it and reaped here, even under a PID 1 that does not reap (containers). Processes that leave
the group (``setsid`` daemons) escape this; cgroups are the tool for those.

The runtime is an asyncio shell around these facts; it never blocks on the workload. Exits
of processes the runtime spawned itself are seen at once through a pidfd registered with the
event loop (what asyncio's own ``PidfdChildWatcher`` does); after a restart, liveness is polled
with ``kill(pid, 0)`` plus a zombie check every 0.25 s. ``asyncio.create_subprocess_exec`` is
not used on purpose: its transport kills the child when it is closed or garbage collected,
which would break restart survival.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import logging
import os
import shlex
import signal
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from lattice_common.types import Allocation, AllocationReport

log = logging.getLogger("lattice.agent.runtime")

__all__ = [
    "PHASE_EXITED",
    "PHASE_RUNNING",
    "REASON_CANCELLED",
    "REASON_LOST",
    "REASON_SPAWN_FAILED",
    "REASON_WALLTIME",
    "LogRecord",
    "ProcessRuntime",
    "signal_exit_code",
]

PHASE_RUNNING = "running"
PHASE_EXITED = "exited"
REASON_WALLTIME = "walltime_exceeded"
REASON_CANCELLED = "cancelled"
REASON_LOST = "lost_on_agent_restart"
REASON_SPAWN_FAILED = "spawn_failed"

STATE_VERSION = 1
STREAMS = ("stdout", "stderr")

_SHELL = "/bin/sh"
# argv: $0=lattice-wrapper $1=cwd $2=exit file, then the command (/bin/sh -c <entrypoint>).
# `trap : TERM` catches SIGTERM in the wrapper only (reset to default by exec in the child).
_WRAPPER = (
    "trap : TERM; "
    'cd "$1" || { echo 126 > "$2"; exit 126; }; '
    'f=$2; shift 2; "$@"; rc=$?; '
    'echo "$rc" > "$f"; exit "$rc"'
)

_TAIL_INTERVAL = 0.1  # seconds between reads of the log files
_LIVENESS_POLL = 0.25  # seconds between kill(pid, 0) checks for processes we did not spawn
_READ_CHUNK = 1 << 20  # bytes per stream per read
_MAX_LINE = 64 * 1024  # a longer line without a newline is cut into pieces
_RECOVER_TAIL_BYTES = 4 << 20  # how much of an existing log a new agent loads into the ring
_REAP_TIMEOUT = 10.0  # seconds to wait for a killed group to empty
_STOP_KILL_TIMEOUT = 30.0  # after SIGKILL, how long stop() waits for the group to be gone
_HAVE_PROC = os.path.isdir("/proc/self")
_PR_SET_CHILD_SUBREAPER = 36


def signal_exit_code(signum: int) -> int:
    """The exit code reported for a process ended by signal ``signum`` (shell convention)."""
    return 128 + signum


def _status_to_exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return signal_exit_code(-code) if code < 0 else code


class LogRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One line of workload output (without its newline)."""

    allocation_id: str
    stream: str  # "stdout" | "stderr"
    line: str
    timestamp: float


@dataclass(frozen=True)
class _ProcStat:
    state: str
    ppid: int
    pgrp: int
    starttime: int


def _proc_stat(pid: int) -> _ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        rest = data[data.rindex(b")") + 2 :].split()
        return _ProcStat(rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[19]))
    except (OSError, ValueError, IndexError):
        return None


def _group_members(pgid: int) -> list[tuple[int, _ProcStat]]:
    members = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        if not name.isdigit():
            continue
        st = _proc_stat(int(name))
        if st is not None and st.pgrp == pgid:
            members.append((int(name), st))
    return members


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_subreaper_done = False


def _become_subreaper() -> None:
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


def _signals_to_reset() -> list[int]:
    """Signals the agent ignores; an ignored disposition would survive exec into the workload."""
    out = {signal.SIGPIPE, signal.SIGXFSZ}
    for s in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if signal.getsignal(s) == signal.SIG_IGN:
                out.add(s)
    return sorted(out)


def _check_alloc_id(alloc_id: str) -> None:
    if (
        not alloc_id
        or alloc_id in (".", "..")
        or "/" in alloc_id
        or "\0" in alloc_id
        or len(alloc_id) > 200
    ):
        raise ValueError(f"allocation id not usable as a directory name: {alloc_id!r}")


def _check_stream(stream: str) -> None:
    if stream not in ("both", *STREAMS):
        raise ValueError(f"stream must be stdout, stderr or both, not {stream!r}")


def _job_name(alloc: Allocation) -> str:
    if alloc.spec.name:
        return alloc.spec.name
    try:
        words = shlex.split(alloc.spec.entrypoint)
    except ValueError:
        words = alloc.spec.entrypoint.split()
    return os.path.basename(words[0]) if words else "job"


def _read_exit_file(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_last_lines(path: Path, n: int | None, max_bytes: int = _RECOVER_TAIL_BYTES) -> list[str]:
    """The last ``n`` lines (all if None) among the last ``max_bytes`` of a file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # first one is probably cut
    if lines and lines[-1] == b"":
        lines.pop()
    if n is not None:
        lines = lines[-n:] if n > 0 else []
    return [ln.rstrip(b"\r").decode("utf-8", "replace") for ln in lines]


@dataclass(eq=False)
class _Alloc:
    """What the runtime knows about one allocation (persisted part + live machinery)."""

    id: str
    pid: int
    pgid: int
    started_at: float
    walltime_seconds: float
    deadline: float | None
    work_dir: Path
    stdout_path: Path
    stderr_path: Path
    exit_file: Path
    proc_start: int | None = None
    phase: str = PHASE_RUNNING
    exit_code: int | None = None
    reason: str = ""
    finished_at: float | None = None
    stop_reason: str = ""  # a termination in progress (or done), with its reason
    kill_signal: int = 0  # last signal this runtime sent to the group
    # --- not persisted ---
    is_child: bool = False  # spawned by this runtime object: we can waitpid it
    wait_code: int | None = None  # exit code from waitpid, when we reaped the wrapper
    grace_end: float | None = None  # monotonic end of the SIGTERM grace period
    leader_exited: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None
    term_task: asyncio.Task[None] | None = None
    tail_task: asyncio.Task[None] | None = None
    # ring buffer and tailing state
    buf: deque[LogRecord] = field(default_factory=deque)
    total: int = 0  # lines ever appended to buf
    offsets: dict[str, int] = field(default_factory=dict)
    partial: dict[str, bytes] = field(default_factory=dict)
    skip_first: dict[str, bool] = field(default_factory=dict)
    files: dict[str, Any] = field(default_factory=dict)
    log_event: asyncio.Event = field(default_factory=asyncio.Event)
    drained: bool = False  # no more lines will come

    def report(self) -> AllocationReport:
        return AllocationReport(
            allocation_id=self.id,
            phase=self.phase,
            pid=self.pid,
            exit_code=self.exit_code,
            reason=self.reason,
            started_at=self.started_at,
            finished_at=self.finished_at,
        )

    def log_path(self, stream: str) -> Path:
        return self.stdout_path if stream == "stdout" else self.stderr_path

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pid": self.pid,
            "pgid": self.pgid,
            "proc_start": self.proc_start,
            "started_at": self.started_at,
            "walltime_seconds": self.walltime_seconds,
            "deadline": self.deadline,
            "work_dir": str(self.work_dir),
            "stdout": str(self.stdout_path),
            "stderr": str(self.stderr_path),
            "exit_file": str(self.exit_file),
            "phase": self.phase,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "finished_at": self.finished_at,
            "stop_reason": self.stop_reason,
            "kill_signal": self.kill_signal,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Alloc:
        work_dir = Path(d["work_dir"])
        return cls(
            id=str(d["id"]),
            pid=int(d["pid"]),
            pgid=int(d.get("pgid") or d["pid"]),
            proc_start=d.get("proc_start"),
            started_at=float(d["started_at"]),
            walltime_seconds=float(d.get("walltime_seconds") or 0),
            deadline=d.get("deadline"),
            work_dir=work_dir,
            stdout_path=Path(d["stdout"]),
            stderr_path=Path(d["stderr"]),
            exit_file=Path(d.get("exit_file") or work_dir / "exit_code"),
            phase=d.get("phase", PHASE_RUNNING),
            exit_code=d.get("exit_code"),
            reason=d.get("reason", ""),
            finished_at=d.get("finished_at"),
            stop_reason=d.get("stop_reason", ""),
            kill_signal=int(d.get("kill_signal") or 0),
        )


class ProcessRuntime:
    """Runs allocations as process groups on this node; see the module docstring.

    All methods must be called from the event loop thread. ``on_change`` is called
    synchronously from the loop whenever an allocation starts or exits.
    """

    def __init__(
        self,
        *,
        node_id: str,
        work_dir: Path,
        log_dir: Path,
        state_file: Path,
        walltime_grace_seconds: float = 30.0,
        ring_buffer_lines: int = 10000,
        on_change: Callable[[AllocationReport], None] | None = None,
        clock: Callable[[], float] = time.time,
        subreaper: bool = True,
    ) -> None:
        self._node_id = node_id
        self._work_dir = Path(work_dir).absolute()
        self._log_dir = Path(log_dir).absolute()
        self._state_file = Path(state_file).absolute()
        self._grace = float(walltime_grace_seconds)
        self._ring_lines = max(1, int(ring_buffer_lines))
        self._on_change = on_change
        self._clock = clock
        self._allocs: dict[str, _Alloc] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._recovered = False
        self._reattached: list[str] = []
        self._closed = False
        if subreaper:
            _become_subreaper()

    # ------------------------------------------------------------------ public API

    async def recover(self) -> list[str]:
        """Load the state file, reattach live processes and finish dead ones.

        Returns the ids of the allocations whose processes were alive and are now monitored
        again. Dead ones become ``exited`` (exit code from their exit file) and are reported
        through ``on_change``. Idempotent: a second call returns the first call's answer.
        """
        self._check_open()
        if self._recovered:
            return list(self._reattached)
        self._recovered = True
        finishing: list[asyncio.Task[None]] = []
        for entry in self._load_state():
            try:
                rec = _Alloc.from_json(entry)
            except (KeyError, TypeError, ValueError) as e:
                log.error("skipping unreadable state entry %r: %s", entry, e)
                continue
            if rec.id in self._allocs:
                continue
            self._allocs[rec.id] = rec
            if rec.phase == PHASE_EXITED:
                rec.done.set()
                rec.leader_exited.set()
                self._init_tailing(rec, resume=True)
                self._drain_now(rec)
                continue
            self._init_tailing(rec, resume=True)
            if self._leader_alive(rec):
                log.info("reattached allocation %s (pid %d)", rec.id, rec.pid)
                self._reattached.append(rec.id)
                self._read_logs(rec)
                self._watch(rec)
                if rec.stop_reason:
                    self._begin_terminate(rec, rec.stop_reason)
                else:
                    self._arm_walltime(rec)
            else:
                log.info("allocation %s (pid %d) ended while the agent was away", rec.id, rec.pid)
                finishing.append(self._spawn_task(self._finish(rec), f"finish-{rec.id}"))
        self._persist()
        if finishing:
            await asyncio.gather(*finishing, return_exceptions=True)
        return list(self._reattached)

    async def start(self, alloc: Allocation, *, nodelist: list[str]) -> None:
        """Start ``alloc`` here. A no-op for an allocation this runtime already knows.

        If ``recover()`` has not run yet it runs first, so that a process that survived an
        agent restart is never started a second time.
        """
        self._check_open()
        if not self._recovered:
            await self.recover()
        if alloc.id in self._allocs:
            return
        _check_alloc_id(alloc.id)
        # From here on: no await until the allocation is registered (start is idempotent).
        self._spawn(alloc, list(nodelist))

    async def stop(self, alloc_id: str, *, reason: str = REASON_CANCELLED) -> None:
        """SIGTERM the allocation's process group, wait the grace period, SIGKILL it.

        Returns when the whole group is gone. Idempotent: stopping an unknown or exited
        allocation does nothing; a second stop waits for the first (whose reason wins).
        """
        rec = self._allocs.get(alloc_id)
        if rec is None or rec.phase == PHASE_EXITED:
            return
        task = self._begin_terminate(rec, reason)
        await asyncio.shield(task)

    def reports(self) -> list[AllocationReport]:
        return [rec.report() for rec in self._allocs.values()]

    def forget(self, alloc_id: str) -> None:
        """Drop an exited allocation (its files stay on disk). Running ones are kept."""
        rec = self._allocs.get(alloc_id)
        if rec is None:
            return
        if rec.phase != PHASE_EXITED:
            log.warning("not forgetting allocation %s: it is still running", alloc_id)
            return
        if rec.tail_task is not None:
            rec.tail_task.cancel()
        self._close_files(rec)
        self._mark_drained(rec)
        del self._allocs[alloc_id]
        self._persist()

    def running_ids(self) -> set[str]:
        return {a for a, rec in self._allocs.items() if rec.phase == PHASE_RUNNING}

    def tail(self, alloc_id: str, n: int | None = None, stream: str = "both") -> list[LogRecord]:
        """The last ``n`` lines (all buffered lines if None) of ``stream``.

        Served from the ring buffer; falls back to the log files when the buffer has nothing
        for that stream (e.g. a forgotten allocation, or output the tailer has not read yet).
        """
        _check_stream(stream)
        if n is not None and n <= 0:
            return []
        rec = self._allocs.get(alloc_id)
        if rec is not None:
            if not rec.drained:
                self._read_logs(rec)
            out = [r for r in rec.buf if stream in ("both", r.stream)]
            if out:
                return out[-n:] if n is not None else out
        return self._tail_from_files(alloc_id, rec, n, stream)

    async def follow(
        self, alloc_id: str, stream: str = "both", n: int | None = None
    ) -> AsyncIterator[LogRecord]:
        """Yield the buffered lines (the last ``n`` if given), then new lines as they come,
        until the allocation has exited and its logs are drained (or the runtime closes).

        A follower slower than the ring buffer skips the lines that were overwritten.
        """
        _check_stream(stream)
        rec = self._allocs.get(alloc_id)
        if rec is None:
            for r in self.tail(alloc_id, n, stream):
                yield r
            return
        if not rec.drained:
            self._read_logs(rec)
        initial = [r for r in rec.buf if stream in ("both", r.stream)]
        if n is not None:
            initial = initial[-n:] if n > 0 else []
        pos = rec.total
        for r in initial:
            yield r
        while True:
            if pos >= rec.total:
                if rec.drained:
                    return
                await rec.log_event.wait()
                continue
            first = rec.total - len(rec.buf)
            pos = max(pos, first)
            new = list(itertools.islice(rec.buf, pos - first, None))
            pos = rec.total
            for r in new:
                if stream in ("both", r.stream):
                    yield r

    async def close(self) -> None:
        """Stop monitoring, tailing and timers. Workloads keep running (KillMode=process)."""
        if self._closed:
            return
        self._closed = True
        for rec in self._allocs.values():
            if rec.timer is not None:
                rec.timer.cancel()
                rec.timer = None
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for rec in self._allocs.values():
            self._close_files(rec)
            self._mark_drained(rec)
        self._persist()

    # ------------------------------------------------------------------ spawning

    def _spawn(self, alloc: Allocation, nodelist: list[str]) -> None:
        spec = alloc.spec
        alloc_dir = self._work_dir / alloc.id
        log_dir = self._log_dir / alloc.id
        stdout_path = log_dir / "stdout.log"
        stderr_path = log_dir / "stderr.log"
        exit_file = alloc_dir / "exit_code"
        nodes = nodelist or list(alloc.assigned_nodes) or [self._node_id]
        started_at = self._clock()
        walltime = float(spec.walltime_seconds or 0)
        rec = _Alloc(
            id=alloc.id,
            pid=0,
            pgid=0,
            started_at=started_at,
            walltime_seconds=walltime,
            deadline=started_at + walltime if walltime > 0 else None,
            work_dir=alloc_dir,
            stdout_path=stdout_path,
            stderr_path=stderr_path,
            exit_file=exit_file,
            is_child=True,
        )
        out_fd = err_fd = -1
        try:
            alloc_dir.mkdir(parents=True, exist_ok=True)
            log_dir.mkdir(parents=True, exist_ok=True)
            exit_file.unlink(missing_ok=True)  # a requeued allocation may run here again
            submit_dir = spec.submit_dir
            cwd = submit_dir if submit_dir and os.path.isdir(submit_dir) else str(alloc_dir)
            cwd = os.path.abspath(cwd)
            env = self._environment(alloc, nodes, submit_dir or cwd, alloc_dir)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
            out_fd = self._high_fd(os.open(stdout_path, flags, 0o640))
            err_fd = self._high_fd(os.open(stderr_path, flags, 0o640))
            # Append (a requeued run keeps the earlier output); tail only the new part.
            rec.offsets = {"stdout": os.fstat(out_fd).st_size, "stderr": os.fstat(err_fd).st_size}
            argv = [
                _SHELL,
                "-c",
                _WRAPPER,
                "lattice-wrapper",
                cwd,
                str(exit_file),
                _SHELL,
                "-c",
                spec.entrypoint,
            ]
            pid = os.posix_spawn(
                _SHELL,
                argv,
                env,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, out_fd, 1),
                    (os.POSIX_SPAWN_DUP2, err_fd, 2),
                ],
                setsid=True,
                setsigmask=(),
                setsigdef=_signals_to_reset(),
            )
        except (OSError, ValueError) as e:
            log.error("could not start allocation %s: %s", alloc.id, e)
            rec.phase = PHASE_EXITED
            rec.reason = REASON_SPAWN_FAILED
            rec.finished_at = self._clock()
            rec.is_child = False
            rec.done.set()
            rec.leader_exited.set()
            rec.drained = True
            self._allocs[alloc.id] = rec
            self._persist()
            self._emit(rec)
            return
        finally:
            for fd in (out_fd, err_fd):
                if fd >= 0:
                    os.close(fd)
        rec.pid = rec.pgid = pid
        st = _proc_stat(pid)
        rec.proc_start = st.starttime if st is not None else None
        self._allocs[alloc.id] = rec
        log.info("started allocation %s: pid %d, cwd %s", alloc.id, pid, cwd)
        self._persist()
        self._init_tailing(rec, resume=False)
        self._watch(rec)
        self._arm_walltime(rec)
        self._emit(rec)

    @staticmethod
    def _high_fd(fd: int) -> int:
        """Keep our fds away from 0-2 so the dup2 file actions cannot clobber each other."""
        if fd > 2:
            return fd
        import fcntl

        try:
            return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
        finally:
            os.close(fd)

    def _environment(
        self, alloc: Allocation, nodes: list[str], submit_dir: str, alloc_dir: Path
    ) -> dict[str, str]:
        env = dict(os.environ)
        env.update(alloc.spec.env)
        nodelist = ",".join(nodes)
        name = _job_name(alloc)
        env.update(
            {
                "LATTICE_ALLOC_ID": alloc.id,
                "LATTICE_NODELIST": nodelist,
                "LATTICE_NNODES": str(len(nodes)),
                "LATTICE_JOB_NAME": name,
                "LATTICE_SUBMIT_DIR": submit_dir,
                "LATTICE_NODE_ID": self._node_id,
                "LATTICE_WORK_DIR": str(alloc_dir),
                "SLURM_JOB_ID": alloc.id,
                "SLURM_JOB_NODELIST": nodelist,
                "SLURM_NNODES": str(len(nodes)),
                "SLURM_JOB_NAME": name,
                "SLURM_SUBMIT_DIR": submit_dir,
            }
        )
        if self._node_id in nodes:
            env["SLURM_NODEID"] = str(nodes.index(self._node_id))
        return env

    # ------------------------------------------------------------------ monitoring

    def _spawn_task(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("runtime task %s failed", task.get_name(), exc_info=task.exception())

    def _watch(self, rec: _Alloc) -> None:
        self._spawn_task(self._watch_loop(rec), f"watch-{rec.id}")

    async def _watch_loop(self, rec: _Alloc) -> None:
        if rec.is_child:
            await self._wait_child(rec)
        while self._leader_alive(rec):
            await asyncio.sleep(_LIVENESS_POLL)
        await self._finish(rec)

    async def _wait_child(self, rec: _Alloc) -> None:
        """Wait for our own child to exit, without reaping it (the zombie pins the pgid)."""
        try:
            fd = os.pidfd_open(rec.pid)
        except (AttributeError, OSError):
            while self._leader_alive(rec):
                await asyncio.sleep(_TAIL_INTERVAL)
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

    def _leader_alive(self, rec: _Alloc) -> bool:
        if rec.is_child:
            try:
                res = os.waitid(os.P_PID, rec.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                rec.is_child = False
            else:
                return res is None
        try:
            os.kill(rec.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        if not _HAVE_PROC:
            return True
        st = _proc_stat(rec.pid)
        if st is None or st.state in ("Z", "X"):
            return False
        # a different process that got the same pid
        return rec.proc_start is None or st.starttime == rec.proc_start

    def _arm_walltime(self, rec: _Alloc) -> None:
        if rec.walltime_seconds <= 0 or rec.phase != PHASE_RUNNING:
            return
        rec.deadline = rec.started_at + rec.walltime_seconds
        delay = max(0.0, rec.deadline - self._clock())
        loop = asyncio.get_running_loop()
        rec.timer = loop.call_later(delay, self._walltime_expired, rec)

    def _walltime_expired(self, rec: _Alloc) -> None:
        rec.timer = None
        if rec.phase == PHASE_RUNNING and not self._closed:
            log.info("allocation %s exceeded its walltime", rec.id)
            self._begin_terminate(rec, REASON_WALLTIME)

    def _begin_terminate(self, rec: _Alloc, reason: str) -> asyncio.Task[None]:
        if rec.term_task is None:
            rec.term_task = self._spawn_task(self._terminate(rec, reason), f"stop-{rec.id}")
        return rec.term_task

    async def _terminate(self, rec: _Alloc, reason: str) -> None:
        if rec.timer is not None:
            rec.timer.cancel()
            rec.timer = None
        if rec.phase == PHASE_EXITED:
            return
        if not rec.stop_reason:
            rec.stop_reason = reason
        if not rec.leader_exited.is_set():
            rec.kill_signal = int(signal.SIGTERM)
            rec.grace_end = time.monotonic() + self._grace
            self._persist()
            self._killpg(rec, signal.SIGTERM)
            try:
                await asyncio.wait_for(rec.leader_exited.wait(), self._grace)
            except TimeoutError:
                log.info("allocation %s survived SIGTERM for %.1fs: SIGKILL", rec.id, self._grace)
                rec.kill_signal = int(signal.SIGKILL)
                rec.grace_end = None
                self._persist()
                self._killpg(rec, signal.SIGKILL)
        try:
            await asyncio.wait_for(rec.done.wait(), self._grace + _STOP_KILL_TIMEOUT)
        except TimeoutError:
            log.error("allocation %s: process group %d did not go away", rec.id, rec.pgid)

    def _killpg(self, rec: _Alloc, sig: int) -> None:
        if rec.pgid <= 1:
            return
        try:
            os.killpg(rec.pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as e:
            log.error("cannot signal process group %d of %s: %s", rec.pgid, rec.id, e)

    async def _finish(self, rec: _Alloc) -> None:
        """The wrapper has ended: clean the group up, settle the exit and report it."""
        rec.leader_exited.set()
        finished_at = self._clock()
        if rec.grace_end is not None:
            # a polite termination is under way: give the rest of the group its grace
            await self._wait_group_quiet(rec.pgid, rec.grace_end - time.monotonic())
        self._killpg(rec, signal.SIGKILL)
        if not await self._reap_group(rec, _REAP_TIMEOUT):
            log.warning("allocation %s: process group %d still has members", rec.id, rec.pgid)
        code = _read_exit_file(rec.exit_file)
        if code is None:
            code = rec.wait_code
        if code is None and rec.kill_signal:
            code = signal_exit_code(rec.kill_signal)
        reason = rec.stop_reason
        if code is None and not reason:
            reason = REASON_LOST
        if rec.timer is not None:
            rec.timer.cancel()
            rec.timer = None
        rec.phase = PHASE_EXITED
        rec.exit_code = code
        rec.reason = reason
        rec.finished_at = finished_at
        log.info("allocation %s exited: code %s reason %r", rec.id, code, reason)
        self._persist()
        rec.done.set()
        self._notify(rec)
        self._emit(rec)

    async def _wait_group_quiet(self, pgid: int, timeout: float) -> None:
        deadline = time.monotonic() + max(0.0, timeout)
        while time.monotonic() < deadline:
            if not _HAVE_PROC:
                if not _group_exists(pgid):
                    return
            elif not any(st.state not in ("Z", "X") for _, st in _group_members(pgid)):
                return
            await asyncio.sleep(0.05)

    async def _reap_group(self, rec: _Alloc, timeout: float) -> bool:
        """Wait until the group is empty, reaping members that are our children.

        Zombies whose parent is neither us nor in the group are left to that parent.
        """
        me = os.getpid()
        deadline = time.monotonic() + timeout
        while True:
            if not _group_exists(rec.pgid):
                self._reap(rec, rec.pid)
                return True
            if not _HAVE_PROC:
                self._reap(rec, rec.pid)
                pending = _group_exists(rec.pgid)
            else:
                members = _group_members(rec.pgid)
                pids = {pid for pid, _ in members}
                pending = False
                for pid, st in members:
                    if st.state not in ("Z", "X"):
                        pending = True
                    elif st.ppid == me:
                        self._reap(rec, pid)
                    elif st.ppid in pids:
                        pending = True  # its parent will reap it or hand it to us
                if pending:
                    self._killpg(rec, signal.SIGKILL)  # also whatever forked meanwhile
            if not pending:
                return not _group_exists(rec.pgid) or _HAVE_PROC
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)

    def _reap(self, rec: _Alloc, pid: int) -> None:
        try:
            wpid, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if wpid == pid and pid == rec.pid:
            rec.wait_code = _status_to_exit_code(status)

    def _emit(self, rec: _Alloc) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(rec.report())
        except Exception:
            log.exception("on_change callback failed for %s", rec.id)

    # ------------------------------------------------------------------ logs

    def _init_tailing(self, rec: _Alloc, *, resume: bool) -> None:
        """Set up the ring buffer and the tailer.

        A new allocation tails from the offsets taken at spawn; a recovered one (``resume``)
        starts near the end of the existing files (the last ``_RECOVER_TAIL_BYTES``), skipping
        the first, probably cut, line.
        """
        rec.buf = deque(maxlen=self._ring_lines)
        for s in STREAMS:
            rec.partial[s] = b""
            if resume:
                try:
                    size = rec.log_path(s).stat().st_size
                except OSError:
                    size = 0
                rec.offsets[s] = max(0, size - _RECOVER_TAIL_BYTES)
                rec.skip_first[s] = rec.offsets[s] > 0
            rec.offsets.setdefault(s, 0)
        if rec.phase == PHASE_RUNNING:
            rec.tail_task = self._spawn_task(self._tail_loop(rec), f"tail-{rec.id}")

    async def _tail_loop(self, rec: _Alloc) -> None:
        try:
            while True:
                exited = rec.done.is_set()
                if self._read_logs(rec):
                    await asyncio.sleep(0)  # more is waiting; let others run
                    continue
                if exited:
                    self._drain_now(rec)
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(rec.done.wait(), _TAIL_INTERVAL)
        finally:
            self._close_files(rec)

    def _drain_now(self, rec: _Alloc) -> None:
        while self._read_logs(rec):
            pass
        for s in STREAMS:
            rest = rec.partial.get(s, b"")
            rec.partial[s] = b""
            if rest:
                self._append(rec, s, [rest])
        self._close_files(rec)
        self._mark_drained(rec)

    def _read_logs(self, rec: _Alloc) -> bool:
        """Read new bytes of both files into the ring buffer. True if a read hit the chunk size."""
        more = False
        for s in STREAMS:
            f = rec.files.get(s)
            if f is None:
                try:
                    f = open(rec.log_path(s), "rb")  # noqa: SIM115 - kept open across reads
                except OSError:
                    continue
                rec.files[s] = f
            try:
                if os.fstat(f.fileno()).st_size < rec.offsets[s]:  # truncated under us
                    rec.offsets[s] = 0
                    rec.partial[s] = b""
                f.seek(rec.offsets[s])
                data = f.read(_READ_CHUNK)
            except OSError as e:
                log.warning("reading %s of %s: %s", s, rec.id, e)
                continue
            if not data:
                continue
            rec.offsets[s] += len(data)
            more = more or len(data) == _READ_CHUNK
            chunk = rec.partial[s] + data
            lines = chunk.split(b"\n")
            rest = lines.pop()
            if rec.skip_first.get(s):
                if lines:
                    lines.pop(0)
                    rec.skip_first[s] = False
                else:
                    rest = b""
            while len(rest) > _MAX_LINE:
                lines.append(rest[:_MAX_LINE])
                rest = rest[_MAX_LINE:]
            rec.partial[s] = rest
            if lines:
                self._append(rec, s, lines)
        return more

    def _append(self, rec: _Alloc, stream: str, lines: list[bytes]) -> None:
        now = self._clock()
        for raw in lines:
            rec.buf.append(
                LogRecord(
                    allocation_id=rec.id,
                    stream=stream,
                    line=raw.rstrip(b"\r").decode("utf-8", "replace"),
                    timestamp=now,
                )
            )
        rec.total += len(lines)
        self._notify(rec)

    def _notify(self, rec: _Alloc) -> None:
        ev = rec.log_event
        rec.log_event = asyncio.Event()
        ev.set()

    def _mark_drained(self, rec: _Alloc) -> None:
        rec.drained = True
        self._notify(rec)

    @staticmethod
    def _close_files(rec: _Alloc) -> None:
        for f in rec.files.values():
            with contextlib.suppress(OSError):
                f.close()
        rec.files.clear()

    def _tail_from_files(
        self, alloc_id: str, rec: _Alloc | None, n: int | None, stream: str
    ) -> list[LogRecord]:
        if rec is None:
            try:
                _check_alloc_id(alloc_id)
            except ValueError:
                return []
            base = self._log_dir / alloc_id
            paths = {"stdout": base / "stdout.log", "stderr": base / "stderr.log"}
        else:
            paths = {s: rec.log_path(s) for s in STREAMS}
        out: list[LogRecord] = []
        for s in STREAMS:
            if stream not in ("both", s):
                continue
            try:
                ts = paths[s].stat().st_mtime
            except OSError:
                continue
            for line in _read_last_lines(paths[s], n):
                out.append(LogRecord(allocation_id=alloc_id, stream=s, line=line, timestamp=ts))
        return out[-n:] if n is not None else out

    # ------------------------------------------------------------------ state file

    def _load_state(self) -> list[dict[str, Any]]:
        try:
            raw = self._state_file.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as e:
            log.error("cannot read state file %s: %s", self._state_file, e)
            return []
        try:
            data = json.loads(raw)
            entries = data["allocations"]
            if not isinstance(entries, list):
                raise TypeError("allocations is not a list")
        except (ValueError, KeyError, TypeError) as e:
            aside = self._state_file.with_name(self._state_file.name + ".corrupt")
            log.error("state file %s unreadable (%s); moved to %s", self._state_file, e, aside)
            with contextlib.suppress(OSError):
                os.replace(self._state_file, aside)
            return []
        return [e for e in entries if isinstance(e, dict)]

    def _persist(self) -> None:
        if not self._recovered:
            return  # never overwrite a state file that has not been read yet
        data = {
            "version": STATE_VERSION,
            "node_id": self._node_id,
            "written_at": self._clock(),
            "allocations": [rec.to_json() for rec in self._allocs.values() if rec.pid > 0],
        }
        payload = json.dumps(data, indent=1, sort_keys=True).encode()
        path = self._state_file
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            # Atomic replace, no fsync: the file exists to survive an agent restart (the
            # page cache outlives the process); after a machine crash no workload is left
            # to reattach, and stale entries are recognised by pid start time.
            os.replace(tmp, path)
        except OSError as e:
            log.error("cannot write state file %s: %s", path, e)
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ProcessRuntime is closed")
