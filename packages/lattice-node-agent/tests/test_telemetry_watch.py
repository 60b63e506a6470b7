"""``lattice watch`` on the agent: the telemetry loop's hub and NodeAgentService's
StreamMetrics / SetTelemetryMode.

First on a simulated clock (the loop ticked by hand, the stream read message by
message): the latest collection first, then one snapshot per window of means in prod
mode, a switch to debug shown at once with 1 s raw snapshots and its auto-revert, alerts
as they fire and resolve, ``end`` when the allocation leaves. Then over real gRPC on
loopback: a real sleeping process measured by the /proc collector raises a low-CPU alert
within its ``for`` window, the mode switch reaches an open stream, unknown allocations
and modes are refused, and the stream ends when the process exits."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, cast

import grpclib
import pytest
from grpclib.client import Channel
from grpclib.server import Server
from lattice_agent.service import NodeAgentService
from lattice_agent.telemetry import ProcCollector, TelemetryLoop
from lattice_agent.telemetry.alerts import AlertRule
from lattice_agent.telemetry.samples import AllocLabels, Target
from lattice_agent.telemetry.watch import metrics_stream
from lattice_common.proto.lattice import v1

pytestmark = pytest.mark.timeout(60)

IDLE = AlertRule("cpu_idle", "cpu_utilization", "<", 10.0, 2.0, message="CPU idle")


class Fake:
    name = "fake"

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def collect(self, targets: Sequence[Target]) -> dict[str, dict[str, float]]:
        return {t.alloc_id: dict(self.values) for t in targets}

    def forget(self, alloc_id: str) -> None:
        pass


async def next_msg(stream: AsyncIterator[v1.MetricsSnapshot]) -> v1.MetricsSnapshot:
    return await asyncio.wait_for(anext(stream), 5)


def values(m: v1.MetricsSnapshot) -> dict[str, float]:
    return {s.name: s.value for s in m.samples}


async def test_stream_on_a_simulated_clock() -> None:
    now = [1000.0]
    src = Fake({"cpu_utilization": 50.0, "memory_used": 1e6})
    targets = [Target(AllocLabels("a", "n1"))]
    loop = TelemetryLoop(
        lambda: list(targets), [src], window_seconds=2, clock=lambda: now[0], alert_rules=[IDLE]
    )

    async def tick(to: float) -> None:
        now[0] = to
        await loop.tick()

    await tick(1000.0)
    stream = metrics_stream(
        loop, "n1", v1.StreamMetricsRequest(allocation_id="a"), clock=lambda: now[0]
    )
    first = await next_msg(stream)  # the latest collection, at once
    assert (first.event, first.node_id, first.telemetry_mode) == ("metrics", "n1", "prod")
    assert first.timestamp == 1000.0 and first.resolution_seconds == 2.0
    assert values(first) == {"cpu_utilization": 50.0, "memory_used": 1e6}
    assert {s.labels["agg"] for s in first.samples} == {"raw"}
    assert {s.unit for s in first.samples} == {"percent", "bytes"}
    src.values["cpu_utilization"] = 70.0
    await tick(1001.0)
    await tick(1003.0)  # [1000, 1002) closes one second after its end
    window = await next_msg(stream)
    assert (window.event, window.timestamp, window.resolution_seconds) == ("metrics", 1002.0, 2.0)
    assert values(window)["cpu_utilization"] == pytest.approx(60.0)  # the window's mean
    assert {s.labels["agg"] for s in window.samples} == {"mean"}

    # debug for 3 s: shown at the next collection, then one raw snapshot per collection
    loop.set_mode("a", "debug", 3)
    await tick(1004.0)
    mode = await next_msg(stream)
    assert (mode.event, mode.telemetry_mode, mode.resolution_seconds) == ("mode", "debug", 1.0)
    assert mode.mode_until == 1006.0 and not mode.samples
    raw = await next_msg(stream)
    assert (raw.event, raw.timestamp, raw.resolution_seconds) == ("metrics", 1004.0, 1.0)
    assert {s.labels["agg"] for s in raw.samples} == {"raw"}
    await tick(1005.0)  # [1002, 1004) closes: not sent in debug mode
    assert (await next_msg(stream)).timestamp == 1005.0
    await tick(1006.0)  # the debug period is over: prod again, windows again
    back = await next_msg(stream)
    assert (back.event, back.telemetry_mode, back.resolution_seconds) == ("mode", "prod", 2.0)
    assert back.mode_until == 0
    await tick(1007.0)
    after = await next_msg(stream)
    assert (after.event, after.timestamp, {s.labels["agg"] for s in after.samples}) == (
        "metrics",
        1006.0,
        {"mean"},
    )

    # an idle CPU for 2 s fires; busy again resolves
    src.values["cpu_utilization"] = 1.0
    for t in (1008.0, 1009.0, 1010.0):
        await tick(t)
    msgs = [await next_msg(stream) for _ in range(2)]  # a window, then the alert
    alert = next(m for m in msgs if m.event == "alert")
    (ev,) = alert.alert_events
    assert (ev.rule, ev.state, ev.metric, ev.node_id) == (
        "cpu_idle",
        "firing",
        "cpu_utilization",
        "n1",
    )
    assert (ev.since, ev.timestamp, ev.value, ev.threshold, ev.for_seconds) == (
        1008.0,
        1010.0,
        1.0,
        10.0,
        2.0,
    )
    assert list(alert.alerts) == ["CPU idle"]
    assert [a.rule for a in loop.hub.active("a")] == ["cpu_idle"]
    src.values["cpu_utilization"] = 90.0
    await tick(1011.0)
    while (m := await next_msg(stream)).event != "alert":
        pass
    assert [(e.state, e.value) for e in m.alert_events] == [("resolved", 90.0)]
    assert list(m.alerts) == []

    targets.clear()  # the allocation leaves the node
    await tick(1012.0)
    while (m := await next_msg(stream)).event != "end":
        pass
    with pytest.raises(StopAsyncIteration):
        await next_msg(stream)
    assert loop.hub.watchers("a") == 0 and loop.mode("a") == "prod"


async def test_alerts_only_and_a_late_watcher_sees_what_is_firing() -> None:
    now = [2000.0]
    src = Fake({"cpu_utilization": 0.0})
    loop = TelemetryLoop(
        lambda: [Target(AllocLabels("a", "n1"))],
        [src],
        window_seconds=1,
        clock=lambda: now[0],
        alert_rules=[IDLE],
    )
    for t in range(4):  # fires at 2002
        now[0] = 2000.0 + t
        await loop.tick()
    req = v1.StreamMetricsRequest(allocation_id="a", alerts_only=True)
    stream = metrics_stream(loop, "n1", req, clock=lambda: now[0])
    first = await next_msg(stream)
    assert first.event == "alert" and [e.timestamp for e in first.alert_events] == [2002.0]
    src.values["cpu_utilization"] = 50.0
    now[0] = 2004.0
    await loop.tick()  # a window closes too: not sent with alerts_only
    m = await next_msg(stream)
    assert m.event == "alert" and m.alert_events[0].state == "resolved"
    assert not m.samples


async def test_metric_filter_and_interval() -> None:
    now = [3000.0]
    loop = TelemetryLoop(
        lambda: [Target(AllocLabels("a", "n1"))],
        [Fake({"cpu_utilization": 5.0, "memory_used": 2.0, "io_read_bytes": 3.0})],
        window_seconds=60,
        clock=lambda: now[0],
        alert_rules=[],
    )
    loop.set_mode("a", "debug", 100)
    await loop.tick()
    req = v1.StreamMetricsRequest(
        allocation_id="a", metrics=["cpu_utilization,memory_used"], interval_seconds=3
    )
    stream = metrics_stream(loop, "n1", req, clock=lambda: now[0])
    assert set(values(await next_msg(stream))) == {"cpu_utilization", "memory_used"}
    got = []
    for t in range(1, 8):
        now[0] = 3000.0 + t
        await loop.tick()
    while len(got) < 2:
        got.append((await next_msg(stream)).timestamp)
    assert got == [3003.0, 3006.0]  # at most one every 3 s


async def test_not_here_is_not_found() -> None:
    loop = TelemetryLoop(lambda: [], [], alert_rules=[])
    with pytest.raises(Exception, match="not running on node n1"):
        await anext(metrics_stream(loop, "n1", v1.StreamMetricsRequest(allocation_id="zz")))
    # assigned here but not running yet: the stream waits for it (and ends if it never
    # comes, once the desired state drops it)
    assigned = {"soon": object()}
    stream = metrics_stream(
        loop,
        "n1",
        v1.StreamMetricsRequest(allocation_id="soon"),
        assigned=assigned.get,
        idle_check=0.1,
    )
    first = await next_msg(stream)
    assert first.event == "metrics" and not first.samples
    assigned.clear()
    assert (await next_msg(stream)).event == "end"


# --- over gRPC, with a real process ---------------------------------------------------


class ServedAgent:
    def __init__(self, loop: TelemetryLoop | None, assigned: dict[str, Any], tmp: Path) -> None:
        service = NodeAgentService(
            "n1", cast(Any, None), tmp, telemetry=loop, allocation=assigned.get
        )
        self.server = Server([service])
        self.channel: Channel | None = None

    async def __aenter__(self) -> v1.NodeAgentServiceStub:
        await self.server.start("127.0.0.1", 0)
        port = self.server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.channel = Channel("127.0.0.1", port)
        return v1.NodeAgentServiceStub(self.channel, timeout=30)

    async def __aexit__(self, *exc: object) -> None:
        if self.channel is not None:
            self.channel.close()
        self.server.close()
        await self.server.wait_closed()


async def refused(call: Any) -> tuple[str, dict[str, Any]]:
    with pytest.raises(grpclib.GRPCError) as e:
        await call
    return e.value.status.name, json.loads(e.value.message or "{}")


async def test_rpcs_on_loopback_with_a_sleeping_process(tmp_path: Path) -> None:
    aid = f"w-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    target = Target(AllocLabels(aid, "n1", "physics", "alice", "hpc"), (proc.pid,))
    rule = AlertRule("cpu_idle", "cpu_utilization", "<", 10.0, 1.0, message="sleeping")
    loop = TelemetryLoop(
        lambda: [target] if proc.poll() is None else [],
        [ProcCollector()],
        window_seconds=1.0,
        interval=0.25,
        alert_rules=[rule],
    )
    task = asyncio.create_task(loop.run())
    try:
        async with ServedAgent(loop, {aid: object()}, tmp_path) as stub:
            started = time.monotonic()
            alerts = stub.stream_metrics(
                v1.StreamMetricsRequest(allocation_id=aid, alerts_only=True)
            )
            alert = await asyncio.wait_for(anext(alerts), 10)
            took = time.monotonic() - started
            print(f"low-CPU alert after {took:.2f} s")
            assert alert.event == "alert" and alert.alert_events[0].rule == "cpu_idle"
            assert alert.alert_events[0].value < 10 and took < 1.0 + 3.0

            watch = stub.stream_metrics(v1.StreamMetricsRequest(allocation_id=aid))
            first = await asyncio.wait_for(anext(watch), 5)
            assert first.event == "metrics" and "cpu_utilization" in values(first)
            assert [a.rule for a in first.alert_events] == ["cpu_idle"]  # firing already
            assert list(first.alerts) == ["sleeping"]

            st, err = await refused(
                stub.set_telemetry_mode(v1.SetTelemetryModeRequest(allocation_id=aid, mode="loud"))
            )
            assert st == "INVALID_ARGUMENT" and "unknown telemetry mode" in err["message"]
            st, err = await refused(
                stub.set_telemetry_mode(
                    v1.SetTelemetryModeRequest(allocation_id="nope", mode="debug")
                )
            )
            assert st == "NOT_FOUND" and "not running on node n1" in err["message"]
            st, _ = await refused(
                anext(stub.stream_metrics(v1.StreamMetricsRequest(allocation_id="nope")))
            )
            assert st == "NOT_FOUND"

            ack = await stub.set_telemetry_mode(
                v1.SetTelemetryModeRequest(allocation_id=aid, mode="debug", duration_seconds=1.5)
            )
            assert (ack.node_id, ack.mode, ack.default_mode) == ("n1", "debug", "prod")
            assert ack.until == pytest.approx(time.time() + 1.5, abs=1.0)
            seen: list[v1.MetricsSnapshot] = []
            while not (seen and seen[-1].event == "mode" and seen[-1].telemetry_mode == "prod"):
                seen.append(await asyncio.wait_for(anext(watch), 5))
            events = [(m.event, m.telemetry_mode) for m in seen]
            i = events.index(("mode", "debug"))
            raw = [m for m in seen[i:] if m.event == "metrics"]
            assert len(raw) >= 3 and all(m.resolution_seconds == 1.0 for m in raw)
            assert {s.labels["agg"] for m in raw for s in m.samples} == {"raw"}
            assert seen[-1].mode_until == 0  # reverted: no end time

            proc.kill()  # the allocation ends: its streams end
            proc.wait()
            rest = [m async for m in watch]
            assert rest and rest[-1].event == "end"
            tail = [m async for m in alerts]
            assert tail[-1].event == "end"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_agent_without_telemetry_says_so(tmp_path: Path) -> None:
    async with ServedAgent(None, {}, tmp_path) as stub:
        st, _ = await refused(
            anext(stub.stream_metrics(v1.StreamMetricsRequest(allocation_id="a")))
        )
        assert st == "UNIMPLEMENTED"
