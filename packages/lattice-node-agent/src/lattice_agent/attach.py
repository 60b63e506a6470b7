"""Interactive attach: a terminal (or a plain command) inside a running allocation.

One :class:`AttachManager` per agent serves NodeAgentService.Attach. A stream starts
with an ``AttachStart``; the allocation must be in this node's desired state. The
command (default: the user's login shell) runs

* on a real PTY when ``tty``: the slave is opened as fd 0 after ``setsid``, so it is
  the session's controlling terminal (the open acquires it: no ``TIOCSCTTY`` race
  with threads, no ``preexec_fn``); 1 and 2 are dups of it; the size is set with
  ``TIOCSWINSZ`` (80x24 unless the start or a resize says otherwise);
* on pipes otherwise (stdout and stderr apart);

in its own session (pid == sid == pgid), in the allocation's working directory and
environment (``spawn.environment``), as the allocation's user (``identity``: the same
``setpriv`` prefix as the batch job, the PTY handed to that user as login does) with
its scratch directory (made here on a node where no batch process runs). The agent
keeps no slave fd, so the master reads EIO once every process of the session has let
go of the terminal.

Protocol (client -> agent): ``stdin`` bytes go to the PTY/pipe; ``resize`` sets the
window size (the kernel sends SIGWINCH to the foreground process group); ``signal``
INT/TSTP/QUIT go to the terminal's foreground process group (``tcgetpgrp``), HUP to the
whole session; ``close_stdin`` is EOF (the VEOF character on a PTY); ``keepalive`` only
resets the keepalive timer. No message for ``keepalive_timeout`` seconds (90: three
missed 30 s keepalives) is a disconnect. The end of the client's half of the stream is
the end of its input, not a disconnect; closing (cancelling) the call is one.

Agent -> client: first an empty ``stdout`` once the command runs (the API answers the
attach with it), then output in chunks of at most ``CHUNK`` bytes (whatever has
accumulated is sent at once, so typing echoes without delay and bulk output is
batched; above ``HIGH_WATER`` unsent bytes the agent stops reading the PTY, which
blocks the writer), and last ``exit_code`` (128+N for signal N).

Endings: the command exits -> the rest of its output, then SIGHUP to what is left of
its session, SIGKILL after ``hup_grace``, then ``exit_code``. A disconnect (or the
allocation leaving this node) -> SIGHUP to the session, SIGKILL after ``hup_grace``.
Either way no process of the session and no PTY fd is left (members that were
reparented to the agent are reaped). Processes that left the session (``setsid``:
tmux, screen) are not touched, which is how a user keeps work across a disconnect.

At most ``max_per_user`` (5) attaches per user on this agent; the next is refused with
the specification's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import pwd
import shutil
import signal
import struct
import termios
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lattice_common.errors import NotFound, QuotaExceeded, ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation

from lattice_agent.identity import IdentityError, IdentityPolicy, RunAs
from lattice_agent.lifecycle import REASON_PREEMPTED
from lattice_agent.procgroup import status_to_exit_code
from lattice_agent.scratch import Scratch, ScratchError, default_root
from lattice_agent.spawn import AllocPaths, environment, working_dir

log = logging.getLogger("lattice.agent.attach")

__all__ = [
    "CHUNK",
    "IDLE_TIMEOUT",
    "MAX_PER_USER",
    "SIGNALS",
    "AttachManager",
    "idle_message",
    "limit_message",
]

#: most bytes in one output message
CHUNK = 32 * 1024
#: unsent output above which the PTY/pipes are no longer read (flow control)
HIGH_WATER = 1024 * 1024
MAX_PER_USER = 5
KEEPALIVE_TIMEOUT = 90.0
#: no stdin this long: the terminal is told (never killed: a long computation is fine)
IDLE_TIMEOUT = 30 * 60.0
HUP_GRACE = 2.0
DEFAULT_SIZE = (24, 80)
#: client signal names -> (signal, to the whole session rather than the foreground group)
SIGNALS: dict[str, tuple[signal.Signals, bool]] = {
    "INT": (signal.SIGINT, False),
    "TSTP": (signal.SIGTSTP, False),
    "QUIT": (signal.SIGQUIT, False),
    "HUP": (signal.SIGHUP, True),
}
# argv: $0=lattice-attach $1=cwd, then the command
_CD_EXEC = 'cd -- "$1" || exit 126; shift; exec "$@"'


def idle_message(idle_seconds: float, walltime_left: float | None) -> str:
    """``[lattice] Warning: session idle for 30 minutes. Walltime remaining: 3h 12m.``"""
    minutes = int(idle_seconds // 60)
    idle = f"{minutes} minute{'s' if minutes != 1 else ''}" if minutes else f"{int(idle_seconds)} s"
    text = f"\r\n[lattice] Warning: session idle for {idle}."
    if walltime_left is not None:
        h, m = divmod(int(walltime_left // 60), 60)
        text += f" Walltime remaining: {h}h {m}m." if h else f" Walltime remaining: {m}m."
    return text + "\r\n"


def limit_message(n: int) -> str:
    """The specification's refusal of one attach too many."""
    return (
        f"maximum concurrent sessions reached ({n}/{n}). "
        "Close an existing session to open a new one."
    )


