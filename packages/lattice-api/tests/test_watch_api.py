"""``lattice watch`` and ``lattice telemetry`` in the API: StreamMetrics fanned out to the
real agent services of an allocation's two nodes (their telemetry loops running on
loopback, fed by a fixed source) and merged into one stream, over REST (NDJSON, through
the SDK) and gRPC; the mode switch (PATCH / Update) reaching every node and the open
streams; a node that drops out reported and its return noticed while the other goes on;
and the refusals: object scope, who may switch, states, sensitive allocations, the
StreamMetrics limit."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import grpclib
import jwt
import pytest
from grpclib.server import Server
from lattice_agent.service import NodeAgentService
from lattice_agent.telemetry import TelemetryLoop
from lattice_agent.telemetry.alerts import AlertRule
from lattice_agent.telemetry.samples import AllocLabels, Target
from lattice_api.auth import Role
from lattice_api.ratelimit import concurrent_message
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationSpec, AllocationState, SchedulerType
from lattice_sdk import LatticeClient
from lattice_sdk.errors import LatticeError as SdkError
from served_api import ROLE_CLAIMS, SECRET, bearer, token

pytestmark = pytest.mark.timeout(90)

STREAM = "/api/v1/allocations/{}/metrics/stream"
PATCH = "/api/v1/allocations/{}"
RULE = AlertRule("cpu_idle", "cpu_utilization", "<", 10.0, 0.5, message="CPU idle")


class Source:
    name = "fixed"

    def __init__(self, cpu: float) -> None:
        self.values = {"cpu_utilization": cpu, "memory_used": 2e9}

    def collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        return {t.alloc_id: dict(self.values) for t in targets}

    def forget(self, alloc_id: str) -> None:
        pass


class NodeAgent:
    """A real NodeAgentService with a running telemetry loop for one allocation."""

    def __init__(self, node: str, alloc_id: str, cpu: float, tmp: Path) -> None:
        self.node = node
        self.running = True
        self.loop = TelemetryLoop(
            lambda: [Target(AllocLabels(alloc_id, node, "physics", "bob"))] if self.running else [],
            [Source(cpu)],
            window_seconds=1.0,
            interval=0.2,
            alert_rules=[RULE],
        )
        self.assigned = {alloc_id: object()}
        self.tmp = tmp
        self.port = 0
        self.server: Server | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        service = NodeAgentService(
            self.node, cast(Any, None), self.tmp, telemetry=self.loop, allocation=self.assigned.get
        )
        self.server = Server([service])
        await self.server.start("127.0.0.1", self.port)
        self.port = self.server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if self.task is None:
            self.task = asyncio.create_task(self.loop.run())

    async def stop_server(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def close(self) -> None:
        await self.stop_server()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def pair(served, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Bob's allocation running on n2 (busy) and n3 (idle), each with a real agent."""
    api, world, _, _ = served
    spec = world.spec("bob")
    spec.nodes = 2
    alloc = api.submit(spec)
    api.start(alloc.id, ["n2", "n3"])
    agents = [NodeAgent("n2", alloc.id, 60.0, tmp_path), NodeAgent("n3", alloc.id, 1.0, tmp_path)]
    for a in agents:
        await a.start()
        api.add_node(a.node, agent_address=f"127.0.0.1:{a.port}")
    api.ops.telemetry.retry_interval = 0.3
    api.ops.telemetry.node_check_interval = 0.5
    yield alloc.id, agents
    for a in agents:
        await a.close()


async def collect(
    records: AsyncIterator[dict[str, Any]],
    until: Callable[[list[dict[str, Any]]], bool],
    timeout: float = 10.0,
) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []

    async def go() -> None:
        async for rec in records:
            got.append(rec)
            if until(got):
                return

    try:
        await asyncio.wait_for(go(), timeout)
    except TimeoutError:
        raise AssertionError(
            f"timed out; got {[(r['event'], r['node_id']) for r in got]}"
        ) from None
    return got


