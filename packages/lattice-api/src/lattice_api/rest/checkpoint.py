"""REST route of checkpoint-now (lattice_api.ops.checkpoint):
``POST /api/v1/allocations/{id}/checkpoint``; answers with the allocation, its
``checkpoint_hint`` the one just recorded."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, who
from lattice_api.operations import Operations
from lattice_api.ops import checkpoint as ops_checkpoint


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    allocs = ops.allocations

    async def checkpoint(request: web.Request) -> web.Response:
        return json_response(
            await ops_checkpoint.checkpoint(allocs, who(request), request.match_info["id"])
        )

    router.add_post("/api/v1/allocations/{id}/checkpoint", checkpoint)
