"""A fake Slingshot fabric manager that speaks real HTTP, for tests.

Why this module exists: the API server gets CXI credentials for each MPI launch from the
fabric manager's REST API (spec: CXI Credential Management) and no real fabric manager
runs here. :class:`FakeFabricManager` is a real aiohttp server on ``127.0.0.1`` and a free
port, so :class:`lattice_api.fabric.FabricManager` is tested over real sockets, with the
same routes, bearer-token auth and JSON checks:

- ``POST /fabric/cxi/services`` ``{"allocation_id", "launch_id", "nodes", "vni"}`` ->
  201 ``{"id", "vni", "svc_id"}`` (``"vni": null`` takes the lowest free VNI of
  ``vni_range``);
- ``GET /fabric/cxi/services/{id}/auth`` -> 200 ``{"auth_key": <64 hex digits>}``;
- ``DELETE /fabric/cxi/services/{id}`` -> 204 (404 when unknown).

Errors: 401 without or with a wrong token, 400 on bad bodies, 404 on unknown services,
409 when no VNI is free, each as ``{"error": "..."}``. Tests inspect ``services`` (live
records), ``revoked`` (ids, in order) and ``requests`` (``(method, path)`` of every
request, rejected ones included), and inject failures with ``fail_next(method, status)``::

    async with FakeFabricManager(token="t") as fake:
        fm = FabricManager(fake.url, "t")
        creds = await fm.provision("a1", "l1", ["n1", "n2"])
        assert fake.services[creds.service_id]["auth_key"] == creds.auth_key
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections import deque
from typing import Any

from aiohttp import web

__all__ = ["FakeFabricManager"]

SERVICES_PATH = "/fabric/cxi/services"


class FakeFabricManager:
    """In-memory fabric manager CXI API on ``127.0.0.1:<free port>``."""

    def __init__(
        self, token: str = "fake-fabric-token", *, vni_range: tuple[int, int] = (1000, 4095)
    ) -> None:
        if vni_range[0] > vni_range[1]:
            raise ValueError(f"empty vni_range {vni_range}")
        self.token = token
        self.vni_range = vni_range
        self.services: dict[str, dict[str, Any]] = {}
        self.revoked: list[str] = []
        self.requests: list[tuple[str, str]] = []
        self._failures: deque[tuple[str, int]] = deque()
        self._next_svc_id = 2  # CXI service 1 is the NIC's default service
        self._runner: web.AppRunner | None = None
        self._url = ""

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL (``http://127.0.0.1:<port>``); set by :meth:`start`."""
        if not self._url:
            raise RuntimeError("FakeFabricManager is not started")
        return self._url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def start(self) -> str:
        """Listen on a free loopback port; return the base URL."""
        if self._runner is not None:
            return self._url
        app = web.Application(middlewares=[self._middleware])
        app.router.add_post(SERVICES_PATH, self._create)
        app.router.add_get(SERVICES_PATH + "/{id}/auth", self._auth)
        app.router.add_delete(SERVICES_PATH + "/{id}", self._delete)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self._url = f"http://{host}:{port}"
        return self._url

    async def stop(self) -> None:
        """Stop listening (records stay for inspection)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> FakeFabricManager:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- test controls -------------------------------------------------------------------

    def fail_next(self, method: str, status: int) -> None:
        """The next request with ``method`` (after auth) answers ``status`` and does nothing.

        Calls queue up: two ``fail_next("GET", 500)`` fail the next two GETs.
        """
        self._failures.append((method.upper(), status))

    # -- HTTP ----------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        if request.headers.get("Authorization", "") != f"Bearer {self.token}":
            return _error(401, "missing or invalid bearer token")
        for i, (method, status) in enumerate(self._failures):
            if method == request.method:
                del self._failures[i]
                return _error(status, f"injected failure {status}")
        return await handler(request)

    async def _create(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.text())
        except ValueError:
            return _error(400, "body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        missing = {"allocation_id", "launch_id", "nodes", "vni"} - body.keys()
        if missing:
            return _error(400, f"missing fields: {', '.join(sorted(missing))}")
        unknown = body.keys() - {"allocation_id", "launch_id", "nodes", "vni"}
        if unknown:
            return _error(400, f"unknown fields: {', '.join(sorted(unknown))}")
        for field in ("allocation_id", "launch_id"):
            if not isinstance(body[field], str) or not body[field]:
                return _error(400, f"{field} must be a non-empty string")
        nodes = body["nodes"]
        if (
            not isinstance(nodes, list)
            or not nodes
            or not all(isinstance(n, str) and n for n in nodes)
        ):
            return _error(400, "nodes must be a non-empty list of node names")
        vni = body["vni"]
        if vni is None:
            vni = self._free_vni()
            if vni is None:
                return _error(409, f"no free VNI in {self.vni_range[0]}-{self.vni_range[1]}")
        elif not isinstance(vni, int) or isinstance(vni, bool) or not 1 <= vni <= 65535:
            return _error(400, "vni must be null or an integer 1-65535")
        service_id = f"cxi-{uuid.uuid4().hex[:16]}"
        svc_id = self._next_svc_id
        self._next_svc_id += 1
        self.services[service_id] = {
            "allocation_id": body["allocation_id"],
            "launch_id": body["launch_id"],
            "nodes": list(nodes),
            "vni": vni,
            "svc_id": svc_id,
            "auth_key": secrets.token_hex(32),
        }
        return web.json_response({"id": service_id, "vni": vni, "svc_id": svc_id}, status=201)

    async def _auth(self, request: web.Request) -> web.Response:
        record = self.services.get(request.match_info["id"])
        if record is None:
            return _error(404, f"no CXI service {request.match_info['id']}")
        return web.json_response({"auth_key": record["auth_key"]})

    async def _delete(self, request: web.Request) -> web.Response:
        service_id = request.match_info["id"]
        if self.services.pop(service_id, None) is None:
            return _error(404, f"no CXI service {service_id}")
        self.revoked.append(service_id)
        return web.Response(status=204)

    def _free_vni(self) -> int | None:
        used = {s["vni"] for s in self.services.values()}
        for vni in range(self.vni_range[0], self.vni_range[1] + 1):
            if vni not in used:
                return vni
        return None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
