"""A fake Waldur that speaks real HTTP, for tests of the accounting push and quota feedback.

Why this module exists: Lattice pushes accounting events to Waldur and Waldur pushes
quota changes back (spec: Accounting via Waldur). :class:`FakeWaldur` is a real aiohttp
server on ``127.0.0.1`` with the endpoints the chapter names, checking
``Authorization: Token <token>`` like Waldur:

- ``POST /api/marketplace-orders/`` -> 201 ``{"uuid", "backend_id", ...}``; an order whose
  ``backend_id`` was already recorded answers 409 and is not recorded again (Waldur
  bills each happening once);
- ``POST /api/invoices/{id}/items/`` -> 201, same ``backend_id`` rule per invoice;
- ``GET /api/customers/{id}/quotas/`` -> 200 ``[{"name", "limit", "usage"}, ...]`` as set
  by :meth:`FakeWaldur.set_quotas` (404 for an unknown customer).

Tests read :attr:`orders` and :attr:`invoice_items` (what was recorded, in order of
arrival), :attr:`requests` (every request, rejected ones included) and make it
misbehave: :meth:`slow` (delay every answer), :meth:`erroring` (answer 5xx, or any
status, the next N requests or until cleared), :meth:`down` (stop listening: connection
refused) and :meth:`up` (listen again on the same port). :meth:`update_tenant` plays
Waldur's side of the quota feedback loop: ``PUT /api/v1/tenants/{id}`` on a Lattice API
with a service token::

    async with FakeWaldur(token="w-token") as waldur:
        client = WaldurClient(waldur.url + "/api/", SecretStr("w-token"))
        ...
        waldur.down()
        ...
        await waldur.up()
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ["FakeWaldur"]


class FakeWaldur:
    """In-memory Waldur on ``127.0.0.1:<free port>``."""

    def __init__(self, token: str = "fake-waldur-token") -> None:
        self.token = token
        self.orders: list[dict[str, Any]] = []
        self.invoice_items: dict[str, list[dict[str, Any]]] = {}
        self.duplicates = 0  # requests whose backend_id was already recorded
        self.requests: list[tuple[str, str]] = []
        self.quotas: dict[str, list[dict[str, Any]]] = {}
        self.delay = 0.0
        self._error_status = 0
        self._error_left: int | None = None
        self._runner: web.AppRunner | None = None
        self._port = 0
        self._url = ""

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (the API is under ``/api/``)."""
        if not self._url:
            raise RuntimeError("FakeWaldur is not started")
        return self._url

    @property
    def api_url(self) -> str:
        return self.url + "/api/"

    @property
    def listening(self) -> bool:
        return self._runner is not None

    async def start(self) -> str:
        if self._runner is not None:
            return self._url
        app = web.Application(middlewares=[self._middleware])
        app.router.add_post("/api/marketplace-orders/", self._order)
        app.router.add_post("/api/invoices/{id}/items/", self._invoice_item)
        app.router.add_get("/api/customers/{id}/quotas/", self._quotas)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self._port, reuse_address=True)
        await site.start()
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self._port = port
        self._url = f"http://{host}:{port}"
        return self._url

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def down(self) -> None:
        """Stop listening (clients get connection refused); records stay."""
        await self.stop()

    async def up(self) -> None:
        """Listen again on the same port."""
        await self.start()

    async def __aenter__(self) -> FakeWaldur:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- test controls -------------------------------------------------------------------

    def slow(self, seconds: float) -> None:
        """Delay every answer by ``seconds`` (0 = normal again)."""
        self.delay = seconds

    def erroring(self, status: int = 503, count: int | None = None) -> None:
        """Answer ``status`` to the next ``count`` requests (None: until ``erroring(0)``)."""
        self._error_status = status
        self._error_left = count

    def set_quotas(self, customer: str, quotas: dict[str, tuple[float, float]]) -> None:
        """``{name: (limit, usage)}``, e.g. ``{"gpu_hours": (1000, 900)}``."""
        self.quotas[customer] = [
            {"name": n, "limit": limit, "usage": usage} for n, (limit, usage) in quotas.items()
        ]

    @property
    def backend_ids(self) -> list[str]:
        """The recorded orders' ``backend_id`` (the events' ids), in arrival order."""
        return [o["backend_id"] for o in self.orders]

    # -- Waldur -> Lattice -----------------------------------------------------------------

    async def update_tenant(
        self, lattice_url: str, tenant: str, quotas: dict[str, Any], service_token: str
    ) -> tuple[int, Any]:
        """``PUT /api/v1/tenants/{tenant}`` on a Lattice API with the service token;
        ``(status, JSON body)``."""
        async with (
            aiohttp.ClientSession() as s,
            s.put(
                f"{lattice_url.rstrip('/')}/api/v1/tenants/{tenant}",
                json=quotas,
                headers={"Authorization": f"Bearer {service_token}"},
            ) as r,
        ):
            text = await r.text()
            try:
                body = json.loads(text)
            except ValueError:
                body = text
            return r.status, body

    # -- HTTP ----------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        if self.delay:
            await asyncio.sleep(self.delay)
        if request.headers.get("Authorization", "") != f"Token {self.token}":
            return _error(401, "Invalid token.")
        if self._error_status and (self._error_left is None or self._error_left > 0):
            if self._error_left is not None:
                self._error_left -= 1
            return _error(self._error_status, "injected failure")
        return await handler(request)

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = json.loads(await request.text())
        except ValueError:
            return _error(400, "body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        if not isinstance(body.get("backend_id"), str) or not body["backend_id"]:
            return _error(400, "backend_id is required")
        return body

    async def _order(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        missing = {"type", "customer", "project", "offering"} - body.keys()
        if missing:
            return _error(400, f"missing fields: {', '.join(sorted(missing))}")
        if body["type"] not in ("Create", "Update", "Terminate"):
            return _error(400, f"unknown order type {body['type']!r}")
        if any(o["backend_id"] == body["backend_id"] for o in self.orders):
            self.duplicates += 1
            return _error(409, "order with this backend_id exists")
        order = {**body, "uuid": uuid.uuid4().hex}
        self.orders.append(order)
        return web.json_response(order, status=201)

    async def _invoice_item(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("quantity"), int | float) or body["quantity"] < 0:
            return _error(400, "quantity must be a non-negative number")
        items = self.invoice_items.setdefault(request.match_info["id"], [])
        if any(i["backend_id"] == body["backend_id"] for i in items):
            self.duplicates += 1
            return _error(409, "item with this backend_id exists")
        item = {**body, "uuid": uuid.uuid4().hex}
        items.append(item)
        return web.json_response(item, status=201)

    async def _quotas(self, request: web.Request) -> web.Response:
        customer = request.match_info["id"]
        if customer not in self.quotas:
            return _error(404, "Not found.")
        return web.json_response(self.quotas[customer])


def _error(status: int, detail: str) -> web.Response:
    return web.json_response({"detail": detail}, status=status)