async def test_stream_merges_both_nodes_with_alerts(served, pair) -> None:  # type: ignore[no-untyped-def]
    api, *_ = served
    alloc_id, _agents = pair
    async with LatticeClient.from_url(api.rest_url, token=token("bob")) as c:
        recs = await collect(
            c.stream_metrics(alloc_id),
            lambda got: (
                {r["node_id"] for r in got if r["event"] == "metrics" and r["samples"]}
                == {"n2", "n3"}
                and any(r["event"] == "alert" for r in got)
                and sum(
                    1
                    for r in got
                    if r["event"] == "metrics"
                    and r["samples"]
                    and r["samples"][0]["labels"].get("agg") == "mean"
                )
                >= 2
            ),
        )
    metrics = [r for r in recs if r["event"] == "metrics" and r["samples"]]
    for r in metrics:
        assert r["allocation_id"] == alloc_id and r["state"] == "Running"
        assert r["telemetry_mode"] == "prod" and r["resolution_seconds"] == 1.0
        assert {s["name"] for s in r["samples"]} == {"cpu_utilization", "memory_used"}
        assert all(s["node_id"] == r["node_id"] for s in r["samples"])
    cpu = {r["node_id"]: r["samples"][0]["value"] for r in metrics}
    assert cpu == {"n2": 60.0, "n3": 1.0}
    alert = next(r for r in recs if r["event"] == "alert")
    assert alert["node_id"] == "n3" and alert["alerts"] == ["CPU idle"]
    (ev,) = alert["alert_events"]
    assert (ev["rule"], ev["state"], ev["node_id"], ev["metric"]) == (
        "cpu_idle",
        "firing",
        "n3",
        "cpu_utilization",
    )
    assert ev["value"] == 1.0 and ev["threshold"] == 10.0 and ev["for_seconds"] == 0.5


async def test_alerts_only_and_metric_filter(served, pair) -> None:  # type: ignore[no-untyped-def]
    api, *_ = served
    alloc_id, _ = pair
    async with LatticeClient.from_url(api.rest_url, token=token("bob")) as c:
        recs = await collect(
            c.stream_metrics(alloc_id, alerts_only=True), lambda got: len(got) >= 1
        )
        assert [r["event"] for r in recs] == ["alert"] and recs[0]["node_id"] == "n3"
        recs = await collect(
            c.stream_metrics(alloc_id, metrics=["memory_used"], node="n2"),
            lambda got: len([r for r in got if r["event"] == "metrics"]) >= 2,
        )
        assert {r["node_id"] for r in recs} == {"n2"}
        assert {s["name"] for r in recs for s in r["samples"]} == {"memory_used"}


async def test_mode_switch_reaches_every_node_and_open_streams(served, pair) -> None:  # type: ignore[no-untyped-def]
    api, *_ = served
    alloc_id, agents = pair
    async with LatticeClient.from_url(api.rest_url, token=token("bob")) as c:
        stream = c.stream_metrics(alloc_id)
        await collect(stream, lambda got: len(got) >= 2)  # both first snapshots
        t0 = time.time()
        res = await c.set_telemetry_mode(alloc_id, "debug", "2s")
        assert res["allocation_id"] == alloc_id and res["telemetry_mode"] == "debug"
        assert res["duration_seconds"] == 2.0
        assert [(n["node"], n["ok"], n["mode"]) for n in res["nodes"]] == [
            ("n2", True, "debug"),
            ("n3", True, "debug"),
        ]
        assert res["until"] == pytest.approx(t0 + 2.0, abs=1.0)
        assert all(a.loop.mode(alloc_id) == "debug" for a in agents)
        recs = await collect(
            stream,
            lambda got: (
                {
                    r["node_id"]
                    for r in got
                    if r["event"] == "mode" and r["telemetry_mode"] == "prod"
                }
                == {"n2", "n3"}
            ),
        )
        debug = [r for r in recs if r["event"] == "metrics" and r["telemetry_mode"] == "debug"]
        assert {r["node_id"] for r in debug} == {"n2", "n3"}
        assert all(r["resolution_seconds"] == 1.0 for r in debug)
        assert {s["labels"]["agg"] for r in debug for s in r["samples"]} == {"raw"}
        modes = [(r["node_id"], r["telemetry_mode"]) for r in recs if r["event"] == "mode"]
        assert modes.index(("n2", "debug")) < modes.index(("n2", "prod"))
        assert next(r for r in recs if r["event"] == "mode")["mode_until"] == pytest.approx(
            res["until"], abs=1.0
        )
        # early revert: prod without a duration
        res = await c.set_telemetry_mode(alloc_id, "prod")
        assert res["until"] is None and all(n["ok"] for n in res["nodes"])
        await stream.aclose()  # type: ignore[attr-defined]


