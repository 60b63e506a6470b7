"""Log retention and the sensitive log pool, end to end below the cluster: the real agent
runtime (real processes) flushing into real stores (a directory; moto's S3 server), the
real LogProxy reading them, and the retention sweeper deleting from them. The quorum is a
small stand-in holding allocations, nodes and vClusters."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from grpclib.server import Server
from lattice_agent.logship import LogPools
from lattice_agent.runtime import ProcessRuntime
from lattice_agent.service import NodeAgentService
from lattice_api.log_retention import (
    DELETED,
    LogRetention,
    RetentionPolicy,
    due,
    removed_message,
)
from lattice_api.logs import LogProxy
from lattice_common.agents import AgentChannels
from lattice_common.errors import NotFound, Unavailable
from lattice_common.logcrypt import EncryptedLogStore, LogKey
from lattice_common.logstore import (
    AllocationLogs,
    FsLogStore,
    LogStore,
    S3LogStore,
    StreamMeta,
    TraceMetadata,
    TraceNodeMeta,
    allocation_root,
    encode_trace_chunk,
    encode_trace_metadata,
    trace_chunk_key,
    trace_metadata_key,
)
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    Node,
    NodeState,
    SchedulerType,
    VCluster,
)
from lattice_quorum import queries
from lattice_test_harness.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY

pytestmark = pytest.mark.timeout(90)

DAY = 86400.0
KEY = LogKey(os.urandom(32))
SECRET_LINE = "patient 4711 genotype GATTACA"


class Quorum:
    """What LogProxy and the sweeper read: allocations, nodes and vClusters by name."""

    is_leader = True

    def __init__(self) -> None:
        self.allocs: dict[str, Allocation] = {}
        self.nodes: dict[str, Node] = {}
        self.vclusters = {
            "batch": VCluster(name="batch"),
            "secure": VCluster(name="secure", scheduler_type=SchedulerType.SENSITIVE_RESERVATION),
        }

    def read(self, fn: Any, *args: Any) -> Any:
        table = {
            queries.allocation: self.allocs,
            queries.node: self.nodes,
            queries.vcluster: self.vclusters,
        }[fn]
        got = table.get(args[0])
        return None if got is None else msgspec.structs.replace(got)

    def alloc(
        self,
        aid: str,
        *,
        vcluster: str = "batch",
        state: AllocationState = AllocationState.RUNNING,
        finished_at: float | None = None,
        tenant: str = "physics",
    ) -> Allocation:
        a = Allocation(
            id=aid,
            spec=AllocationSpec(entrypoint="x", tenant=tenant, vcluster=vcluster),
            state=state,
            assigned_nodes=["n1"],
            finished_at=finished_at,
        )
        self.allocs[aid] = a
        return a


# --------------------------------------------------------------------------- pure


def test_due_never_touches_running_or_unknown_ends() -> None:
    q = Quorum()
    now = 100 * DAY
    running = q.alloc("r")
    no_end = q.alloc("e", state=AllocationState.COMPLETED)
    old = q.alloc("o", state=AllocationState.FAILED, finished_at=now - 31 * DAY)
    young = q.alloc("y", state=AllocationState.COMPLETED, finished_at=now - 29 * DAY)
    assert due(running, 0.0, 30, now) == (False, None)  # the store's age does not count
    assert due(no_end, 0.0, 30, now) == (False, None)
    assert due(old, None, 30, now) == (True, now - 31 * DAY)
    assert due(young, 0.0, 30, now)[0] is False
    assert due(old, None, 0, now) == (False, None)  # 0 = forever
    # gone from the quorum: the store's last write is the end; none known: kept
    assert due(None, now - 31 * DAY, 30, now)[0] is True
    assert due(None, None, 30, now) == (False, None)


def test_removed_message_names_the_retention() -> None:
    q = Quorum()
    now = time.time()
    a = q.alloc("a", state=AllocationState.COMPLETED, finished_at=now - 40 * DAY)
    msg = removed_message(a, RetentionPolicy(), sensitive=False, now=now)
    assert msg is not None and "removed by the retention policy" in msg
    assert "kept 30 days (storage.log_retention_days)" in msg
    assert removed_message(a, RetentionPolicy(), sensitive=True, now=now) is None  # 7 years


# --------------------------------------------------------------------------- retention


@pytest.fixture(params=["fs", "s3"])
async def pools(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[Any, Any]]:
    """(ordinary store, sensitive raw store) on the same backend."""
    if request.param == "fs":
        yield FsLogStore(tmp_path / "logs"), FsLogStore(tmp_path / "sensitive")
        return
    server = request.getfixturevalue("s3_server")
    made = []
    for name in ("logs", "sensitive"):
        s3 = S3LogStore(
            bucket=f"{name}-{uuid.uuid4().hex[:10]}",
            endpoint_url=server.endpoint,
            access_key_id=ACCESS_KEY_ID,
            secret_access_key=SECRET_ACCESS_KEY,
        )
        await s3.create_bucket()
        made.append(s3)
    try:
        yield made[0], made[1]
    finally:
        for s in made:
            await s.close()


async def put_logs(store: LogStore, aid: str, *, last_ts: float, tenant: str = "physics") -> None:
    logs = AllocationLogs(store, tenant, "default", aid)
    info = await logs.write_chunk("stdout", "n1", 0, [(last_ts - 1, "hello"), (last_ts, "bye")])
    sm = StreamMeta()
    sm.add(info, 12)
    sm.complete = True
    await logs.publish("n1", {"stdout": sm})
    if last_ts < time.time() - 60:  # an old allocation: its metadata was last written then
        meta = await logs.metadata()
        assert meta is not None
        meta.updated_at = last_ts
        await store.put(logs.metadata_key, msgspec.json.encode(meta))


async def put_trace(store: LogStore, aid: str, *, last_ts: float) -> None:
    root = allocation_root("physics", "default", aid)
    sample = ("cpu_utilization", {"alloc_id": aid, "agg": "raw"}, 0.5, int(last_ts * 1000))
    await store.put(trace_chunk_key(root, "n1", 0), encode_trace_chunk([sample]))
    meta = TraceMetadata(
        allocation_id=aid,
        updated_at=last_ts,
        nodes={"n1": TraceNodeMeta(chunks=1, samples=1, first_ts=last_ts, last_ts=last_ts)},
    )
    await store.put(trace_metadata_key(root), encode_trace_metadata(meta))


async def test_sweep_deletes_only_what_ended_long_ago(pools: tuple[Any, Any]) -> None:
    ordinary, sensitive_raw = pools
    sensitive = EncryptedLogStore(sensitive_raw, KEY)
    q = Quorum()
    now = time.time()
    ended = AllocationState.COMPLETED
    # in the quorum
    q.alloc("old", state=ended, finished_at=now - 31 * DAY)
    q.alloc("young", state=ended, finished_at=now - 2 * DAY)
    q.alloc("running")  # its output is old, it still runs
    q.alloc("noend", state=ended)  # no end time: never
    q.alloc("traced", state=ended, finished_at=now - 8 * DAY)  # traces 7 d, logs 30 d
    q.alloc("s-old", vcluster="secure", state=ended, finished_at=now - 2600 * DAY)
    q.alloc("s-young", vcluster="secure", state=ended, finished_at=now - 40 * DAY)
    for aid in ("old", "young", "running", "noend", "traced"):
        await put_logs(ordinary, aid, last_ts=now - 50 * DAY)
    await put_trace(ordinary, "traced", last_ts=now - 8 * DAY)
    await put_trace(ordinary, "young", last_ts=now - 2 * DAY)
    # gone from the quorum (moved to the history): measured by the metadata
    await put_logs(ordinary, "hist-old", last_ts=now - 45 * DAY)
    await put_logs(ordinary, "hist-new", last_ts=now - 5 * DAY)
    await ordinary.put("physics/default/hist-nometa/logs/stdout/n1/chunk_000000.log.zst", b"x")
    for aid in ("s-old", "s-young"):
        await put_logs(sensitive, aid, last_ts=now - 50 * DAY)
    await put_trace(sensitive, "s-young", last_ts=now - 40 * DAY)

    before = {
        (p, k): DELETED.labels(p, k)._value.get()
        for p in ("ordinary", "sensitive")
        for k in ("logs", "telemetry")
    }
    sweeper = LogRetention(
        q,  # type: ignore[arg-type]
        {"ordinary": ordinary, "sensitive": sensitive},
        RetentionPolicy(),
    )
    deleted = await sweeper.sweep()

    async def allocs(store: LogStore, kind: str) -> set[str]:
        return {k.split("/")[2] for k in await store.list("") if k.split("/")[3] == kind}

    assert await allocs(ordinary, "logs") == {
        "young",
        "running",
        "noend",
        "traced",
        "hist-new",
        "hist-nometa",
    }
    assert await allocs(ordinary, "telemetry") == {"young"}
    assert await allocs(sensitive_raw, "logs") == {"s-young"}
    assert await allocs(sensitive_raw, "telemetry") == {"s-young"}
    # objects: old 2 + hist-old 2 + traced's traces 2 + s-old 2
    assert deleted == 8
    after = {key: DELETED.labels(*key)._value.get() for key in before}
    assert after[("ordinary", "logs")] - before[("ordinary", "logs")] == 4
    assert after[("ordinary", "telemetry")] - before[("ordinary", "telemetry")] == 2
    assert after[("sensitive", "logs")] - before[("sensitive", "logs")] == 2
    assert await sweeper.sweep() == 0  # nothing more is due

    # `lattice logs` of a removed allocation says why, with the retention
    proxy = LogProxy(
        q,  # type: ignore[arg-type]
        AgentChannels(),
        ordinary,
        sensitive_store=sensitive,
        retention=RetentionPolicy(),
    )
    with pytest.raises(NotFound, match="removed by the retention policy") as e:
        await proxy.fetch(q.allocs["old"])
    assert "kept 30 days (storage.log_retention_days)" in str(e.value)
    with pytest.raises(NotFound, match=r"storage\.sensitive_log_retention_days"):
        await proxy.fetch(q.allocs["s-old"])
    # what is kept is still read (the sensitive one through the key)
    young = await proxy.fetch(q.allocs["young"])
    assert [ln["line"] for ln in young] == ["hello", "bye"]
    assert [ln["line"] for ln in await proxy.fetch(q.allocs["s-young"])] == ["hello", "bye"]
    agents_gone = proxy.agents
    agents_gone.close()


# --------------------------------------------------------------------------- sensitive pool


@dataclass
class Node1:
    quorum: Quorum
    runtime: ProcessRuntime
    server: Server | None
    proxy: LogProxy
    ordinary: FsLogStore
    sensitive_raw: FsLogStore
    log_dir: Path

    async def start(self, aid: str, entrypoint: str, vcluster: str) -> Allocation:
        a = self.quorum.alloc(aid, vcluster=vcluster)
        await self.runtime.start(
            msgspec.structs.replace(a, spec=msgspec.structs.replace(a.spec, entrypoint=entrypoint)),
            nodelist=["n1"],
        )
        return a

    async def run_to_end(self, aid: str, entrypoint: str, vcluster: str) -> Allocation:
        await self.start(aid, entrypoint, vcluster)
        deadline = time.monotonic() + 30
        while not any(
            r.allocation_id == aid and r.phase == "exited" for r in self.runtime.reports()
        ):
            assert time.monotonic() < deadline, "the job did not end"
            await asyncio.sleep(0.05)
        return self.quorum.alloc(
            aid, vcluster=vcluster, state=AllocationState.COMPLETED, finished_at=time.time()
        )

    async def stop_agent(self) -> None:
        assert self.server is not None
        self.server.close()
        self.server = None
        self.proxy.agents.close()


async def make_node(tmp_path: Path, *, sensitive_pool: bool) -> Node1:
    ordinary = FsLogStore(tmp_path / "logs")
    sensitive_raw = FsLogStore(tmp_path / "sensitive")
    quorum = Quorum()

    async def classify(alloc_id: str) -> bool:
        # the agent asks whether its node is claimed; here: the allocation's vCluster
        a = quorum.allocs[alloc_id]
        return a.spec.vcluster == "secure"

    runtime = ProcessRuntime(
        node_id="n1",
        work_dir=tmp_path / "work",
        log_dir=tmp_path / "logs-local",
        state_file=tmp_path / "agent-state.json",
        log_flush_interval=0.2,
        log_pools=LogPools(
            FsLogStore(tmp_path / "logs"),
            EncryptedLogStore(FsLogStore(tmp_path / "sensitive"), KEY) if sensitive_pool else None,
            node_id="n1",
            classify=classify,
        ),
    )
    await runtime.recover()
    server = Server([NodeAgentService("n1", runtime, tmp_path / "logs-local")])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    quorum.nodes["n1"] = Node(id="n1", state=NodeState.READY, agent_address=f"127.0.0.1:{port}")
    proxy = LogProxy(
        quorum,  # type: ignore[arg-type]
        AgentChannels(),
        ordinary,
        sensitive_store=EncryptedLogStore(sensitive_raw, KEY) if sensitive_pool else None,
        retention=RetentionPolicy(),
        poll_interval=0.1,
        agent_retry_interval=0.2,
        node_check_interval=0.2,
    )
    return Node1(quorum, runtime, server, proxy, ordinary, sensitive_raw, tmp_path / "logs-local")


@contextlib.asynccontextmanager
async def node(tmp_path: Path, *, sensitive_pool: bool) -> AsyncIterator[Node1]:
    n = await make_node(tmp_path, sensitive_pool=sensitive_pool)
    try:
        yield n
    finally:
        if n.server is not None:
            n.server.close()
        pids = [r.pid for r in n.runtime.reports() if r.pid > 0]
        await n.runtime.close()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        await n.proxy.aclose()


async def wait_complete(store: LogStore, aid: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        got = await AllocationLogs(store, "physics", "default", aid).read()
        if got.complete:
            return
        assert time.monotonic() < deadline, f"the logs of {aid} never completed in the store"
        await asyncio.sleep(0.1)


async def test_sensitive_logs_are_encrypted_in_their_own_pool(tmp_path: Path) -> None:
    async with node(tmp_path, sensitive_pool=True) as n:
        script = f"echo '{SECRET_LINE}'; echo second >&2"
        sens = await n.run_to_end("s1", script, "secure")
        plain = await n.run_to_end("p1", "echo ordinary output", "batch")
        await wait_complete(EncryptedLogStore(n.sensitive_raw, KEY), "s1")
        await wait_complete(n.ordinary, "p1")
        # never in the ordinary pool; the ordinary one never in the sensitive pool
        assert {k.split("/")[2] for k in await n.ordinary.list("")} == {"p1"}
        assert {k.split("/")[2] for k in await n.sensitive_raw.list("")} == {"s1"}
        # on disk: sealed objects, the output line nowhere
        files = [p for p in (tmp_path / "sensitive").rglob("*") if p.is_file()]
        assert files
        for f in files:
            raw = f.read_bytes()
            assert raw.startswith(b"LLE1") and b"GATTACA" not in raw, f
        # the API reads them back through the key, with the agent gone
        await n.stop_agent()
        got = await n.proxy.fetch(sens)
        assert sorted(ln["line"] for ln in got) == sorted([SECRET_LINE, "second"])
        assert [ln["line"] for ln in await n.proxy.fetch(plain)] == ["ordinary output"]
        # an API with another key: a clear error, not an empty answer
        wrong = LogProxy(
            n.quorum,  # type: ignore[arg-type]
            AgentChannels(),
            n.ordinary,
            sensitive_store=EncryptedLogStore(n.sensitive_raw, LogKey(os.urandom(32))),
        )
        with pytest.raises(Unavailable, match=f"cannot be decrypted.*key id {KEY.id}"):
            await wrong.fetch(sens)
        await wrong.aclose()


async def test_sensitive_logs_stay_on_the_node_without_a_pool(tmp_path: Path) -> None:
    async with node(tmp_path, sensitive_pool=False) as n:
        sens = await n.run_to_end("s2", f"echo '{SECRET_LINE}'", "secure")
        plain = await n.run_to_end("p2", "echo ordinary", "batch")
        await wait_complete(n.ordinary, "p2")
        await asyncio.sleep(0.6)  # several flush intervals
        assert {k.split("/")[2] for k in await n.ordinary.list("")} == {"p2"}
        assert not (tmp_path / "sensitive").exists()
        # the agent serves them while it is there
        assert [ln["line"] for ln in await n.proxy.fetch(sens)] == [SECRET_LINE]
        await n.stop_agent()
        with pytest.raises(Unavailable, match="kept only on its nodes"):
            await n.proxy.fetch(sens)
        assert [ln["line"] for ln in await n.proxy.fetch(plain)] == ["ordinary"]
