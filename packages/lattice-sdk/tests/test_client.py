"""Protocol tests of LatticeClient against the real REST server over a LocalQuorum.

The server is lattice-server's own aiohttp app (lattice_test_harness.local_api), seeded
by proposing real commands; a recording middleware keeps what it receives, so these
tests check the client's side of the wire (headers, bodies, query strings) and its
mapping of real answers (records, the error envelope, NDJSON streams). Two transport
edge cases a real server does not produce (an HTML error from a proxy, NDJSON lines
split across writes) use a one-route stub. Every test runs with both transports
(aiohttp and the standard-library one the CLI uses).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest
from aiohttp import web
from lattice_common import types as t
from lattice_common.types import AllocationState
from lattice_sdk import (
    Allocation,
    AllocationSpec,
    LatticeAuthError,
    LatticeConflictError,
    LatticeError,
    LatticeNotFoundError,
    LatticeUnavailableError,
    LatticeValidationError,
    LogLine,
)
from lattice_sdk import LatticeClient as _Client
from lattice_test_harness.local_api import LocalApi, serve_local_api

SECRET = "sdk-test-secret-that-is-long-enough-for-hs256!"
AGENT_TOKEN = "sdk-agent-token-0123456789"
NODE = "x1000c0s0b0n0"


def alloc_json(alloc_id: str = "a1b2c3d4", state: str = "Pending", **extra: Any) -> dict:
    """A record as a newer server might send it, with keys this SDK does not know."""
    data = {
        "id": alloc_id,
        "spec": {
            "entrypoint": "python train.py",
            "tenant": "physics",
            "vcluster": "gpu-batch",
            "nodes": 4,
            "walltime_seconds": 86400,
            "name": "train",
            "constraints": {"gpu_type": "GH200"},
            "future_field": {"x": 1},
        },
        "state": state,
        "assigned_nodes": [],
        "submitted_at": 1772704800.0,
        "started_at": None,
        "finished_at": None,
        "exit_code": None,
        "reason": "",
        "requeue_count": 0,
        "preempted_count": 0,
        "revision": 7,
        "unknown_top_level": True,
    }
    data.update(extra)
    return data


def spec(user: str = "alice", **kw: Any) -> t.AllocationSpec:
    base: dict[str, Any] = {
        "entrypoint": "python train.py",
        "tenant": "physics",
        "vcluster": "gpu-batch",
        "user": user,
        "nodes": 1,
        "name": "train",
        "walltime_seconds": 86400,
        "constraints": t.Constraints(gpu_type="GH200"),
    }
    return t.AllocationSpec(**{**base, **kw})


def seed(api: LocalApi) -> dict[str, str]:
    """physics/gpu-batch, one GH200 node, alice's pending job, a running one, a finished
    one; returns their ids."""
    api.add_tenant("physics", max_nodes=200)
    api.add_tenant("ml-team")
    api.add_vcluster("gpu-batch", weights=t.CostWeights(priority=0.2))
    api.add_node(NODE, capabilities={"gpu_type": "GH200", "gpu_count": 4, "cpu_cores": 72}, group=3)
    api.add_node("n2")
    now = time.time()
    ids = {"pending": api.submit(spec(), now=now - 30).id}
    ids["running"] = api.submit(spec(), now=now - 20).id
    api.start(ids["running"], ["n2"], now=now - 10)
    ids["done"] = api.submit(spec(), now=now - 5).id
    api.start(ids["done"], [NODE], now=now - 4)
    api.set_state(ids["done"], AllocationState.COMPLETED, exit_code=0, now=now - 2)
    return ids


@pytest.fixture
async def api():
    async with serve_local_api() as server:
        server.ids = seed(server)  # type: ignore[attr-defined]
        yield server


@pytest.fixture
async def secure_api():
    async with serve_local_api(hmac_secret=SECRET, agent_token=AGENT_TOKEN) as server:
        server.ids = seed(server)  # type: ignore[attr-defined]
        yield server


@pytest.fixture(params=["aiohttp", "asyncio"])
def transport(request) -> str:
    return request.param


@pytest.fixture
def client_for(api, transport):
    def make(**kwargs: Any) -> _Client:
        kwargs.setdefault("headers", {})
        return _Client("127.0.0.1", api.rest_port, transport=transport, **kwargs)

    return make


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stub_server(handler: Any, path: str) -> tuple[web.AppRunner, int]:
    """One route answering what a proxy or a slow network would, not lattice-server."""
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


# --------------------------------------------------------------------------- headers, bodies


async def test_headers_token_user_and_tenant(api, client_for, monkeypatch):
    monkeypatch.setenv("USER", "alice")
    async with client_for(token="tok123", headers={"x-lattice-tenant": "physics"}) as client:
        await client.status(api.ids["pending"])
    headers = api.requests[-1]["headers"]
    assert headers["Authorization"] == "Bearer tok123"
    assert headers["x-lattice-user"] == "alice"
    assert headers["x-lattice-tenant"] == "physics"


async def test_token_provider_is_called_per_request(api, client_for):
    tokens = iter(["first", "second", "third"])
    async with client_for(token=lambda: next(tokens)) as client:
        await client.status(api.ids["pending"])
        await client.list_allocations()
        assert client.token is None and callable(client.token_provider)
    assert [r["headers"]["Authorization"] for r in api.requests[-2:]] == [
        "Bearer first",
        "Bearer second",
    ]


async def test_async_token_provider_and_whoami(secure_api, transport):
    import jwt

    calls = 0

    async def provider() -> str:
        nonlocal calls
        calls += 1
        return jwt.encode({"sub": "alice", "exp": time.time() + 60}, SECRET, algorithm="HS256")

    async with _Client(
        "127.0.0.1", secure_api.rest_port, transport=transport, token=provider
    ) as client:
        me = await client.whoami()
        async for _ in client.watch(secure_api.ids["done"]):
            pass
    assert (me["user"], me["role"], me["method"]) == ("alice", "user", "hmac")
    assert calls == 2
    async with _Client("127.0.0.1", secure_api.rest_port, transport=transport) as client:
        doc = await client.auth_discovery()  # public
    assert doc["mode"] == "hmac" and doc["client_id"] == "lattice"


async def test_no_authorization_header_without_token(api, client_for, monkeypatch):
    monkeypatch.setenv("USER", "bob")
    async with client_for() as client:
        await client.health()
    headers = api.requests[-1]["headers"]
    assert "Authorization" not in headers
    assert headers["x-lattice-user"] == "bob"
    assert "x-lattice-tenant" not in headers


async def test_submit_sends_spec_and_keeps_request_id(api, client_for, monkeypatch):
    monkeypatch.setenv("USER", "alice")
    spec = AllocationSpec(
        entrypoint="torchrun train.py",
        nodes=64,
        walltime="72h",
        tenant="ml-team",
        vcluster="gpu-batch",
        constraints={"gpu_type": "GH200", "gpu_count": 4, "features": []},
        env={"OMP_NUM_THREADS": "8"},
        wait_for_capacity=True,  # more nodes than the test cluster has: wait for them
    )
    async with client_for() as client:
        alloc = await client.submit(spec)
        first_id = spec.request_id
        again = await client.submit(spec)  # a retry reuses the idempotency key
    assert isinstance(alloc, Allocation)
    assert alloc.id in api.quorum.state.allocations and again.id == alloc.id  # no duplicate
    assert alloc.spec.user == "alice" and alloc.spec.walltime_seconds == 72 * 3600
    assert len(first_id) == 32 and int(first_id, 16) >= 0
    bodies = [r["json"] for r in api.requests if r["method"] == "POST"]
    assert bodies[0]["request_id"] == bodies[1]["request_id"] == first_id
    body = bodies[0]
    assert body["walltime"] == "72h"
    assert body["nodes"] == 64
    assert body["constraints"] == {"gpu_type": "GH200", "gpu_count": 4}
    assert body["env"] == {"OMP_NUM_THREADS": "8"}
    assert body["wait_for_capacity"] is True
    assert "requeue_policy" not in body  # the server's default applies
    assert alloc.spec.raw["requeue_policy"] == "on_node_failure"
    assert api.requests[0]["headers"]["Content-Type"].startswith("application/json")


async def test_unset_fields_are_left_to_the_server(api, client_for):
    async with client_for() as client:
        with pytest.raises(LatticeNotFoundError) as info:
            await client.submit(AllocationSpec(entrypoint="x", walltime="1h", tenant="physics"))
    assert "vcluster" not in api.requests[-1]["json"]  # not sent: the server decides
    assert info.value.message == "no vCluster given"
    assert info.value.details == {"available": "gpu-batch"}


async def test_list_allocations_query(api, client_for):
    async with client_for() as client:
        allocs = await client.list_allocations(
            state="running", vcluster="gpu-batch", all=True, limit=5
        )
    assert [a.id for a in allocs] == [api.ids["running"]]
    assert allocs[0].state == "Running"
    assert api.requests[-1]["query"] == {
        "state": "running",
        "vcluster": "gpu-batch",
        "all": "true",
        "limit": "5",
    }


async def test_status_builds_models(api, client_for):
    async with client_for() as client:
        alloc = await client.status(api.ids["pending"])
    assert alloc.state == "Pending"
    assert alloc.name == "train"
    assert alloc.spec.walltime_seconds == 86400
    assert alloc.spec.constraints["gpu_type"] == "GH200"
    assert not alloc.terminal


def test_models_ignore_unknown_keys_and_keep_them_raw():
    alloc = Allocation.from_dict(alloc_json())
    assert alloc.state == "Pending" and alloc.name == "train"
    assert alloc.spec.constraints == {"gpu_type": "GH200"}
    assert alloc.raw["unknown_top_level"] is True
    assert alloc.spec.raw["future_field"] == {"x": 1}


async def test_ids_are_quoted_in_paths(api, client_for):
    async with client_for() as client:
        with pytest.raises(LatticeNotFoundError):
            await client.status("a/b c")
    assert api.requests[-1]["path"] == "/api/v1/allocations/a/b c"  # decoded by the server
    assert len(api.requests) == 1


# --------------------------------------------------------------------------- errors


async def test_404_maps_to_not_found_with_hint(client_for):
    async with client_for() as client:
        with pytest.raises(LatticeNotFoundError) as info:
            await client.status("nope")
    err = info.value
    assert err.status_code == 404
    assert err.code == "not_found"
    assert err.message == "allocation nope not found"
    assert err.details == {}
    assert err.hint == "List your allocations with `lattice status`."
    assert err.render().splitlines() == [
        "Error: allocation nope not found",
        "Hint: List your allocations with `lattice status`.",
    ]


async def test_error_details_are_rendered(client_for):
    async with client_for() as client:
        with pytest.raises(LatticeValidationError) as info:
            await client.list_allocations(state="bogus")
    err = info.value
    assert err.status_code == 400 and err.code == "invalid_argument"
    assert "Running" in err.details["available"]
    assert err.render().splitlines()[:2] == [
        "Error: unknown state 'bogus'",
        f"  Available: {err.details['available']}",
    ]


@pytest.mark.parametrize(
    ("case", "cls", "status"),
    [
        ("bad-token", LatticeAuthError, 401),
        ("agent-reads-tenants", LatticeAuthError, 403),
        ("not-caught-up", LatticeUnavailableError, 503),
    ],
)
async def test_status_codes_map_to_classes(secure_api, transport, case, cls, status):
    token = {"bad-token": "bad", "agent-reads-tenants": AGENT_TOKEN}.get(case)
    if case == "not-caught-up":
        secure_api.quorum.caught_up = False
        token = AGENT_TOKEN  # allowed to read allocations
    async with _Client(
        "127.0.0.1", secure_api.rest_port, transport=transport, token=token
    ) as client:
        with pytest.raises(cls) as info:
            if case == "agent-reads-tenants":
                await client.list_tenants()
            else:
                await client.status(secure_api.ids["pending"])
    assert info.value.status_code == status
    assert isinstance(info.value, LatticeError)
    assert info.value.hint


async def test_validation_and_conflict(api, client_for):
    async with client_for() as client:
        with pytest.raises(LatticeValidationError) as info:
            await client.submit(
                AllocationSpec(
                    entrypoint="x", preemption_class=11, tenant="physics", vcluster="gpu-batch"
                )
            )
        with pytest.raises(LatticeConflictError):
            await client.cancel(api.ids["done"])
    assert info.value.details == {"preemption_class": 11}
    assert "best-effort" in info.value.hint


async def test_non_json_error_body(transport):
    async def bad_gateway(request):
        return web.Response(status=502, text="<html>Bad Gateway</html>", content_type="text/html")

    runner, port = await stub_server(bad_gateway, "/api/v1/proxy-error")
    try:
        async with _Client("127.0.0.1", port, transport=transport) as client:
            with pytest.raises(LatticeUnavailableError) as info:
                await client._call("GET", "/proxy-error")
        assert info.value.status_code == 502
        assert "502" in info.value.message and "Bad Gateway" in info.value.message
    finally:
        await runner.cleanup()


async def test_connection_refused_names_endpoint(transport):
    port = closed_port()
    async with _Client("127.0.0.1", port, transport=transport, timeout=5) as client:
        with pytest.raises(LatticeUnavailableError) as info:
            await client.list_allocations()
    err = info.value
    assert f"http://127.0.0.1:{port}" in err.message
    assert "connection refused" in err.message
    assert err.status_code is None
    assert "lattice dev up" in err.hint and "LATTICE_ENDPOINT" in err.hint


async def test_timeout_is_unavailable(transport):
    # A server that accepts but never answers.
    async def silent(reader, writer):
        await asyncio.sleep(10)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with _Client("127.0.0.1", port, transport=transport, timeout=0.3) as client:
            with pytest.raises(LatticeUnavailableError) as info:
                await client.health()
        assert "timed out" in info.value.message
    finally:
        server.close()


# --------------------------------------------------------------------------- streams


async def test_watch_parses_ndjson_events(api, client_for):
    aid = api.ids["pending"]

    async def drive() -> None:
        await asyncio.sleep(0.2)
        api.start(aid, [NODE])
        await asyncio.sleep(0.1)
        api.set_state(aid, AllocationState.COMPLETED, exit_code=0)

    driver = asyncio.create_task(drive())
    async with client_for() as client:
        events = [e async for e in client.watch(aid)]
    await driver
    assert [e.state for e in events] == ["Pending", "Running", "Completed"]
    revisions = [e.revision for e in events]
    assert revisions == sorted(revisions) and len(set(revisions)) == 3
    assert events[-1].allocation.exit_code == 0
    assert events[-1].allocation.terminal
    assert api.requests[-1]["path"] == f"/api/v1/allocations/{aid}/watch"


async def test_watch_reassembles_lines_split_across_writes(transport):
    events = [
        {"revision": 7, "allocation": alloc_json(state="Pending")},
        {"revision": 9, "allocation": alloc_json(state="Running", started_at=1.0)},
        {"revision": 12, "allocation": alloc_json(state="Completed", exit_code=0)},
    ]

    async def chunked(request):
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        payload = b"".join(json.dumps(e).encode() + b"\n\n" for e in events)  # blank lines too
        for i in range(0, len(payload), 97):  # split mid-line and across writes
            await resp.write(payload[i : i + 97])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    runner, port = await stub_server(chunked, "/api/v1/allocations/{id}/watch")
    try:
        async with _Client("127.0.0.1", port, transport=transport) as client:
            got = [e async for e in client.watch("a1b2c3d4")]
        assert [e.state for e in got] == ["Pending", "Running", "Completed"]
        assert [e.revision for e in got] == [7, 9, 12]
    finally:
        await runner.cleanup()


async def test_watch_can_stop_early(api, client_for):
    async with client_for() as client:
        async for event in client.watch(api.ids["running"]):
            if event.state == "Running":
                break
        # the client still works after abandoning a stream
        assert (await client.health())["status"] == "ok"


async def test_logs_and_stream_logs(api, client_for):
    aid = api.ids["running"]
    api.logs.add(aid, "Epoch 1/100, loss=2.341", node_id="n1", timestamp=1772704812.0)
    api.logs.add(aid, "warning: slow\n", stream="stderr", node_id="n1", timestamp=1772704813.5)
    for i in range(3):
        api.logs.add(aid, f"line {i}", node_id=f"n{i}", timestamp=1.0 + i)
    async with client_for() as client:
        lines = await client.logs(aid, tail=100, stream="stderr")
        everything = await client.logs(aid)
        streamed = [line async for line in client.stream_logs(aid, tail=3)]
    assert api.requests[0]["query"] == {"tail": "100", "stream": "stderr"}
    assert api.requests[2]["query"] == {"tail": "3"}
    assert isinstance(lines[0], LogLine)
    assert [(x.message, x.stream) for x in lines] == [("warning: slow", "stderr")]
    assert everything[0].message == "Epoch 1/100, loss=2.341"
    assert everything[0].timestamp == 1772704812.0
    assert [(x.message, x.node_id) for x in streamed] == [
        ("line 0", "n0"),
        ("line 1", "n1"),
        ("line 2", "n2"),
    ]


async def test_logs_filters_and_paging_go_to_the_server(api, client_for):
    import datetime as dt

    aid = api.ids["running"]
    for i in range(10):
        api.logs.add(aid, f"line {i}", node_id=f"n{i % 2}", timestamp=1772704800.0 + i)
    async with client_for() as client:
        n1 = await client.logs(aid, node="n1")
        window = await client.logs(
            aid,
            since=dt.datetime(2026, 3, 5, 10, 0, 2),  # naive: UTC
            until="2026-03-05T10:00:05Z",
        )
        page = await client.logs(aid, since=1772704800, offset=2, limit=3)
        last = await client.logs(aid, offset=8, limit=3)
        streamed = [
            line.message
            async for line in client.stream_logs(aid, tail=2, node="n0", until=1772704806.5)
        ]
    queries = [r["query"] for r in api.requests]
    assert queries[:4] == [
        {"stream": "both", "node": "n1"},
        {"stream": "both", "since": "1772704802.0", "until": "2026-03-05T10:00:05Z"},
        {"stream": "both", "since": "1772704800.0", "offset": "2", "limit": "3"},
        {"stream": "both", "offset": "8", "limit": "3"},
    ]
    assert queries[4] == {"tail": "2", "node": "n0", "until": "1772704806.5"}
    assert [x.message for x in n1] == ["line 1", "line 3", "line 5", "line 7", "line 9"]
    assert [x.message for x in window] == ["line 2", "line 3", "line 4", "line 5"]
    assert [x.message for x in page] == ["line 2", "line 3", "line 4"] and page.truncated
    assert [x.message for x in last] == ["line 8", "line 9"] and not last.truncated
    assert not n1.truncated and isinstance(n1, list)
    assert streamed == ["line 4", "line 6"]
    with pytest.raises(TypeError):
        await client.logs(aid, since=True)


async def test_compare_metrics_request_and_refusals(api, client_for):
    ids = api.ids
    async with client_for() as client:
        # this server has no TSDB: the refusal after the allocations were checked
        with pytest.raises(LatticeUnavailableError) as e:
            await client.compare_metrics(
                [ids["done"], ids["running"]], metrics="cpu_utilization", duration="1h", step=60
            )
        assert e.value.message == "metrics are not available: no TSDB configured"
        with pytest.raises(LatticeNotFoundError):
            await client.compare_metrics([ids["done"], "nope"])
        with pytest.raises(LatticeError) as e2:
            await client.compare_metrics([ids["done"], ids["pending"]])
        assert e2.value.code == "failed_precondition"
        assert f"allocation {ids['pending']} has not started (Pending)" in e2.value.message
        with pytest.raises(LatticeValidationError):
            await client.compare_metrics([ids["done"]])
    sent = api.requests[0]
    assert sent["path"] == "/api/v1/compare"
    assert sent["query"] == {
        "ids": f"{ids['done']},{ids['running']}",
        "metrics": "cpu_utilization",
        "duration": "1h",
        "step": "60",
    }


async def test_stream_error_status_raises_before_iterating(client_for):
    async with client_for() as client:
        with pytest.raises(LatticeNotFoundError) as info:
            async for _ in client.watch("x"):
                pass
    assert info.value.hint == "List your allocations with `lattice status`."


# --------------------------------------------------------------------------- admin


async def test_nodes_tenants_vclusters_raft(api, client_for):
    async with client_for() as client:
        nodes = await client.list_nodes(state="ready")
        drained = await client.drain_node(NODE, reason="maintenance")
        tenant = await client.create_tenant("chemistry", max_nodes=200, fair_share_target=0.3)
        updated = await client.update_tenant("chemistry", max_nodes=250)
        vclusters = await client.list_vclusters()
        raft = await client.raft_status()
    gh = next(n for n in nodes if n.id == NODE)
    assert gh.capabilities.gpu_count == 4 and gh.group == 3
    assert drained.state == "Drained" and drained.state_reason == "maintenance"
    assert tenant.max_nodes == 200 and tenant.isolation == "standard"
    assert updated.max_nodes == 250
    assert vclusters[0].weights["priority"] == 0.2
    assert raft["member_id"] == 1 and raft["is_leader"] is True
    posts = [(r["path"], r["json"]) for r in api.requests if r["method"] in ("POST", "PATCH")]
    assert posts == [
        (f"/api/v1/nodes/{NODE}/drain", {"reason": "maintenance"}),
        ("/api/v1/tenants", {"name": "chemistry", "max_nodes": 200, "fair_share_target": 0.3}),
        ("/api/v1/tenants/chemistry", {"max_nodes": 250}),
    ]


def test_from_url_and_endpoint():
    c = _Client.from_url("https://api.example.com")
    assert (c.scheme, c.host, c.port) == ("https", "api.example.com", 443)
    assert _Client.from_url("h:9").endpoint == "http://h:9"
    assert _Client("::1", 8080).endpoint == "http://[::1]:8080"
    with pytest.raises(ValueError):
        _Client("h", 1, scheme="ftp")


def test_import_does_not_load_aiohttp():
    import subprocess
    import sys

    code = "import sys, lattice_sdk; print('aiohttp' in sys.modules, 'asyncio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
