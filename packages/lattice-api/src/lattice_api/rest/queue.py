"""REST route of the queue view: ``GET /api/v1/vclusters/{name}/queue[?all=1]`` (see
lattice_api.ops.queue)."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, query_flag, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    queue = ops.queue

    async def get_queue(request: web.Request) -> web.Response:
        name, everyone = request.match_info["name"], query_flag(request.query, "all")
        return json_response(queue.queue(who(request), name, all_users=everyone))

    router.add_get("/api/v1/vclusters/{name}/queue", get_queue)
