"""Routes that need no identity: ``/healthz`` and ``/metrics`` (Prometheus). They are
PUBLIC in the table, like ``/api/v1/auth/discovery`` (lattice_api.rest.auth)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lattice_api.http import json_response
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    admin = ops.admin

    async def healthz(request: web.Request) -> web.Response:
        return json_response(admin.health())

    async def metrics(request: web.Request) -> web.Response:
        admin.refresh_gauges()
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    router.add_get("/healthz", healthz)
    router.add_get("/metrics", metrics)