#: an agent as its own process (so that it can die): a NodeAgentService with a telemetry
#: loop for one allocation on a fixed source, on 127.0.0.1:PORT (0: any; printed)
AGENT_PROCESS = """
import asyncio, sys
from grpclib.server import Server
from lattice_agent.service import NodeAgentService
from lattice_agent.telemetry import TelemetryLoop
from lattice_agent.telemetry.samples import AllocLabels, Target

node, alloc_id, port = sys.argv[1], sys.argv[2], int(sys.argv[3])

class Fixed:
    name = "fixed"
    def collect(self, targets):
        return {t.alloc_id: {"cpu_utilization": 1.0} for t in targets}
    def forget(self, alloc_id):
        pass

async def main():
    loop = TelemetryLoop(lambda: [Target(AllocLabels(alloc_id, node))], [Fixed()],
                         window_seconds=1.0, interval=0.2, alert_rules=[])
    server = Server([NodeAgentService(node, None, ".", telemetry=loop,
                                      allocation={alloc_id: 1}.get)])
    await server.start("127.0.0.1", port)
    print(server._server.sockets[0].getsockname()[1], flush=True)
    await loop.run()

asyncio.run(main())
"""


async def agent_process(node: str, alloc_id: str, port: int = 0) -> tuple[Any, int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        AGENT_PROCESS,
        node,
        alloc_id,
        str(port),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    return proc, int(line)


async def test_a_node_that_drops_out_is_reported_not_fatal(served, pair) -> None:  # type: ignore[no-untyped-def]
    api, *_ = served
    alloc_id, agents = pair
    # n3's agent is a process of its own here: killed, it is gone as a crashed agent is
    await agents[1].stop_server()
    proc, port = await agent_process("n3", alloc_id)
    api.add_node("n3", agent_address=f"127.0.0.1:{port}")
    try:
        async with LatticeClient.from_url(api.rest_url, token=token("bob")) as c:
            stream = c.stream_metrics(alloc_id)
            await collect(stream, lambda got: {r["node_id"] for r in got} == {"n2", "n3"})
            proc.kill()
            await proc.wait()
            recs = await collect(
                stream,
                lambda got: (
                    any(r["event"] == "node_lost" for r in got)
                    and sum(1 for r in got if r["event"] == "metrics" and r["node_id"] == "n2") >= 2
                ),
            )
            lost = next(r for r in recs if r["event"] == "node_lost")
            assert lost["node_id"] == "n3" and "metrics stream lost" in lost["alerts"][0]
            await asyncio.sleep(1.0)  # retried every 0.3 s meanwhile: reported once
            proc, _ = await agent_process("n3", alloc_id, port)  # back on its port
            recs = await collect(
                stream, lambda got: any(r["event"] == "node_back" for r in got), timeout=20
            )
            assert not [r for r in recs if r["event"] == "node_lost"]
            assert next(r for r in recs if r["event"] == "node_back")["node_id"] == "n3"
            await collect(
                stream, lambda got: any(r["node_id"] == "n3" and r["samples"] for r in got)
            )
            # the allocation ends: one "end", and the stream is over
            proc.kill()
            await proc.wait()
            agents[0].running = False
            api.set_state(alloc_id, AllocationState.COMPLETED, exit_code=0)
            rest = await collect(stream, lambda got: got[-1]["event"] == "end", timeout=10)
            assert [r["event"] for r in rest].count("end") == 1
            assert rest[-1]["state"] == "Completed"
            assert [r async for r in stream] == []
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_grpc_stream_and_update(served, pair) -> None:  # type: ignore[no-untyped-def]
    _, world, _, channel = served
    alloc_id, agents = pair
    stub = v1.AllocationServiceStub(channel, timeout=20, metadata=bearer("bob"))
    got: list[v1.MetricsSnapshot] = []

    async def first_of_both() -> None:
        async for m in stub.stream_metrics(v1.StreamMetricsRequest(allocation_id=alloc_id)):
            got.append(m)
            if len({m.node_id for m in got if m.event == "metrics"}) == 2:
                return

    await asyncio.wait_for(first_of_both(), 10)
    m = next(m for m in got if m.event == "metrics" and m.node_id == "n2")
    assert m.allocation_id == alloc_id and m.samples[0].node_id == "n2"
    assert m.node_ids == ["n2"] and m.state == "Running"
    updated = await stub.update(
        v1.UpdateAllocationRequest(
            id=alloc_id, telemetry_mode="debug", telemetry_duration_seconds=60
        )
    )
    assert updated.id == alloc_id
    assert all(a.loop.mode(alloc_id) == "debug" for a in agents)
    until = agents[0].loop.modes.until(alloc_id)
    assert until == pytest.approx(time.time() + 60, abs=2)
    with pytest.raises(grpclib.GRPCError) as e:
        await stub.update(v1.UpdateAllocationRequest(id=alloc_id, walltime="96h"))
    assert e.value.status.name == "UNIMPLEMENTED"
    with pytest.raises(grpclib.GRPCError) as e:
        await stub.update(v1.UpdateAllocationRequest(id=world.bob_running, telemetry_mode="x"))
    assert e.value.status.name == "INVALID_ARGUMENT"


async def test_refusals(served, pair) -> None:  # type: ignore[no-untyped-def]
    _, world, rest, _ = served
    alloc_id, _ = pair
    bob = bearer("bob")
    # another user's allocation does not exist for eve
    for method, path, body in (
        ("GET", STREAM, None),
        ("PATCH", PATCH, {"telemetry_mode": "debug"}),
    ):
        status, res = await rest.call(method, path.format(alloc_id), bearer("eve"), body)
        assert status == 404 and "not found" in res["error"]["message"]
    # who may switch: not an operator (who may read it), not read-only
    status, res = await rest.call(
        "PATCH", PATCH.format(alloc_id), bearer("olga", Role.OPERATOR), {"telemetry_mode": "debug"}
    )
    assert status == 403 and "belongs to bob" in res["error"]["message"]
    status, _ = await rest.call(
        "PATCH", PATCH.format(alloc_id), bearer("rita", Role.READ_ONLY), {"telemetry_mode": "debug"}
    )
    assert status == 403
    # a tenant admin of its tenant and a system admin may; the spec's body form
    claims = {"sub": "tina", "exp": int(time.time()) + 600, "tenant": "physics"}
    tina = {
        "authorization": "Bearer "
        + jwt.encode({**claims, **ROLE_CLAIMS[Role.TENANT_ADMIN]}, SECRET, algorithm="HS256")
    }
    status, res = await rest.call(
        "PATCH", PATCH.format(alloc_id), tina, {"telemetry": {"mode": "debug", "duration": "30m"}}
    )
    assert status == 200 and res["duration_seconds"] == 1800.0
    status, res = await rest.call(
        "PATCH",
        PATCH.format(alloc_id),
        bearer("root", Role.SYSTEM_ADMIN),
        {"telemetry_mode": "prod"},
    )
    assert status == 200 and res["until"] is None
    # bad bodies
    for body, code, text in (
        ({}, 400, "changes nothing"),
        ({"telemetry_mode": "loud"}, 400, "unknown telemetry mode"),
        ({"telemetry_mode": "debug", "duration": "soon"}, 400, "invalid duration"),
        ({"telemetry_mode": "debug", "duration": "40d"}, 400, "longer than 31 days"),
        ({"walltime": "96h"}, 501, "not implemented"),
    ):
        status, res = await rest.call("PATCH", PATCH.format(alloc_id), bob, body)
        assert (status, text in res["error"]["message"]) == (code, True), (body, res)
    # states
    alice = bearer("alice")
    status, res = await rest.call("GET", STREAM.format(world.alice_pending), alice)
    assert status == 409 and "Pending" in res["error"]["message"] and res["error"]["hint"]
    status, res = await rest.call("GET", STREAM.format(world.alice_done), alice)
    assert status == 409 and "has ended (Completed)" in res["error"]["message"]
    status, res = await rest.call(
        "PATCH", PATCH.format(world.alice_pending), alice, {"telemetry_mode": "debug"}
    )
    assert status == 409
    status, res = await rest.call("GET", STREAM.format(alloc_id), bob, node="n1")
    assert status == 400 and "not one of" in res["error"]["message"]


async def test_sensitive_allocations_stay_in_audit_mode(served, pair) -> None:  # type: ignore[no-untyped-def]
    api, _world, rest, _ = served
    api.add_vcluster("secure", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)
    spec = AllocationSpec(
        entrypoint="python analyse.py",
        tenant="physics",
        vcluster="secure",
        user="bob",
        walltime_seconds=3600,
    )
    api.add_node("s1")
    a = api.submit(spec)
    api.start(a.id, ["s1"])
    status, res = await rest.call(
        "PATCH", PATCH.format(a.id), bearer("bob"), {"telemetry_mode": "debug"}
    )
    assert status == 409 and "stays in audit mode" in res["error"]["message"]
    # audit passes the check (s1 has no agent here: no node takes it)
    status, res = await rest.call(
        "PATCH", PATCH.format(a.id), bearer("bob"), {"telemetry_mode": "audit"}
    )
    assert status == 503 and "no node of allocation" in res["error"]["message"]


async def test_stream_limit_is_shared_by_rest_and_grpc(served, pair) -> None:  # type: ignore[no-untyped-def]
    api, _world, rest, channel = served
    alloc_id, _ = pair
    api.ops.limiter.concurrency.open[("bob", "stream_metrics")] = 5
    try:
        status, res = await rest.call("GET", STREAM.format(alloc_id), bearer("bob"))
        assert status == 429 and res["error"]["message"] == concurrent_message(5)
        stub = v1.AllocationServiceStub(channel, timeout=10, metadata=bearer("bob"))
        with pytest.raises(grpclib.GRPCError) as e:
            async for _ in stub.stream_metrics(v1.StreamMetricsRequest(allocation_id=alloc_id)):
                pass
        assert e.value.status.name == "RESOURCE_EXHAUSTED"
        assert json.loads(e.value.message or "{}")["message"] == concurrent_message(5)
    finally:
        del api.ops.limiter.concurrency.open[("bob", "stream_metrics")]
    # an open stream holds a slot until it closes
    async with LatticeClient.from_url(api.rest_url, token=token("bob")) as c:
        stream = c.stream_metrics(alloc_id)
        await collect(stream, lambda got: len(got) >= 1)
        assert api.ops.limiter.concurrency.count(("bob", "stream_metrics")) == 1
        await stream.aclose()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 3.0  # a closed connection is noticed within a second
    while api.ops.limiter.concurrency.count(("bob", "stream_metrics")) and (
        time.monotonic() < deadline
    ):
        await asyncio.sleep(0.1)
    assert api.ops.limiter.concurrency.count(("bob", "stream_metrics")) == 0


async def test_sdk_refusal_is_typed(served, pair) -> None:  # type: ignore[no-untyped-def]
    api, world, _, _ = served
    async with LatticeClient.from_url(api.rest_url, token=token("alice")) as c:
        with pytest.raises(SdkError) as e:
            async for _ in c.stream_metrics(world.alice_pending):
                pass
        assert e.value.status_code == 409
        with pytest.raises(SdkError) as e:
            await c.set_telemetry_mode(world.bob_running, "debug")
        assert e.value.status_code == 404
