"""LogProxy with a log store: the real agent service and runtime (real processes) on a
loopback gRPC port and a file-system store; the agent is stopped to see the store take
over. The quorum is a small stand-in holding one allocation and one node."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from grpclib.server import Server
from lattice_agent.runtime import ProcessRuntime
from lattice_agent.service import NodeAgentService
from lattice_api.logs import LogProxy, _Cursor
from lattice_common.agents import AgentChannels
from lattice_common.errors import NotFound, Unavailable
from lattice_common.logstore import AllocationLogs, FsLogStore, SeqEnd
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    Node,
    NodeState,
)
from lattice_quorum import queries

pytestmark = pytest.mark.timeout(60)


class Quorum:
    """What LogProxy reads: allocations and nodes by id."""

    def __init__(self) -> None:
        self.allocs: dict[str, Allocation] = {}
        self.nodes: dict[str, Node] = {}

    def read(self, fn: Any, *args: Any) -> Any:
        table = {
            queries.allocation: self.allocs,
            queries.node: self.nodes,
            queries.vcluster: {},  # no sensitive vClusters here
        }[fn]
        got = table.get(args[0])
        return None if got is None else msgspec.structs.replace(got)


@dataclass
class Node1:
    quorum: Quorum
    runtime: ProcessRuntime
    server: Server | None
    proxy: LogProxy
    store: FsLogStore
    log_dir: Path

    def alloc(self, aid: str, state: AllocationState = AllocationState.RUNNING) -> Allocation:
        a = Allocation(
            id=aid,
            spec=AllocationSpec(entrypoint="x", tenant="physics", vcluster="v"),
            state=state,
            assigned_nodes=["n1"],
        )
        self.quorum.allocs[aid] = a
        return a

    async def start(self, aid: str, entrypoint: str) -> Allocation:
        a = self.alloc(aid)
        await self.runtime.start(
            msgspec.structs.replace(a, spec=msgspec.structs.replace(a.spec, entrypoint=entrypoint)),
            nodelist=["n1"],
        )
        return a

    def end(self, aid: str) -> Allocation:
        return self.alloc(aid, AllocationState.COMPLETED)

    async def stop_agent(self) -> None:
        """As when the agent process dies: its port closes and so do its connections."""
        assert self.server is not None
        self.server.close()
        self.server = None
        self.proxy.agents.close()  # the kernel would reset the connections


@pytest.fixture
async def node1(tmp_path: Path) -> AsyncIterator[Node1]:
    store = FsLogStore(tmp_path / "store")
    runtime = ProcessRuntime(
        node_id="n1",
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs",
        state_file=tmp_path / "agent-state.json",
        log_store=FsLogStore(tmp_path / "store"),
        log_flush_interval=0.2,
    )
    await runtime.recover()
    server = Server([NodeAgentService("n1", runtime, tmp_path / "logs")])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    quorum = Quorum()
    quorum.nodes["n1"] = Node(id="n1", state=NodeState.READY, agent_address=f"127.0.0.1:{port}")
    proxy = LogProxy(
        quorum,  # type: ignore[arg-type]
        AgentChannels(),
        store,
        poll_interval=0.1,
        agent_retry_interval=0.2,
        node_check_interval=0.2,
    )
    n = Node1(quorum, runtime, server, proxy, store, tmp_path / "logs")
    try:
        yield n
    finally:
        if n.server is not None:
            n.server.close()
        pids = [r.pid for r in runtime.reports() if r.pid > 0]
        await runtime.close()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        await proxy.aclose()


async def wait_for(what: str, fn: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = await fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def texts(lines: list[dict[str, Any]]) -> list[str]:
    return [ln["line"] for ln in lines]


async def stored_lines(n: Node1, aid: str) -> int:
    r = await AllocationLogs(n.store, "physics", "default", aid).read()
    return len(r.lines)


# --------------------------------------------------------------------------- the join


def test_cursor_passes_each_line_once() -> None:
    cur = _Cursor({("stdout", "n1"): SeqEnd(lines=3, last_ts=2.0, at_last_ts=2)})
    keep = cur.source()

    def ln(ts: float, text: str, stream: str = "stdout") -> dict[str, Any]:
        return {"stream": stream, "node_id": "n1", "timestamp": ts, "line": text}

    got = [
        x["line"]
        for x in [
            ln(1.0, "a"),
            ln(2.0, "b"),
            ln(2.0, "c"),
            ln(2.0, "d"),
            ln(3.0, "e"),
            ln(0.5, "err", "stderr"),
        ]
        if keep(x)
    ]
    assert got == ["d", "e", "err"]
    # a second pass over the same source (a reconnect) passes nothing again
    keep2 = cur.source()
    assert not [x for x in [ln(2.0, "b"), ln(2.0, "c"), ln(2.0, "d"), ln(3.0, "e")] if keep2(x)]
    assert keep2(ln(3.0, "f"))


# --------------------------------------------------------------------------- fetch


async def test_running_job_history_and_live_lines_join_without_duplicates(node1: Node1) -> None:
    a = await node1.start(
        "j1", "for i in $(seq 1 30); do echo line $i; done; echo oops >&2; sleep 30"
    )
    await wait_for("a flush", lambda: stored_lines(node1, "j1"))
    # more output after the flush: in the agent's ring buffer only
    with open(node1.log_dir / "j1" / "stdout.log", "a") as f:
        f.write("late 1\nlate 2\n")
    await asyncio.sleep(0.05)

    async def everything() -> list[dict[str, Any]] | None:
        got = await node1.proxy.fetch(a)
        return got if "late 2" in texts(got) else None

    got = await wait_for("the late lines", everything)
    out = [ln["line"] for ln in got if ln["stream"] == "stdout"]
    assert out == [f"line {i}" for i in range(1, 31)] + ["late 1", "late 2"]
    assert [ln["line"] for ln in got if ln["stream"] == "stderr"] == ["oops"]
    assert texts(await node1.proxy.fetch(a, tail=2)) == ["late 1", "late 2"]
    assert texts(await node1.proxy.fetch(a, stream="stderr")) == ["oops"]
    assert texts(await node1.proxy.fetch(a, offset=1, limit=2)) == ["line 2", "line 3"]
    assert await node1.proxy.fetch(a, node="other") == []
    first = got[0]["timestamp"]
    assert texts(await node1.proxy.fetch(a, until=first, stream="stdout"))[0] == "line 1"
    assert "line 1" not in texts(await node1.proxy.fetch(a, since=got[-1]["timestamp"]))

    # the agent goes away: what was flushed is still there
    await node1.stop_agent()
    flushed = await node1.proxy.fetch(a)
    assert texts(flushed)[:5] == ["line 1", "line 2", "line 3", "line 4", "line 5"]


async def test_ended_job_is_read_from_the_store_when_its_files_are_gone(node1: Node1) -> None:
    await node1.start("j2", "for i in $(seq 1 50); do echo out $i; done")
    for _ in range(200):
        if any(r.phase == "exited" for r in node1.runtime.reports()):
            break
        await asyncio.sleep(0.05)
    a = node1.end("j2")
    shutil.rmtree(node1.log_dir / "j2")  # the node's copy is gone
    got = await node1.proxy.fetch(a)
    assert texts(got) == [f"out {i}" for i in range(1, 51)]
    assert all(ln["node_id"] == "n1" and ln["allocation_id"] == "j2" for ln in got)
    await node1.stop_agent()
    assert texts(await node1.proxy.fetch(a, tail=3)) == ["out 48", "out 49", "out 50"]
    streamed = [ln async for ln in node1.proxy.follow(a, tail=2)]
    assert texts(streamed) == ["out 49", "out 50"]


async def test_no_store_no_agent_is_unavailable_and_pending_has_no_output(node1: Node1) -> None:
    a = node1.alloc("j3")
    await node1.stop_agent()
    bare = LogProxy(node1.quorum, AgentChannels())  # type: ignore[arg-type]
    with pytest.raises(Unavailable):
        await bare.fetch(a)
    # with a store that has nothing for it: still the agent's error
    with pytest.raises(Unavailable):
        await node1.proxy.fetch(a)
    pending = node1.alloc("j4", AllocationState.PENDING)
    with pytest.raises(NotFound, match="no output yet"):
        await node1.proxy.fetch(pending)
    bare.close()


# --------------------------------------------------------------------------- follow


async def test_follow_goes_on_from_the_store_when_the_agent_goes_away(node1: Node1) -> None:
    n = 40
    a = await node1.start("j5", f"for i in $(seq 1 {n}); do echo tick $i; sleep 0.05; done")
    seen: list[str] = []

    async def follow() -> None:
        async for ln in node1.proxy.follow(a, tail=None):
            seen.append(ln["line"])

    task = asyncio.create_task(follow())
    await wait_for("live lines", lambda: asyncio.sleep(0, len(seen) >= 5))
    await node1.stop_agent()  # the stream breaks; shipping goes on (the runtime still runs)
    for _ in range(200):
        if any(r.phase == "exited" for r in node1.runtime.reports()):
            break
        await asyncio.sleep(0.05)
    node1.end("j5")
    await asyncio.wait_for(task, 15)
    assert seen == [f"tick {i}" for i in range(1, n + 1)]


async def test_follow_shows_a_new_line_quickly(node1: Node1) -> None:
    a = await node1.start("j6", "echo first; sleep 0.6; echo second; sleep 30")
    got: list[tuple[str, float]] = []

    async def follow() -> None:
        async for ln in node1.proxy.follow(a):
            got.append((ln["line"], time.time()))

    task = asyncio.create_task(follow())
    try:
        await wait_for("second", lambda: asyncio.sleep(0, any(t == "second" for t, _ in got)))
        written = (node1.log_dir / "j6" / "stdout.log").stat().st_mtime
        seen_at = next(at for t, at in got if t == "second")
        assert seen_at - written < 1.0
        assert [t for t, _ in got] == ["first", "second"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_follow_leaves_a_node_the_quorum_declared_down(node1: Node1) -> None:
    """A lost node's connection may hang instead of breaking: the quorum's word counts."""
    a = await node1.start("j7", "echo a; sleep 1; echo b; sleep 30")
    seen: list[str] = []

    async def follow() -> None:
        async for ln in node1.proxy.follow(a):
            seen.append(ln["line"])

    task = asyncio.create_task(follow())
    await wait_for("a", lambda: asyncio.sleep(0, seen == ["a"]))
    node1.quorum.nodes["n1"].state = NodeState.DOWN  # the agent's stream stays open, quiet
    await wait_for("b from the store", lambda: asyncio.sleep(0, seen == ["a", "b"]))
    node1.alloc("j7", AllocationState.FAILED)  # requeue policy: never
    await asyncio.wait_for(task, 5)
    assert seen == ["a", "b"]
