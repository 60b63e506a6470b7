"""procgroup.py against real process groups: /proc membership, liveness, signals, reaping."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from lattice_agent import procgroup
from lattice_agent.procgroup import (
    ProcessGroup,
    group_exists,
    group_members,
    proc_stat,
    status_to_exit_code,
)

pytestmark = pytest.mark.timeout(30)


def start_group(script: str) -> int:
    """A shell in its own session, as spawn.py starts the wrapper."""
    return os.posix_spawn("/bin/sh", ["/bin/sh", "-c", script], dict(os.environ), setsid=True)


@pytest.fixture
def groups():
    # as the runtime does: orphaned group members come to us to be reaped, not to PID 1
    procgroup.become_subreaper()
    started: list[int] = []
    yield started
    for pgid in started:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pgid, os.WNOHANG)


def wait_members(pgid: int, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(group_members(pgid)) < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_proc_stat_of_this_process() -> None:
    st = proc_stat(os.getpid())
    assert st is not None
    assert (st.state, st.ppid, st.pgrp) == ("R", os.getppid(), os.getpgrp())
    assert proc_stat(2**22 + 1) is None  # above pid_max


def test_status_to_exit_code_uses_128_plus_signal() -> None:
    assert status_to_exit_code(3 << 8) == 3
    assert status_to_exit_code(int(signal.SIGKILL)) == 137
    assert status_to_exit_code(int(signal.SIGTERM)) == 143


async def test_term_wait_and_reap_a_group(groups: list[int]) -> None:
    pid = start_group("sleep 60 & sleep 60; wait")
    groups.append(pid)
    wait_members(pid, 3)
    st = proc_stat(pid)
    assert st is not None
    g = ProcessGroup("t1", pid, proc_start=st.starttime, is_child=True)
    assert g.pgid == pid
    assert g.leader_alive()
    g.signal(signal.SIGTERM)
    await asyncio.wait_for(g.wait_leader(), 5)
    assert not g.leader_alive()
    assert await g.reap(5)
    assert g.wait_code == 143
    assert not group_exists(pid)
    g.signal(signal.SIGTERM)  # a gone group: nothing happens


async def test_reap_kills_what_is_left_after_the_leader(groups: list[int]) -> None:
    pid = start_group("trap '' TERM; sleep 60 & exit 0")
    groups.append(pid)
    g = ProcessGroup("t2", pid, proc_start=None, is_child=True)
    await asyncio.wait_for(g.wait_leader(), 5)
    assert group_exists(pid)  # the background sleep keeps the group
    assert await g.reap(5)
    assert g.wait_code == 0
    assert not group_exists(pid)


async def test_wait_quiet_returns_when_the_group_has_ended(groups: list[int]) -> None:
    pid = start_group("sleep 0.2")
    groups.append(pid)
    g = ProcessGroup("t3", pid, proc_start=None, is_child=True)
    t0 = time.monotonic()
    await g.wait_quiet(5)
    assert time.monotonic() - t0 < 3
    await g.wait_quiet(-1)  # no time left: returns at once


def test_a_reused_pid_is_not_the_leader(groups: list[int]) -> None:
    pid = start_group("sleep 60")
    groups.append(pid)
    st = proc_stat(pid)
    assert st is not None
    assert ProcessGroup("t4", pid, proc_start=st.starttime, is_child=False).leader_alive()
    assert not ProcessGroup("t4", pid, proc_start=st.starttime + 1, is_child=False).leader_alive()


def test_become_subreaper_is_idempotent() -> None:
    procgroup.become_subreaper()
    procgroup.become_subreaper()


def _until(what: str, fn, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := fn():
            return got
        time.sleep(0.02)
    raise AssertionError(f"no {what}")


_CATCHER = "import signal, time; signal.signal(signal.SIGUSR1, lambda *_: None); time.sleep(30)"


def test_signal_disposition_sees_who_catches_ignores_or_dies(groups: list[int]) -> None:
    """A leader that traps USR1 (left out as ours), a child with the default action (would
    die), one that ignores it and one with a handler; only the handler's process is
    signalled, and the one that would die of it lives on."""
    import sys

    py = sys.executable
    pgid = start_group(
        f"trap : USR1; sleep 30 & (trap '' USR1; exec sleep 31) & {py} -c '{_CATCHER}' & wait"
    )
    groups.append(pgid)
    leader = _until("the shell's command line", Path(f"/proc/{pgid}/cmdline").read_bytes)
    d = _until(
        "a handler and the plain sleep",
        lambda: (
            (x := procgroup.signal_disposition(pgid, signal.SIGUSR1, leader.__eq__)).catching
            and x.dying
            and x
        ),
    )
    names = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] for pid in d.dying}
    assert list(names.values()) == [b"sleep"], names
    assert len(d.catching) == 1 and pgid not in d.catching + d.dying
    assert procgroup.signal_members(pgid, d.catching, signal.SIGUSR1) == 1
    time.sleep(0.2)
    (sleeper,) = names
    assert proc_stat(sleeper) is not None and proc_stat(sleeper).state not in "ZX"
    assert procgroup.signal_members(pgid, [os.getpid()], signal.SIGUSR1) == 0  # not in it


def test_processes_the_agent_calls_its_own_are_left_out(groups: list[int]) -> None:
    """A fork that has not exec'd has its parent's command line and handlers: ``ours``
    recognises it by the command line, so it never counts as the application."""
    import sys

    script = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGUSR1, lambda *_: None)\n"
        "if os.fork() == 0:\n"
        "    time.sleep(30)\n"
        "time.sleep(30)\n"
    )
    argv = [sys.executable, "-c", script, "agent-marker"]
    pgid = os.posix_spawn(sys.executable, argv, dict(os.environ), setsid=True)
    groups.append(pgid)
    _until("the fork", lambda: len(group_members(pgid)) == 2)
    theirs = procgroup.signal_disposition(pgid, signal.SIGUSR1)
    assert len(theirs.catching) == 2 and theirs.known  # the leader and its fork
    ours = procgroup.signal_disposition(pgid, signal.SIGUSR1, lambda c: b"\0agent-marker" in c)
    assert ours.catching == () and ours.dying == ()


async def test_a_signal_taken_by_a_wrapper_fork_before_its_exec_reaches_its_command(
    groups: list[int],
) -> None:
    """The wrapper traps SIGTERM; a fork of it that has not exec'd yet still has that
    trap, swallows the group's SIGTERM and then execs the command, which never saw it.
    Found before the signal (by its command line), the fork's command is sent it once
    it has exec'd: it ends by SIGTERM, not by SIGKILL after the grace."""
    import sys

    script = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: None)\n"
        "if os.fork() == 0:\n"
        "    time.sleep(0.5)\n"  # between fork and exec, the wrapper's trap
        "    os.execv('/bin/sleep', ['sleep', '30'])\n"
        "_, st = os.wait()\n"
        "os._exit(-os.waitstatus_to_exitcode(st))\n"  # the signal that ended the command
    )
    marker = b"\0wrapper-marker"
    argv = [sys.executable, "-c", script, "wrapper-marker"]
    pgid = os.posix_spawn(sys.executable, argv, dict(os.environ), setsid=True)
    groups.append(pgid)
    group = ProcessGroup("wrapped", pgid, proc_start=None, is_child=True)
    forks = _until("the fork", lambda: procgroup.unexeced_forks(pgid, lambda c: marker in c))
    os.killpg(pgid, signal.SIGTERM)  # taken by the fork's (and the leader's) handler
    sent = await group.signal_after_exec(forks, signal.SIGTERM, lambda c: marker in c)
    assert sent == 1
    _, status = os.waitpid(pgid, 0)
    assert os.waitstatus_to_exitcode(status) == signal.SIGTERM  # the command's end
    (fork,) = forks
    assert proc_stat(fork) is None or proc_stat(fork).state in "ZX"
