"""AttachManager on a real PTY: size and resize, Ctrl-C, exit codes, keepalive, the
per-user limit, pipes without a TTY, and nothing left behind after any ending."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lattice_agent.attach import AttachManager, _session_members, limit_message
from lattice_agent.procgroup import become_subreaper
from lattice_common.errors import NotFound, QuotaExceeded
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationState
from lattice_test_harness.builders import allocation

pytestmark = pytest.mark.timeout(60)


class Client:
    """One attach stream driven from a test: send messages, read output."""

    def __init__(self, mgr: AttachManager, start: v1.AttachStart) -> None:
        self.inbox: asyncio.Queue[v1.AttachInput | None] = asyncio.Queue()
        self.inbox.put_nowait(v1.AttachInput(start=start))
        self.out = bytearray()
        self.err = bytearray()
        self.exit_code: int | None = None
        self.messages = 0
        self._gen = mgr.serve(self._inputs())
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()

    async def _inputs(self) -> AsyncIterator[v1.AttachInput]:
        while True:
            msg = await self.inbox.get()
            if msg is None:
                return
            yield msg

    async def open(self) -> None:
        first = await anext(self._gen)  # raises the refusal
        assert first.stdout == b""
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for o in self._gen:
            self.messages += 1
            if o.stdout is not None:
                self.out += o.stdout
            elif o.stderr is not None:
                self.err += o.stderr
            elif o.exit_code is not None:
                self.exit_code = o.exit_code
            self.changed.set()

    def send(self, **kw: object) -> None:
        self.inbox.put_nowait(v1.AttachInput(**kw))  # type: ignore[arg-type]

    def type(self, text: str) -> None:
        self.send(stdin=text.encode())

    async def expect(self, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        async def wait() -> re.Match[str]:
            while True:
                m = re.search(pattern, self.out.decode(errors="replace"))
                if m:
                    return m
                self.changed.clear()
                await self.changed.wait()

        return await asyncio.wait_for(wait(), timeout)

    async def done(self, timeout: float = 10.0) -> None:
        assert self._task is not None
        await asyncio.wait_for(self._task, timeout)

    async def drop(self) -> None:
        """The client goes away (the call is cancelled)."""
        assert self._task is not None
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task
        await self._gen.aclose()


@pytest.fixture
def alloc():  # type: ignore[no-untyped-def]
    return allocation(state=AllocationState.RUNNING, user="alice")


@pytest.fixture
def mgr(tmp_path: Path, alloc) -> AttachManager:  # type: ignore[no-untyped-def]
    return AttachManager(
        "n0",
        allocation={alloc.id: alloc}.get,
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        keepalive_timeout=30.0,
        hup_grace=0.5,
    )


def _start(alloc, command=("/bin/sh",), tty=True, rows=24, cols=80) -> v1.AttachStart:  # type: ignore[no-untyped-def]
    return v1.AttachStart(
        allocation_id=alloc.id,
        command=list(command),
        tty=tty,
        size=v1.TerminalSize(rows=rows, cols=cols),
    )


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _gone(pid_sid: int) -> bool:
    return not any(st != "Z" for _, _, st in _session_members(pid_sid)) and not _session_members(
        pid_sid
    )


async def _sid_of(mgr: AttachManager) -> int:
    (s,) = list(mgr.sessions)
    return s.pid


async def test_tty_size_resize_ctrl_c_and_exit_code(mgr: AttachManager, alloc) -> None:  # type: ignore[no-untyped-def]
    before = _fds()
    c = Client(mgr, _start(alloc, rows=33, cols=101))
    await c.open()
    sid = await _sid_of(mgr)
    c.type("stty size; echo MARK$((40+2))\n")
    await c.expect(r"33 101\s+MARK42")
    c.send(resize=v1.TerminalSize(rows=50, cols=132))
    c.type("stty size; echo MARK$((40+3))\n")
    await c.expect(r"50 132\s+MARK43")
    # the PTY is the controlling terminal: ^C interrupts the foreground `sleep`
    c.type("sleep 30\n")
    await asyncio.sleep(0.5)
    c.type("\x03")
    c.type("echo after-sleep $?\n")
    await c.expect(r"after-sleep 130", timeout=5)
    # the client's signal message does the same, to the foreground group
    c.type("sleep 30\n")
    await asyncio.sleep(0.5)
    c.send(signal="INT")
    c.type("echo after-sig $?\n")
    await c.expect(r"after-sig 130", timeout=5)
    c.type("cd; pwd >/dev/null; echo $LATTICE_ALLOC_ID $TERM; exit 3\n")
    await c.expect(rf"{alloc.id} xterm")
    await c.done()
    assert c.exit_code == 3
    await mgr.idle()
    assert not mgr.sessions and _gone(sid)
    assert _fds() == before


async def test_working_directory_and_environment(mgr: AttachManager, alloc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = Client(mgr, _start(alloc, command=["sh", "-c", "pwd; echo $SLURM_JOB_ID"], tty=False))
    await c.open()
    await c.done()
    assert c.exit_code == 0
    assert c.out.decode().split() == [str(tmp_path / "work" / alloc.id), alloc.id]


async def test_pipes_without_tty(mgr: AttachManager, alloc) -> None:  # type: ignore[no-untyped-def]
    c = Client(mgr, _start(alloc, command=["sh", "-c", "cat; echo oops >&2; exit 5"], tty=False))
    await c.open()
    c.type("hello\n")
    c.send(close_stdin=True)
    await c.done()
    assert (bytes(c.out), bytes(c.err), c.exit_code) == (b"hello\n", b"oops\n", 5)


async def test_killed_by_signal_is_128_plus_n(mgr: AttachManager, alloc) -> None:  # type: ignore[no-untyped-def]
    c = Client(mgr, _start(alloc, command=["sh", "-c", "kill -TERM $$"]))
    await c.open()
    await c.done()
    assert c.exit_code == 143


async def test_large_output_is_chunked(mgr: AttachManager, alloc) -> None:  # type: ignore[no-untyped-def]
    c = Client(mgr, _start(alloc, command=["sh", "-c", "head -c 3000000 /dev/zero"], tty=False))
    await c.open()
    await c.done(timeout=20)
    assert len(c.out) == 3_000_000 and c.exit_code == 0
    assert c.messages >= 3_000_000 // (32 * 1024)


async def test_disconnect_hangs_up_and_leaves_nothing(mgr: AttachManager, alloc) -> None:  # type: ignore[no-untyped-def]
    become_subreaper()  # as the agent is: orphans of the session come back to be reaped
    before = _fds()
    c = Client(mgr, _start(alloc))
    await c.open()
    sid = await _sid_of(mgr)
    # a background job in its own process group, and one that ignores SIGHUP
    c.type("sleep 300 & (trap '' HUP; exec sleep 301) & echo STARTED$((1+1))\n")
    await c.expect("STARTED2")
    assert len([m for m in _session_members(sid) if m[2] != "Z"]) >= 3
    await c.drop()
    await mgr.idle()
    assert not mgr.sessions
    assert _session_members(sid) == []  # SIGKILL after the grace, zombies reaped
    assert _fds() == before


async def test_keepalive_timeout_is_a_disconnect(tmp_path: Path, alloc) -> None:  # type: ignore[no-untyped-def]
    mgr = AttachManager(
        "n0",
        allocation={alloc.id: alloc}.get,
        work_dir=tmp_path,
        log_dir=tmp_path,
        keepalive_timeout=1.0,
        hup_grace=0.3,
    )
    c = Client(mgr, _start(alloc))
    await c.open()
    sid = await _sid_of(mgr)
    for _ in range(4):  # keepalives hold it open past the timeout
        await asyncio.sleep(0.4)
        c.send(keepalive=True)
    assert mgr.sessions
    await c.done(timeout=5)  # then silence: dropped, no exit code
    assert c.exit_code is None
    await mgr.idle()
    assert not mgr.sessions and _session_members(sid) == []


async def test_per_user_limit(mgr: AttachManager, alloc) -> None:  # type: ignore[no-untyped-def]
    clients = [Client(mgr, _start(alloc)) for _ in range(5)]
    for c in clients:
        await c.open()
    sixth = Client(mgr, _start(alloc))
    with pytest.raises(QuotaExceeded) as e:
        await sixth.open()
    assert str(e.value.message) == limit_message(5)
    assert e.value.message.startswith("maximum concurrent sessions reached (5/5).")
    clients[0].type("exit\n")
    await clients[0].done()
    await mgr.idle(timeout=0.5)
    again = Client(mgr, _start(alloc))
    await again.open()
    for c in [*clients[1:], again]:
        await c.drop()
    await mgr.idle()
    assert not mgr.sessions


async def test_allocation_not_on_this_node(mgr: AttachManager) -> None:
    c = Client(mgr, v1.AttachStart(allocation_id="nope", tty=True))
    with pytest.raises(NotFound, match="not running on node n0"):
        await c.open()


async def test_allocation_leaving_the_node_ends_the_attach(mgr: AttachManager, alloc) -> None:  # type: ignore[no-untyped-def]
    c = Client(mgr, _start(alloc))
    await c.open()
    sid = await _sid_of(mgr)
    mgr.end_allocations(set())
    await c.done()
    assert c.exit_code == -1 and b"no longer running" in c.out
    await mgr.idle()
    assert _session_members(sid) == []


async def test_default_shell_is_a_login_shell(mgr: AttachManager, alloc, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SHELL", "/bin/sh")
    c = Client(mgr, _start(alloc, command=()))
    await c.open()
    c.type("echo SHELL-IS-$((6*7)); exit 0\n")
    await c.expect("SHELL-IS-42")
    await c.done()
    assert c.exit_code == 0


async def test_preempted_allocation_tells_the_terminal_how_to_come_back(
    mgr: AttachManager, alloc
) -> None:  # type: ignore[no-untyped-def]
    c = Client(mgr, _start(alloc))
    await c.open()
    mgr.end_allocations(set(), {alloc.id: "preempted"})
    await c.done()
    assert c.exit_code == -1
    assert (
        b"[lattice] Allocation preempted. Session suspended. Use "
        + f"'lattice attach {alloc.id}' to reconnect after rescheduling.".encode()
    ) in c.out


async def test_idle_terminal_is_warned_not_ended(tmp_path: Path, alloc) -> None:  # type: ignore[no-untyped-def]
    alloc.spec.walltime_seconds = 3 * 3600 + 13 * 60
    alloc.started_at = __import__("time").time()
    mgr = AttachManager(
        "n1",
        allocation=lambda aid: alloc if aid == alloc.id else None,
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        idle_timeout=0.5,
    )
    c = Client(mgr, _start(alloc))
    await c.open()
    await c.expect(
        re.escape("[lattice] Warning: session idle for 0 s. Walltime remaining: 3h 12m.")
    )
    c.type("echo STILL-$((40+2)); exit 0\n")  # the session goes on after the warning
    await c.expect("STILL-42")
    await c.done()
    assert c.exit_code == 0


def test_idle_message_wording() -> None:
    from lattice_agent.attach import idle_message

    assert idle_message(1800, 3 * 3600 + 12 * 60 + 30) == (
        "\r\n[lattice] Warning: session idle for 30 minutes. Walltime remaining: 3h 12m.\r\n"
    )
    assert idle_message(60, None) == "\r\n[lattice] Warning: session idle for 1 minute.\r\n"