def _signal_name(name: str) -> str:
    return name.strip().upper().removeprefix("SIG")


def default_shell(env: dict[str, str], user: str) -> list[str]:
    """The user's login shell: $SHELL, else the passwd entry's, else bash, else sh."""
    candidates = [env.get("SHELL", "")]
    with contextlib.suppress(KeyError):
        candidates.append(pwd.getpwnam(user).pw_shell if user else "")
    candidates += [shutil.which("bash") or "", "/bin/sh"]
    for c in candidates:
        if c and os.path.isabs(c) and os.access(c, os.X_OK) and not c.endswith("nologin"):
            return [c, "-l"]
    return ["/bin/sh"]


def _session_members(sid: int) -> list[tuple[int, int, str]]:
    """(pid, ppid, state) of every process in session ``sid`` (zombies included)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
            rest = data[data.rindex(b")") + 2 :].split()
            if int(rest[3]) == sid:
                out.append((int(name), int(rest[1]), rest[0].decode()))
        except (OSError, ValueError, IndexError):
            continue
    return out


@dataclass(eq=False)
class _Session:
    """One attach: its process, fds and unsent output."""

    allocation_id: str
    user: str
    tty: bool
    pid: int = 0
    master: int = -1  # tty
    stdin_fd: int = -1  # pipes
    readers: dict[int, str] = field(default_factory=dict)  # fd -> stdout|stderr
    pending: list[tuple[str, bytearray]] = field(default_factory=list)
    unsent: int = 0
    paused: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # disconnect / end
    end_reason: str = ""
    notice: bytes = b""
    write_queue: bytearray = field(default_factory=bytearray)
    cleaned: bool = False
    last_input: float = field(default_factory=time.monotonic)

    @property
    def input_fd(self) -> int:
        return self.master if self.tty else self.stdin_fd


class AttachManager:
    """The attaches this agent serves."""

    def __init__(
        self,
        node_id: str,
        *,
        allocation: Callable[[str], Allocation | None],
        work_dir: Path,
        log_dir: Path,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        max_per_user: int = MAX_PER_USER,
        hup_grace: float = HUP_GRACE,
        chunk: int = CHUNK,
        identities: IdentityPolicy | None = None,
        scratch: Scratch | None = None,
    ) -> None:
        self.node_id = node_id
        self._allocation = allocation
        self.work_dir = work_dir
        self.log_dir = log_dir
        # who the terminal runs as: the allocation's user (None: the agent itself)
        self.identities = identities if identities is not None else IdentityPolicy()
        self.scratch = scratch if scratch is not None else Scratch(default_root(work_dir))
        self.keepalive_timeout = keepalive_timeout
        self.idle_timeout = idle_timeout
        self.max_per_user = max_per_user
        self.hup_grace = hup_grace
        self.chunk = chunk
        self.sessions: set[_Session] = set()
        self._cleanups: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ serving

    def count(self, user: str) -> int:
        return sum(1 for s in self.sessions if s.user == user)

    def process_groups(self) -> dict[str, list[int]]:
        """Allocation id -> the process groups of its open attach sessions (each session
        leader: pid = sid = pgid), for telemetry attribution."""
        out: dict[str, list[int]] = {}
        for s in self.sessions:
            if s.pid > 0 and s.exit_code is None:
                out.setdefault(s.allocation_id, []).append(s.pid)
        return out

    async def serve(
        self, messages: AsyncIterator[v1.AttachInput]
    ) -> AsyncIterator[v1.AttachOutput]:
        """One attach stream. Refusals (before anything is sent) raise LatticeError."""
        try:
            first = await asyncio.wait_for(anext(messages), self.keepalive_timeout)
        except StopAsyncIteration:
            raise ValidationError("an attach stream starts with AttachStart") from None
        except TimeoutError:
            raise ValidationError("no AttachStart within the keepalive timeout") from None
        if first.start is None:
            raise ValidationError("an attach stream starts with AttachStart")
        s = self._open(first.start)
        pump = asyncio.create_task(self._pump_input(s, messages), name="attach-input")
        waiter = asyncio.create_task(self._wait_exit(s), name="attach-wait")
        idler = asyncio.create_task(self._idle_warnings(s), name="attach-idle")
        try:
            yield v1.AttachOutput(stdout=b"")
            async for out in self._outputs(s):
                yield out
        finally:
            pump.cancel()
            waiter.cancel()
            idler.cancel()
            if not s.cleaned:
                task = asyncio.create_task(self._cleanup(s), name="attach-cleanup")
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    def _open(self, start: v1.AttachStart) -> _Session:
        alloc = self._allocation(start.allocation_id)
        if alloc is None:
            raise NotFound(
                f"allocation {start.allocation_id} is not running on node {self.node_id}",
                hint="Attach to a Running allocation, on one of its nodes.",
            )
        if start.node_id and start.node_id != self.node_id:
            raise ValidationError(f"this is node {self.node_id}, not {start.node_id}")
        user = alloc.spec.user
        if self.count(user) >= self.max_per_user:
            raise QuotaExceeded(
                limit_message(self.max_per_user),
                details={"limit": self.max_per_user, "node": self.node_id},
                hint="Exit a terminal of yours on this node (or use tmux/screen inside one).",
            )
        paths = AllocPaths.of(alloc.id, self.work_dir, self.log_dir)
        submit_dir = alloc.spec.submit_dir
        try:
            run_as = self.identities.run_as(alloc)
            scratch = self.scratch.ensure(alloc.id, run_as)
            cwd = working_dir(submit_dir, paths, run_as, scratch)
        except IdentityError as e:
            raise ValidationError(e.message, hint=e.hint) from None
        except ScratchError as e:
            raise ValidationError(f"cannot attach to {alloc.id}: {e}") from None
        env = environment(
            alloc,
            list(alloc.assigned_nodes),
            self.node_id,
            submit_dir or cwd,
            paths.work_dir,
            run_as=run_as,
            scratch=scratch,
        )
        if start.tty and env.get("TERM", "") in ("", "dumb"):
            env["TERM"] = "xterm-256color"
        if user:
            env.setdefault("USER", user)
            env.setdefault("LOGNAME", user)
        argv = list(start.command) or default_shell(env, run_as.name if run_as.switches else user)
        s = _Session(allocation_id=alloc.id, user=user, tty=bool(start.tty))
        size = start.size
        rows, cols = (size.rows, size.cols) if size and size.rows and size.cols else DEFAULT_SIZE
        try:
            self._spawn(s, argv, cwd, env, rows, cols, run_as)
        except IdentityError as e:
            self._close_fds(s)
            raise ValidationError(e.message, hint=e.hint) from None
        except OSError as e:
            self._close_fds(s)
            raise ValidationError(f"cannot start {argv[0]!r}: {e.strerror or e}") from None
        self.sessions.add(s)
        loop = asyncio.get_running_loop()
        for fd in s.readers:
            loop.add_reader(fd, self._on_readable, s, fd)
        log.info(
            "attach to %s by %s on %s: pid %d (%s)",
            alloc.id,
            user or "?",
            self.node_id,
            s.pid,
            " ".join(argv),
        )
        return s

    def _spawn(
        self,
        s: _Session,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        rows: int,
        cols: int,
        run_as: RunAs,
    ) -> None:
        # as the user from the start: the cd is checked by the kernel as that user
        full = [*run_as.argv_prefix(), "/bin/sh", "-c", _CD_EXEC, "lattice-attach", cwd, *argv]
        program = full[0]
        if s.tty:
            master, slave = os.openpty()
            s.master = master
            try:
                _set_size(master, rows, cols)
                name = os.ttyname(slave)
                if run_as.switches:  # the user's terminal (tty, mesg, reopening it), as login does
                    os.fchown(slave, run_as.uid, -1)
                    os.fchmod(slave, 0o620)
                # fd 0 is opened (not dup'ed) after setsid: it becomes the controlling tty
                s.pid = os.posix_spawn(
                    program,
                    full,
                    env,
                    file_actions=[
                        (os.POSIX_SPAWN_OPEN, 0, name, os.O_RDWR, 0),
                        (os.POSIX_SPAWN_DUP2, 0, 1),
                        (os.POSIX_SPAWN_DUP2, 0, 2),
                    ],
                    setsid=True,
                    setsigmask=(),
                    setsigdef=_reset_signals(),
                )
            finally:
                os.close(slave)
            os.set_blocking(master, False)
            s.readers[master] = "stdout"
            return
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            s.pid = os.posix_spawn(
                program,
                full,
                env,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, in_r, 0),
                    (os.POSIX_SPAWN_DUP2, out_w, 1),
                    (os.POSIX_SPAWN_DUP2, err_w, 2),
                ],
                setsid=True,
                setsigmask=(),
                setsigdef=_reset_signals(),
            )
        except OSError:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        for fd in (in_w, out_r, err_r):
            os.set_blocking(fd, False)
        s.stdin_fd = in_w
        s.readers[out_r] = "stdout"
        s.readers[err_r] = "stderr"

    # ------------------------------------------------------------------ output

    def _on_readable(self, s: _Session, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno != errno.EIO:  # EIO: the PTY's last slave fd closed
                log.warning("attach read: %s", e)
            data = b""
        if not data:
            self._drop_reader(s, fd)
        else:
            stream = s.readers[fd]
            if s.pending and s.pending[-1][0] == stream:
                s.pending[-1][1].extend(data)
            else:
                s.pending.append((stream, bytearray(data)))
            s.unsent += len(data)
            if s.unsent > HIGH_WATER and not s.paused:
                s.paused = True
                loop = asyncio.get_running_loop()
                for r in s.readers:
                    loop.remove_reader(r)
        s.changed.set()

    def _drop_reader(self, s: _Session, fd: int) -> None:
        if fd not in s.readers:
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fd)
        del s.readers[fd]
        if fd == s.master:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_writer(fd)
            s.master = -1
        os.close(fd)

    def _take(self, s: _Session) -> v1.AttachOutput | None:
        if not s.pending:
            return None
        stream, buf = s.pending[0]
        data = bytes(buf[: self.chunk])
        del buf[: self.chunk]
        if not buf:
            s.pending.pop(0)
        s.unsent -= len(data)
        if s.paused and s.unsent < HIGH_WATER // 2 and not s.ended.is_set():
            s.paused = False
            loop = asyncio.get_running_loop()
            for r in s.readers:
                loop.add_reader(r, self._on_readable, s, r)
        return v1.AttachOutput(stderr=data) if stream == "stderr" else v1.AttachOutput(stdout=data)

    async def _outputs(self, s: _Session) -> AsyncIterator[v1.AttachOutput]:
        while True:
            out = self._take(s)
            if out is not None:
                yield out
                continue
            if s.ended.is_set():
                if s.notice:
                    yield v1.AttachOutput(stdout=s.notice)
                    s.notice = b""
                if s.exit_code is not None and not s.end_reason:
                    yield v1.AttachOutput(exit_code=s.exit_code)
                elif s.end_reason == "allocation":
                    yield v1.AttachOutput(exit_code=-1)
                return
            s.changed.clear()
            await s.changed.wait()

    async def _wait_exit(self, s: _Session) -> None:
        """The command's end: its output, what is left of its session ended, the code."""
        s.exit_code = await _wait_pid(s.pid)
        deadline = time.monotonic() + 0.3
        while s.readers and time.monotonic() < deadline and not s.paused:
            s.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(s.changed.wait(), deadline - time.monotonic())
        if s.readers:  # background processes still hold the terminal: end them
            await self._end_session(s)
            deadline = time.monotonic() + 1.0
            while s.readers and time.monotonic() < deadline and not s.paused:
                await asyncio.sleep(0.02)
        await self._cleanup(s)
        s.ended.set()
        s.changed.set()

    # ------------------------------------------------------------------ input

    async def _pump_input(self, s: _Session, messages: AsyncIterator[v1.AttachInput]) -> None:
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(anext(messages), self.keepalive_timeout)
                except StopAsyncIteration:  # the client's input ended; not a disconnect
                    self._close_stdin(s)
                    return
                except TimeoutError:
                    log.info("attach to %s: keepalive timeout, disconnecting", s.allocation_id)
                    self._disconnect(s, "keepalive")
                    return
                self._apply(s, msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream broke: the client is gone
            log.info("attach to %s: client stream ended (%s)", s.allocation_id, e)
            self._disconnect(s, "disconnect")

    def _apply(self, s: _Session, msg: v1.AttachInput) -> None:
        if msg.stdin is not None:
            s.last_input = time.monotonic()
            self._write(s, msg.stdin)
        elif msg.resize is not None:
            if s.tty and s.master >= 0 and msg.resize.rows and msg.resize.cols:
                _set_size(s.master, msg.resize.rows, msg.resize.cols)
        elif msg.signal is not None:
            self.signal(s, msg.signal)
        elif msg.close_stdin:
            self._close_stdin(s)

    def signal(self, s: _Session, name: str) -> None:
        entry = SIGNALS.get(_signal_name(name))
        if entry is None:
            return
        sig, whole = entry
        if whole:
            _signal_session(s.pid, sig)
            return
        pgid = s.pid
        if s.tty and s.master >= 0:
            with contextlib.suppress(OSError):
                pgid = os.tcgetpgrp(s.master)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def _write(self, s: _Session, data: bytes) -> None:
        fd = s.input_fd
        if fd < 0 or not data:
            return
        if s.write_queue:
            s.write_queue.extend(data)
            return
        try:
            n = os.write(fd, data)
        except BlockingIOError:
            n = 0
        except OSError:
            return
        if n < len(data):
            s.write_queue.extend(data[n:])
            asyncio.get_running_loop().add_writer(fd, self._flush, s)

    def _flush(self, s: _Session) -> None:
        fd = s.input_fd
        try:
            n = os.write(fd, s.write_queue)
        except BlockingIOError:
            return
        except OSError:
            n = len(s.write_queue)
        del s.write_queue[:n]
        if not s.write_queue:
            asyncio.get_running_loop().remove_writer(fd)

    def _close_stdin(self, s: _Session) -> None:
        if s.tty:
            if s.master >= 0:
                with contextlib.suppress(OSError):
                    eof = termios.tcgetattr(s.master)[6][termios.VEOF]
                    self._write(s, eof if isinstance(eof, bytes) else bytes([eof]))
        elif s.stdin_fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_writer(s.stdin_fd)
            os.close(s.stdin_fd)
            s.stdin_fd = -1

    # ------------------------------------------------------------------ endings

    def _disconnect(self, s: _Session, reason: str, notice: str = "") -> None:
        if s.ended.is_set() or s.end_reason:
            return
        s.end_reason = reason
        s.notice = notice.encode()
        task = asyncio.create_task(self._cleanup(s), name="attach-cleanup")
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _end_session(self, s: _Session) -> None:
        """SIGHUP to every process of the session, SIGKILL after the grace."""
        _signal_session(s.pid, signal.SIGHUP)
        deadline = time.monotonic() + self.hup_grace
        while time.monotonic() < deadline:
            _reap_orphans(s.pid)
            if not _alive(_session_members(s.pid)):
                return
            await asyncio.sleep(0.02)
        _signal_session(s.pid, signal.SIGKILL)

    async def _cleanup(self, s: _Session) -> None:
        """Nothing of the attach left: session processes ended and reaped, fds closed."""
        if s.cleaned:
            return
        s.cleaned = True
        try:
            if s.exit_code is None or _alive(_session_members(s.pid)):
                await self._end_session(s)
            for _ in range(250):  # up to ~5 s for SIGKILLed processes to go
                if s.exit_code is None:
                    code = _try_wait(s.pid)
                    if code is not None:
                        s.exit_code = code
                _reap_orphans(s.pid)
                # zombies count too: one that died after the reap above, or whose
                # reparenting to us is still under way, would otherwise be left behind
                if not _session_members(s.pid) and s.exit_code is not None:
                    break
                _signal_session(s.pid, signal.SIGKILL)
                await asyncio.sleep(0.02)
        finally:
            self._close_fds(s)
            self.sessions.discard(s)
            s.ended.set()
            s.changed.set()

    def _close_fds(self, s: _Session) -> None:
        loop = asyncio.get_event_loop()
        for fd in list(s.readers):
            with contextlib.suppress(Exception):
                loop.remove_reader(fd)
                loop.remove_writer(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        s.readers.clear()
        for fd in (s.master, s.stdin_fd):
            if fd >= 0:
                with contextlib.suppress(Exception):
                    loop.remove_writer(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)
        s.master = s.stdin_fd = -1

    async def _idle_warnings(self, s: _Session) -> None:
        """After ``idle_timeout`` without stdin, say so in the terminal (spec: Session
        Timeout), again after each further ``idle_timeout``; never end the session."""
        warned_for = 0.0
        while not s.ended.is_set():
            idle = time.monotonic() - s.last_input
            if idle < warned_for:  # input came since the last warning
                warned_for = 0.0
            due = max(warned_for + self.idle_timeout, self.idle_timeout)
            if idle >= due:
                warned_for = idle
                self._notify(s, idle_message(idle, self._walltime_left(s.allocation_id)))
                continue
            await asyncio.sleep(min(due - idle, 60.0))

    def _walltime_left(self, alloc_id: str) -> float | None:
        a = self._allocation(alloc_id)
        if a is None or not a.spec.walltime_seconds or a.started_at is None:
            return None
        return max(0.0, a.started_at + a.spec.walltime_seconds - time.time())

    def _notify(self, s: _Session, text: str) -> None:
        """A line from Lattice in the terminal's output (never mixed into a partial chunk)."""
        s.pending.append(("stdout", bytearray(text.encode())))
        s.unsent += len(text)
        s.changed.set()

    def end_allocations(self, keep: set[str], reasons: Mapping[str, str] | None = None) -> None:
        """End the attaches of allocations that no longer run on this node; ``reasons``
        (allocation -> why it stops) tells a preemption apart (spec: Preemption During
        Active Session)."""
        for s in list(self.sessions):
            if s.allocation_id in keep:
                continue
            if (reasons or {}).get(s.allocation_id) == REASON_PREEMPTED:
                notice = (
                    "\r\n[lattice] Allocation preempted. Session suspended. Use "
                    f"'lattice attach {s.allocation_id}' to reconnect after rescheduling.\r\n"
                )
            else:
                notice = (
                    f"\r\n[lattice] allocation {s.allocation_id} is no longer running on "
                    f"{self.node_id}; attach session ended.\r\n"
                )
            self._disconnect(s, "allocation", notice)

    async def idle(self, timeout: float = 10.0) -> None:
        """Wait until every attach has been cleaned up (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while (self.sessions or self._cleanups) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """End every attach (agent shutdown)."""
        for s in list(self.sessions):
            self._disconnect(s, "agent stopping")
        await self.idle()


# ---------------------------------------------------------------------- helpers


def _reset_signals() -> list[int]:
    out = {signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP}
    out.update({signal.SIGHUP, signal.SIGTERM, signal.SIGTTIN, signal.SIGTTOU})
    return sorted(out)


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _alive(members: list[tuple[int, int, str]]) -> bool:
    return any(state not in ("Z", "X") for _, _, state in members)


def _signal_session(sid: int, sig: int) -> None:
    """``sig`` to every process of session ``sid`` (its own process groups included)."""
    groups = {sid}
    for pid, _, state in _session_members(sid):
        if state not in ("Z", "X"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
    for g in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, sig)


def _reap_orphans(sid: int) -> None:
    """Reap zombies of the session that were reparented to this agent (subreaper)."""
    me = os.getpid()
    for pid, ppid, state in _session_members(sid):
        if ppid == me and pid != sid and state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _try_wait(pid: int) -> int | None:
    try:
        wpid, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -1
    return status_to_exit_code(status) if wpid == pid else None


async def _wait_pid(pid: int) -> int:
    """Wait for our child ``pid`` to end and reap it; its exit code (128+N for signal N)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_reader(fd)
            os.close(fd)
    while True:
        code = _try_wait(pid)
        if code is not None:
            return code
        await asyncio.sleep(0.05)
