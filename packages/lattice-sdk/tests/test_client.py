"""Protocol tests of LatticeClient against a small in-process aiohttp server.

The server implements a few endpoints of the REST contract exactly as documented (paths,
JSON shapes, the error envelope, NDJSON streams) and records what it receives, so these
tests check the client's side of the wire: headers, bodies, query strings, error mapping
and stream parsing. Every test runs with both transports (aiohttp and the standard-library
one the CLI uses).
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
from aiohttp import web
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


def alloc_json(alloc_id: str = "a1b2c3d4", state: str = "Pending", **extra: Any) -> dict:
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


def error(status: int, code: str, message: str, details=None, hint: str = "") -> web.Response:
    body = {"error": {"code": code, "message": message, "details": details or {}, "hint": hint}}
    return web.json_response(body, status=status)


class FakeApi:
    """Records requests; answers like lattice-server does."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.app = web.Application()
        r = self.app.router
        r.add_get("/healthz", self.healthz)
        r.add_post("/api/v1/allocations", self.submit)
        r.add_get("/api/v1/allocations", self.list_allocations)
        r.add_get("/api/v1/allocations/{id}", self.get_allocation)
        r.add_delete("/api/v1/allocations/{id}", self.cancel)
        r.add_get("/api/v1/allocations/{id}/watch", self.watch)
        r.add_get("/api/v1/allocations/{id}/logs", self.logs)
        r.add_get("/api/v1/allocations/{id}/logs/stream", self.stream_logs)
        r.add_get("/api/v1/nodes", self.list_nodes)
        r.add_post("/api/v1/nodes/{id}/{action}", self.node_action)
        r.add_post("/api/v1/tenants", self.create_tenant)
        r.add_patch("/api/v1/tenants/{name}", self.update_tenant)
        r.add_get("/api/v1/vclusters", self.list_vclusters)
        r.add_get("/api/v1/raft/status", self.raft_status)
        r.add_get("/api/v1/proxy-error", self.proxy_error)

    async def record(self, request: web.Request) -> dict[str, Any]:
        body = await request.read()
        entry = {
            "method": request.method,
            "path": request.path,
            "query": dict(request.query),
            "headers": dict(request.headers),
            "json": json.loads(body) if body else None,
        }
        self.requests.append(entry)
        return entry

    async def healthz(self, request: web.Request) -> web.Response:
        await self.record(request)
        return web.json_response({"status": "ok", "member_id": 1})

    async def submit(self, request: web.Request) -> web.Response:
        entry = await self.record(request)
        if request.headers.get("Authorization") == "Bearer bad":
            return error(401, "unauthenticated", "invalid token")
        spec = entry["json"]
        if spec.get("nodes", 1) > 200:
            return error(
                400,
                "invalid_argument",
                'allocation rejected — tenant "physics" exceeds max_nodes quota',
                {"current": "195 nodes in use", "limit": "200 nodes"},
                "Cancel running allocations or request a quota increase.",
            )
        data = alloc_json("new00001")
        data["spec"].update(spec)
        return web.json_response(data, status=201)

    async def list_allocations(self, request: web.Request) -> web.Response:
        await self.record(request)
        return web.json_response(
            {"allocations": [alloc_json("a1"), alloc_json("a2", state="Running")]}
        )

    async def get_allocation(self, request: web.Request) -> web.Response:
        await self.record(request)
        alloc_id = request.match_info["id"]
        if request.headers.get("Authorization") == "Bearer bad":
            return error(401, "unauthenticated", "invalid token")
        if alloc_id == "forbidden":
            return error(403, "permission_denied", "not your allocation")
        if alloc_id == "busy":
            return error(503, "not_leader", "no leader", hint="Retry in a moment.")
        if alloc_id != "a1b2c3d4":
            return error(
                404,
                "not_found",
                f"allocation {alloc_id} not found",
                {"allocation": alloc_id},
                "List your allocations with `lattice status`.",
            )
        return web.json_response(alloc_json())

    async def cancel(self, request: web.Request) -> web.Response:
        await self.record(request)
        alloc_id = request.match_info["id"]
        if alloc_id == "done":
            return error(409, "invalid_transition", "allocation done is already Completed")
        return web.json_response(alloc_json(alloc_id, state="Cancelled"))

    async def watch(self, request: web.Request) -> web.StreamResponse:
        await self.record(request)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        events = [
            {"revision": 7, "allocation": alloc_json(state="Pending")},
            {"revision": 9, "allocation": alloc_json(state="Running", started_at=1.0)},
            {"revision": 12, "allocation": alloc_json(state="Completed", exit_code=0)},
        ]
        payload = b"".join(json.dumps(e).encode() + b"\n" for e in events)
        # Deliberately split mid-line and across writes to exercise buffering.
        for i in range(0, len(payload), 97):
            await resp.write(payload[i : i + 97])
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    async def logs(self, request: web.Request) -> web.Response:
        await self.record(request)
        lines = [
            {
                "allocation_id": "a1b2c3d4",
                "node_id": "n1",
                "stream": "stdout",
                "line": "Epoch 1/100, loss=2.341",
                "timestamp": 1772704812.0,
            },
            {
                "allocation_id": "a1b2c3d4",
                "node_id": "n1",
                "stream": "stderr",
                "line": "warning: slow\n",
                "timestamp": 1772704813.5,
            },
        ]
        return web.json_response({"lines": lines})

    async def stream_logs(self, request: web.Request) -> web.StreamResponse:
        await self.record(request)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for i in range(3):
            line = {
                "allocation_id": "a1b2c3d4",
                "node_id": f"n{i}",
                "stream": "stdout",
                "line": f"line {i}",
                "timestamp": 1.0 + i,
            }
            await resp.write(json.dumps(line).encode() + b"\n")
        await resp.write(b"\n")  # blank lines are skipped
        await resp.write_eof()
        return resp

    async def list_nodes(self, request: web.Request) -> web.Response:
        await self.record(request)
        node = {
            "id": "x1000c0s0b0n0",
            "state": "Ready",
            "capabilities": {"gpu_type": "GH200", "gpu_count": 4, "cpu_cores": 72},
            "group": 3,
            "new_field": 1,
        }
        return web.json_response({"nodes": [node]})

    async def node_action(self, request: web.Request) -> web.Response:
        entry = await self.record(request)
        states = {"drain": "Draining", "undrain": "Ready", "disable": "Ready", "enable": "Ready"}
        node = {
            "id": request.match_info["id"],
            "state": states[request.match_info["action"]],
            "state_reason": entry["json"].get("reason", ""),
        }
        return web.json_response(node)

    async def create_tenant(self, request: web.Request) -> web.Response:
        entry = await self.record(request)
        return web.json_response({"isolation": "standard", **entry["json"]}, status=201)

    async def update_tenant(self, request: web.Request) -> web.Response:
        entry = await self.record(request)
        return web.json_response({"name": request.match_info["name"], **entry["json"]})

    async def list_vclusters(self, request: web.Request) -> web.Response:
        await self.record(request)
        vc = {"name": "hpc-batch", "scheduler_type": "hpc-backfill", "weights": {"priority": 0.2}}
        return web.json_response({"vclusters": [vc]})

    async def raft_status(self, request: web.Request) -> web.Response:
        await self.record(request)
        return web.json_response(
            {
                "member_id": 1,
                "leader_id": 1,
                "leader_address": "127.0.0.1:9000",
                "term": 3,
                "commit_index": 42,
                "members": [{"id": 1, "address": "127.0.0.1:9000", "state": "leader"}],
            }
        )

    async def proxy_error(self, request: web.Request) -> web.Response:
        return web.Response(status=502, text="<html>Bad Gateway</html>", content_type="text/html")


