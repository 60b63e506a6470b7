"""The agent's exit path stays short: a job whose wrapper ended alone is reaped without a
scan of /proc, and the log pool of an allocation is known before its end is reported."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from lattice_agent import procgroup
from lattice_agent.logship import POOL_ORDINARY, POOL_SENSITIVE, LogPools
from lattice_agent.procgroup import ProcessGroup, group_exists
from lattice_common.logstore import FsLogStore


def start_group(script: str) -> int:
    # as the agent spawns: no Popen object that could reap the leader behind our back
    return os.posix_spawn("/bin/sh", ["/bin/sh", "-c", script], dict(os.environ), setsid=True)


async def test_a_leader_that_ended_alone_is_reaped_without_scanning_proc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_scan(pgid: int) -> list[tuple[int, procgroup.ProcStat]]:
        raise AssertionError("the group was scanned")

    monkeypatch.setattr(procgroup, "group_members", no_scan)
    pid = start_group("exit 7")
    g = ProcessGroup("x1", pid, proc_start=None, is_child=True)
    await asyncio.wait_for(g.wait_leader(), 5)
    assert await g.reap(5)
    assert g.wait_code == 7
    assert not group_exists(pid)
    with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
        os.waitpid(pid, os.WNOHANG)


async def test_what_the_leader_left_behind_is_still_killed_and_reaped() -> None:
    procgroup.become_subreaper()  # as the agent: orphans of the group come back to us
    pid = start_group("trap '' TERM; sleep 60 & exit 3")
    g = ProcessGroup("x2", pid, proc_start=None, is_child=True)
    try:
        await asyncio.wait_for(g.wait_leader(), 5)
        assert group_exists(pid)  # the background sleep keeps the group
        assert await g.reap(5)
        assert g.wait_code == 3
        assert not group_exists(pid)
    finally:
        if group_exists(pid):
            os.killpg(pid, signal.SIGKILL)


async def test_the_log_pool_is_classified_when_the_job_starts(tmp_path: Path) -> None:
    asked: list[str] = []
    answer = asyncio.Event()

    async def classify(aid: str) -> bool:
        asked.append(aid)
        await answer.wait()
        return aid.startswith("s")

    store = FsLogStore(tmp_path / "logs")
    pools = LogPools(store, FsLogStore(tmp_path / "sensitive"), classify=classify)
    pools.prefetch("s1")
    pools.prefetch("s1")  # one question per allocation
    pools.prefetch("o1")
    await asyncio.sleep(0)
    assert asked == ["s1", "o1"]  # asked at start, before anything is flushed
    answer.set()
    assert await pools.pool_of("s1") == POOL_SENSITIVE
    assert await pools.pool_of("o1") == POOL_ORDINARY
    assert asked == ["s1", "o1"]  # the flush used the early answers


async def test_a_failed_early_classification_is_asked_again(tmp_path: Path) -> None:
    calls = 0

    async def classify(aid: str) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("leader unreachable")
        return False

    pools = LogPools(FsLogStore(tmp_path / "logs"), classify=classify)
    pools.prefetch("a1")
    await asyncio.sleep(0.01)
    assert await pools.pool_of("a1") == POOL_ORDINARY
    assert calls == 2
