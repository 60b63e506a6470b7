"""Liveness probes against real local servers: an aiohttp HTTP server whose health
endpoint starts failing, a TCP port that closes; threshold counting, the initial delay,
timeouts, and the ProbeManager's choice of what to probe."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from lattice_agent.probes import (
    PROBE_FAILURES,
    ProbeManager,
    ProbeRunner,
    probe_http,
    probe_tcp,
)
from lattice_cli.devcluster import free_port as _free_port
from lattice_common.types import AllocationState, LivenessProbeSpec
from lattice_test_harness.builders import allocation

pytestmark = pytest.mark.timeout(30)


class Health:
    """An HTTP server: /healthz answers ``status`` (after ``delay`` seconds)."""

    def __init__(self) -> None:
        self.status = 200
        self.delay = 0.0
        self.hits = 0
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(status=self.status, text="ok" if self.status < 400 else "bad")


async def moved(request: web.Request) -> web.Response:
    return web.Response(status=302, headers={"Location": "/"})


@pytest.fixture
async def health() -> AsyncIterator[Health]:
    h = Health()
    app = web.Application()
    app.router.add_get("/healthz", h.handle)
    app.router.add_get("/moved", moved)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    h.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield h
    finally:
        await runner.cleanup()


def _probe(kind: str, port: int, **kw: int | str) -> LivenessProbeSpec:
    return LivenessProbeSpec(probe_type=kind, port=port, path="/healthz", **kw)  # type: ignore[arg-type]


async def test_http_probe_status_classes(health: Health) -> None:
    assert await probe_http("127.0.0.1", health.port, "/healthz", 2)
    assert await probe_http("127.0.0.1", health.port, "/moved", 2)  # 3xx is alive
    health.status = 500
    assert not await probe_http("127.0.0.1", health.port, "/healthz", 2)
    assert not await probe_http("127.0.0.1", health.port, "/nope", 2)  # 404
    assert not await probe_http("127.0.0.1", _free_port(), "/healthz", 2)  # refused


async def test_http_probe_timeout(health: Health) -> None:
    health.delay = 1.0
    t0 = time.monotonic()
    assert not await probe_http("127.0.0.1", health.port, "/healthz", 0.2)
    assert time.monotonic() - t0 < 0.8


async def test_tcp_probe_open_then_closed() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    assert await probe_tcp("127.0.0.1", port, 1)
    server.close()
    await server.wait_closed()
    assert not await probe_tcp("127.0.0.1", port, 1)


async def test_threshold_counts_consecutive_failures_only(health: Health) -> None:
    failed: list[str] = []
    r = ProbeRunner(
        "svc1",
        _probe("http", health.port, failure_threshold=3),
        on_failed=failed.append,
        period=0.05,
        initial_delay=0,
        timeout=1,
    )
    task = asyncio.create_task(r.run())
    before = PROBE_FAILURES.labels("svc1")._value.get()
    # alternate: two failures, one success, two failures -> never three in a row
    for status in (500, 500, 200, 500, 500, 200):
        health.status = status
        seen = health.hits
        while health.hits == seen:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
    assert not failed and not task.done()
    health.status = 503
    await asyncio.wait_for(task, 5)
    assert failed == ["svc1"] and r.failed and r.failures == 3
    assert PROBE_FAILURES.labels("svc1")._value.get() - before >= 7


async def test_initial_delay_is_waited(health: Health) -> None:
    health.status = 500
    failed: list[str] = []
    r = ProbeRunner(
        "svc2",
        _probe("http", health.port, failure_threshold=1),
        on_failed=failed.append,
        period=0.05,
        initial_delay=0.5,
    )
    t0 = time.monotonic()
    await asyncio.wait_for(r.run(), 5)
    assert time.monotonic() - t0 >= 0.5 and failed == ["svc2"] and r.probes == 1


async def test_timeouts_count_as_failures(health: Health) -> None:
    health.delay = 2.0
    failed: list[str] = []
    r = ProbeRunner(
        "svc3",
        _probe("http", health.port, failure_threshold=2),
        on_failed=failed.append,
        period=0.01,
        initial_delay=0,
        timeout=0.1,
    )
    t0 = time.monotonic()
    await asyncio.wait_for(r.run(), 5)
    assert failed == ["svc3"] and time.monotonic() - t0 < 1.5


async def test_tcp_runner_fails_when_the_port_closes() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    failed: list[str] = []
    r = ProbeRunner(
        "svc4",
        _probe("tcp", port, failure_threshold=2),
        on_failed=failed.append,
        period=0.05,
        initial_delay=0,
    )
    task = asyncio.create_task(r.run())
    await asyncio.sleep(0.3)
    assert not failed and r.probes >= 3 and r.failures == 0
    server.close()
    await server.wait_closed()
    await asyncio.wait_for(task, 5)
    assert failed == ["svc4"]


async def test_manager_probes_running_services_it_heads() -> None:
    probe = _probe("tcp", 1234)
    svc = allocation(id="s1", state=AllocationState.RUNNING, liveness_probe=probe)
    svc.assigned_nodes = ["n0", "n1"]
    other_head = allocation(id="s2", state=AllocationState.RUNNING, liveness_probe=probe)
    other_head.assigned_nodes = ["n1", "n0"]
    plain = allocation(id="s3", state=AllocationState.RUNNING)
    plain.assigned_nodes = ["n0"]
    m = ProbeManager("n0", on_failed=lambda aid: None)
    assigned = {a.id: a for a in (svc, other_head, plain)}
    assert set(m.wanted(assigned, {"s1", "s2", "s3"})) == {"s1"}
    assert m.wanted(assigned, set()) == {}  # not running (yet or any more)
    m.sync(assigned, {"s1", "s2", "s3"})
    assert set(m.runners) == {"s1"}
    task = m.runners["s1"][1]
    m.sync(assigned, set())  # it exited: its runner stops
    assert m.runners == {}
    await asyncio.sleep(0)
    assert task.cancelled() or task.done()
    m.sync(assigned, {"s1"})
    await m.close()
    assert m.runners == {}