@pytest.fixture
async def api():
    fake = FakeApi()
    runner = web.AppRunner(fake.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield fake
    await runner.cleanup()


@pytest.fixture(params=["aiohttp", "asyncio"])
def transport(request) -> str:
    return request.param


@pytest.fixture
def client_for(api, transport):
    def make(**kwargs: Any) -> _Client:
        return _Client("127.0.0.1", api.port, transport=transport, **kwargs)

    return make


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- headers, bodies


async def test_headers_token_user_and_tenant(api, client_for, monkeypatch):
    monkeypatch.setenv("USER", "alice")
    async with client_for(token="tok123", headers={"x-lattice-tenant": "physics"}) as client:
        await client.status("a1b2c3d4")
    headers = api.requests[-1]["headers"]
    assert headers["Authorization"] == "Bearer tok123"
    assert headers["x-lattice-user"] == "alice"
    assert headers["x-lattice-tenant"] == "physics"


async def test_no_authorization_header_without_token(api, client_for, monkeypatch):
    monkeypatch.setenv("USER", "bob")
    async with client_for() as client:
        await client.health()
    headers = api.requests[-1]["headers"]
    assert "Authorization" not in headers
    assert headers["x-lattice-user"] == "bob"
    assert "x-lattice-tenant" not in headers


async def test_submit_sends_spec_and_keeps_request_id(api, client_for):
    spec = AllocationSpec(
        entrypoint="torchrun train.py",
        nodes=64,
        walltime="72h",
        tenant="ml-team",
        constraints={"gpu_type": "GH200", "gpu_count": 4, "features": []},
        env={"OMP_NUM_THREADS": "8"},
    )
    async with client_for() as client:
        alloc = await client.submit(spec)
        first_id = spec.request_id
        await client.submit(spec)  # a retry reuses the idempotency key
    assert isinstance(alloc, Allocation)
    assert alloc.id == "new00001"
    assert len(first_id) == 32 and int(first_id, 16) >= 0
    bodies = [r["json"] for r in api.requests if r["method"] == "POST"]
    assert bodies[0]["request_id"] == bodies[1]["request_id"] == first_id
    body = bodies[0]
    assert body["walltime"] == "72h"
    assert body["nodes"] == 64
    assert body["constraints"] == {"gpu_type": "GH200", "gpu_count": 4}
    assert body["env"] == {"OMP_NUM_THREADS": "8"}
    assert "requeue_policy" not in body and "vcluster" not in body  # server defaults
    assert api.requests[0]["headers"]["Content-Type"].startswith("application/json")


async def test_list_allocations_query(api, client_for):
    async with client_for() as client:
        allocs = await client.list_allocations(state="running", vcluster="gpu", all=True, limit=5)
    assert [a.id for a in allocs] == ["a1", "a2"]
    assert allocs[1].state == "Running"
    assert api.requests[-1]["query"] == {
        "state": "running",
        "vcluster": "gpu",
        "all": "true",
        "limit": "5",
    }


async def test_status_builds_models_ignoring_unknown_keys(api, client_for):
    async with client_for() as client:
        alloc = await client.status("a1b2c3d4")
    assert alloc.state == "Pending"
    assert alloc.name == "train"
    assert alloc.spec.walltime_seconds == 86400
    assert alloc.spec.constraints == {"gpu_type": "GH200"}
    assert alloc.raw["unknown_top_level"] is True
    assert alloc.spec.raw["future_field"] == {"x": 1}
    assert not alloc.terminal


async def test_ids_are_quoted_in_paths(api, client_for):
    async with client_for() as client:
        with pytest.raises(LatticeNotFoundError):
            await client.status("a/b c")
    assert api.requests[-1]["path"] == "/api/v1/allocations/a/b c"  # decoded by the server
    assert len(api.requests) == 1


# --------------------------------------------------------------------------- errors


async def test_404_maps_to_not_found_with_details_and_hint(client_for):
    async with client_for() as client:
        with pytest.raises(LatticeNotFoundError) as info:
            await client.status("nope")
    err = info.value
    assert err.status_code == 404
    assert err.code == "not_found"
    assert err.message == "allocation nope not found"
    assert err.details == {"allocation": "nope"}
    assert err.hint == "List your allocations with `lattice status`."
    assert err.render().splitlines() == [
        "Error: allocation nope not found",
        "  Allocation: nope",
        "Hint: List your allocations with `lattice status`.",
    ]


@pytest.mark.parametrize(
    ("alloc_id", "token", "cls", "status"),
    [
        ("a1b2c3d4", "bad", LatticeAuthError, 401),
        ("forbidden", None, LatticeAuthError, 403),
        ("busy", None, LatticeUnavailableError, 503),
    ],
)
async def test_status_codes_map_to_classes(client_for, alloc_id, token, cls, status):
    async with client_for(token=token) as client:
        with pytest.raises(cls) as info:
            await client.status(alloc_id)
    assert info.value.status_code == status
    assert isinstance(info.value, LatticeError)


async def test_validation_and_conflict(client_for):
    async with client_for() as client:
        with pytest.raises(LatticeValidationError) as info:
            await client.submit(AllocationSpec(entrypoint="x", nodes=500))
        with pytest.raises(LatticeConflictError):
            await client.cancel("done")
    assert info.value.details == {"current": "195 nodes in use", "limit": "200 nodes"}
    assert "quota" in info.value.hint


async def test_non_json_error_body(client_for):
    async with client_for() as client:
        with pytest.raises(LatticeUnavailableError) as info:
            await client._call("GET", "/proxy-error")
    assert info.value.status_code == 502
    assert "502" in info.value.message and "Bad Gateway" in info.value.message


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
    async with client_for() as client:
        events = [e async for e in client.watch("a1b2c3d4")]
    assert [e.state for e in events] == ["Pending", "Running", "Completed"]
    assert [e.revision for e in events] == [7, 9, 12]
    assert events[-1].allocation.exit_code == 0
    assert events[-1].allocation.terminal
    assert api.requests[-1]["path"] == "/api/v1/allocations/a1b2c3d4/watch"


async def test_watch_can_stop_early(client_for):
    async with client_for() as client:
        async for event in client.watch("a1b2c3d4"):
            if event.state == "Running":
                break
        # the client still works after abandoning a stream
        assert (await client.health())["status"] == "ok"


async def test_logs_and_stream_logs(api, client_for):
    async with client_for() as client:
        lines = await client.logs("a1b2c3d4", tail=100, stream="stderr")
        streamed = [line async for line in client.stream_logs("a1b2c3d4", tail=5)]
    assert api.requests[0]["query"] == {"tail": "100", "stream": "stderr"}
    assert api.requests[1]["query"] == {"tail": "5"}
    assert isinstance(lines[0], LogLine)
    assert lines[0].message == "Epoch 1/100, loss=2.341"
    assert lines[1].message == "warning: slow" and lines[1].stream == "stderr"
    assert lines[0].timestamp == 1772704812.0
    assert [(x.message, x.node_id) for x in streamed] == [
        ("line 0", "n0"),
        ("line 1", "n1"),
        ("line 2", "n2"),
    ]


async def test_stream_error_status_raises_before_iterating(transport):
    app = web.Application()

    async def gone(request):
        return error(404, "not_found", "allocation x not found", hint="Check the ID.")

    app.router.add_get("/api/v1/allocations/{id}/watch", gone)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with _Client("127.0.0.1", port, transport=transport) as client:
            with pytest.raises(LatticeNotFoundError) as info:
                async for _ in client.watch("x"):
                    pass
        assert info.value.hint == "Check the ID."
    finally:
        await runner.cleanup()


# --------------------------------------------------------------------------- admin


async def test_nodes_tenants_vclusters_raft(api, client_for):
    async with client_for() as client:
        nodes = await client.list_nodes(state="ready")
        drained = await client.drain_node("x1000c0s0b0n0", reason="maintenance")
        tenant = await client.create_tenant("physics", max_nodes=200, fair_share_target=0.3)
        updated = await client.update_tenant("physics", max_nodes=250)
        vclusters = await client.list_vclusters()
        raft = await client.raft_status()
    assert nodes[0].capabilities.gpu_count == 4 and nodes[0].group == 3
    assert nodes[0].raw["new_field"] == 1
    assert drained.state == "Draining" and drained.state_reason == "maintenance"
    assert tenant.max_nodes == 200 and tenant.isolation == "standard"
    assert updated.max_nodes == 250
    assert vclusters[0].weights == {"priority": 0.2}
    assert raft["leader_id"] == 1
    posts = [(r["path"], r["json"]) for r in api.requests if r["method"] in ("POST", "PATCH")]
    assert posts == [
        ("/api/v1/nodes/x1000c0s0b0n0/drain", {"reason": "maintenance"}),
        ("/api/v1/tenants", {"name": "physics", "max_nodes": 200, "fair_share_target": 0.3}),
        ("/api/v1/tenants/physics", {"max_nodes": 250}),
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
