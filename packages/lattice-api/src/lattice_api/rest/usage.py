"""REST routes of the usage RPCs: ``GET /api/v1/tenants/{name}/usage?days=N`` and
``GET /api/v1/usage?user=U&tenant=T&days=N`` (see lattice_api.ops.usage)."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    usage = ops.usage

    async def get_tenant_usage(request: web.Request) -> web.Response:
        tenant, days = request.match_info["name"], request.query.get("days")
        return json_response(await usage.read_tenant_usage(who(request), tenant, days))

    async def get_user_usage(request: web.Request) -> web.Response:
        q = request.query
        return json_response(
            await usage.read_user_usage(
                who(request), q.get("user") or None, q.get("days"), tenant=q.get("tenant") or None
            )
        )

    router.add_get("/api/v1/tenants/{name}/usage", get_tenant_usage)
    router.add_get("/api/v1/usage", get_user_usage)
