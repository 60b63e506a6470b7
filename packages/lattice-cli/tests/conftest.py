"""Fixtures for CLI tests: an isolated environment and a fake REST API in a thread.

The fake answers the documented REST contract (paths, JSON shapes, error envelope, NDJSON
streams) from an in-memory dict. It runs in its own thread and event loop because the
CLI under test calls ``asyncio.run`` itself. End-to-end runs against a real cluster are
in ``test_e2e.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from aiohttp import web


def _error(status: int, code: str, message: str, details=None, hint: str = "") -> web.Response:
    body = {"error": {"code": code, "message": message, "details": details or {}, "hint": hint}}
    return web.json_response(body, status=status)


class FakeApi:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.allocations: dict[str, dict[str, Any]] = {}
        self.logs: list[dict[str, Any]] = []
        self.nodes: dict[str, dict[str, Any]] = {}
        self.tenants: dict[str, dict[str, Any]] = {}
        self.vclusters: dict[str, dict[str, Any]] = {}
        self.counter = 0
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None

    # --- data -----------------------------------------------------------------------

    def add_allocation(self, alloc_id: str, **overrides: Any) -> dict[str, Any]:
        spec = {
            "entrypoint": "/bin/bash /home/u/train.sh",
            "name": "train.sh",
            "nodes": 4,
            "walltime_seconds": 86400,
            "tenant": "physics",
            "vcluster": "gpu-batch",
            "constraints": {},
        }
        spec.update(overrides.pop("spec", {}))
        alloc = {
            "id": alloc_id,
            "spec": spec,
            "state": "Running",
            "assigned_nodes": ["nid001", "nid002"],
            "submitted_at": time.time() - 100,
            "started_at": time.time() - 60,
            "finished_at": None,
            "exit_code": None,
            "reason": "",
            "requeue_count": 0,
            "preempted_count": 0,
            "revision": 1,
        }
        alloc.update(overrides)
        self.allocations[alloc_id] = alloc
        return alloc

    def last(self, method: str | None = None) -> dict[str, Any]:
        reqs = [r for r in self.requests if method is None or r["method"] == method]
        return reqs[-1]

    # --- server ---------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_post("/api/v1/allocations", self.submit)
        r.add_get("/api/v1/allocations", self.list_allocations)
        r.add_get("/api/v1/allocations/{id}", self.get_allocation)
        r.add_delete("/api/v1/allocations/{id}", self.cancel)
        r.add_get("/api/v1/allocations/{id}/logs", self.get_logs)
        r.add_get("/api/v1/allocations/{id}/logs/stream", self.stream_logs)
        r.add_get("/api/v1/nodes", self.list_nodes)
        r.add_get("/api/v1/nodes/{id}", self.get_node)
        r.add_post("/api/v1/nodes/{id}/{action}", self.node_action)
        r.add_get("/api/v1/tenants", self.list_tenants)
        r.add_post("/api/v1/tenants", self.create_tenant)
        r.add_patch("/api/v1/tenants/{name}", self.update_tenant)
        r.add_get("/api/v1/vclusters", self.list_vclusters)
        r.add_post("/api/v1/vclusters", self.create_vcluster)
        r.add_patch("/api/v1/vclusters/{name}", self.update_vcluster)
        r.add_get("/api/v1/raft/status", self.raft_status)
        return app

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "headers": dict(request.headers),
                "json": json.loads(body) if body else None,
            }
        )
        return await handler(request)

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            runner = web.AppRunner(self.app())
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._runner = runner
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(10)

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- handlers -------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _alloc_or_404(self, alloc_id: str) -> dict[str, Any] | web.Response:
        alloc = self.allocations.get(alloc_id)
        if alloc is None:
            return _error(
                404,
                "not_found",
                f"allocation {alloc_id} not found",
                hint="List your allocations with `lattice status`.",
            )
        return alloc

    async def submit(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not body.get("walltime"):
            return _error(
                400,
                "invalid_argument",
                "walltime is required for a bounded (batch) allocation",
                hint="Pass --walltime, e.g. --walltime=2h or --walltime=01:30:00.",
            )
        self.counter += 1
        alloc_id = f"{self.counter:08x}"
        spec = dict(body)
        spec["walltime_seconds"] = 3600
        alloc = self.add_allocation(alloc_id, spec=spec, state="Pending", started_at=None)
        return web.json_response(alloc, status=201)

    async def list_allocations(self, request: web.Request) -> web.Response:
        state = request.query.get("state")
        allocs = [
            a for a in self.allocations.values() if not state or a["state"].lower() == state.lower()
        ]
        return web.json_response({"allocations": allocs})

    async def get_allocation(self, request: web.Request) -> web.Response:
        found = self._alloc_or_404(request.match_info["id"])
        return found if isinstance(found, web.Response) else web.json_response(found)

    async def cancel(self, request: web.Request) -> web.Response:
        found = self._alloc_or_404(request.match_info["id"])
        if isinstance(found, web.Response):
            return found
        if found["state"] in ("Completed", "Failed", "Cancelled"):
            return _error(
                409,
                "invalid_transition",
                f"allocation {found['id']} is already {found['state']}",
                details={"state": found["state"]},
            )
        found["state"] = "Cancelled"
        return web.json_response(found)

    async def get_logs(self, request: web.Request) -> web.Response:
        found = self._alloc_or_404(request.match_info["id"])
        if isinstance(found, web.Response):
            return found
        stream = request.query.get("stream", "both")
        lines = [x for x in self.logs if stream == "both" or x["stream"] == stream]
        tail = request.query.get("tail")
        if tail:
            lines = lines[-int(tail) :]
        return web.json_response({"lines": lines})

    async def stream_logs(self, request: web.Request) -> web.StreamResponse:
        found = self._alloc_or_404(request.match_info["id"])
        if isinstance(found, web.Response):
            return found
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for line in self.logs:
            await resp.write(json.dumps(line).encode() + b"\n")
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def list_nodes(self, request: web.Request) -> web.Response:
        state = request.query.get("state")
        nodes = [n for n in self.nodes.values() if not state or n["state"].lower() == state]
        return web.json_response({"nodes": nodes})

    async def get_node(self, request: web.Request) -> web.Response:
        node = self.nodes.get(request.match_info["id"])
        if node is None:
            return _error(404, "not_found", f"node {request.match_info['id']} not found")
        return web.json_response(node)

    async def node_action(self, request: web.Request) -> web.Response:
        node = self.nodes.get(request.match_info["id"])
        if node is None:
            return _error(404, "not_found", f"node {request.match_info['id']} not found")
        action = request.match_info["action"]
        body = await request.json()
        node["state"] = {"drain": "Draining", "undrain": "Ready"}.get(action, node["state"])
        node["disabled"] = {"disable": True, "enable": False}.get(action, node.get("disabled"))
        node["state_reason"] = body.get("reason", "")
        return web.json_response(node)

    async def list_tenants(self, request: web.Request) -> web.Response:
        return web.json_response({"tenants": list(self.tenants.values())})

    async def create_tenant(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["name"] in self.tenants:
            return _error(409, "already_exists", f"tenant {body['name']} already exists")
        self.tenants[body["name"]] = {"max_nodes": None, "isolation": "standard", **body}
        return web.json_response(self.tenants[body["name"]], status=201)

    async def update_tenant(self, request: web.Request) -> web.Response:
        tenant = self.tenants.get(request.match_info["name"])
        if tenant is None:
            return _error(404, "not_found", f"tenant {request.match_info['name']} not found")
        tenant.update(await request.json())
        return web.json_response(tenant)

    async def list_vclusters(self, request: web.Request) -> web.Response:
        return web.json_response({"vclusters": list(self.vclusters.values())})

    async def create_vcluster(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.vclusters[body["name"]] = {"weights": {}, "cycle_interval_seconds": 5.0, **body}
        return web.json_response(self.vclusters[body["name"]], status=201)

    async def update_vcluster(self, request: web.Request) -> web.Response:
        vc = self.vclusters.get(request.match_info["name"])
        if vc is None:
            return _error(404, "not_found", f"vCluster {request.match_info['name']} not found")
        body = await request.json()
        vc["weights"].update(body.pop("weights", {}))
        vc.update(body)
        return web.json_response(vc)

    async def raft_status(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "member_id": 1,
                "leader_id": 1,
                "leader_address": "127.0.0.1:9000",
                "term": 2,
                "commit_index": 17,
                "members": [{"id": 1, "address": "127.0.0.1:9000", "state": "leader"}],
            }
        )


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No user config, no LATTICE_* from the developer's shell."""
    import os

    for key in list(os.environ):
        if key.startswith("LATTICE_") or key == "NO_COLOR":
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("USER", "alice")
    return tmp_path


@pytest.fixture
def fake_api(clean_env, monkeypatch):
    api = FakeApi()
    api.start()
    monkeypatch.setenv("LATTICE_ENDPOINT", api.url)
    yield api
    api.stop()
