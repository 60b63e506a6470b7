"""REST routes of service discovery: ``GET /api/v1/services`` (every visible service
with its endpoints; ``?tenant=`` narrows it) and ``GET /api/v1/services/{name}``."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    services = ops.services

    async def list_services(request: web.Request) -> web.Response:
        found = services.list_services(who(request), request.query.get("tenant"))
        return json_response({"names": [s.name for s in found], "services": found})

    async def lookup_service(request: web.Request) -> web.Response:
        svc = services.lookup(who(request), request.match_info["name"], request.query.get("tenant"))
        return json_response(svc)

    router.add_get("/api/v1/services", list_services)
    router.add_get("/api/v1/services/{name}", lookup_service)
