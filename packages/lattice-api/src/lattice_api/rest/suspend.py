"""REST routes of suspend and resume (lattice_api.ops.suspend):
``POST /api/v1/allocations/{id}/suspend`` and ``POST /api/v1/allocations/{id}/resume``;
both answer with the allocation after the change."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, who
from lattice_api.operations import Operations
from lattice_api.ops import suspend as ops_suspend


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    allocs = ops.allocations

    async def suspend(request: web.Request) -> web.Response:
        return json_response(
            await ops_suspend.suspend(allocs, who(request), request.match_info["id"])
        )

    async def resume(request: web.Request) -> web.Response:
        return json_response(
            await ops_suspend.resume(allocs, who(request), request.match_info["id"])
        )

    router.add_post("/api/v1/allocations/{id}/suspend", suspend)
    router.add_post("/api/v1/allocations/{id}/resume", resume)
