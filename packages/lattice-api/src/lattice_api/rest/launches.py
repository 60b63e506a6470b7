"""REST routes of task launches (see lattice_api.ops.launches):
``POST /api/v1/allocations/{id}/tasks`` starts one, ``GET .../tasks/{task_id}/events``
follows it (NDJSON: start, output, rank_exit, node_done, then done)."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, read_body, stream_ndjson, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    launches = ops.launches

    async def launch_tasks(request: web.Request) -> web.Response:
        body = await read_body(request)
        res = await launches.launch_tasks(who(request), request.match_info["id"], body)
        return json_response(res, status=201)

    async def launch_events(request: web.Request) -> web.StreamResponse:
        events = await launches.watch(
            who(request), request.match_info["id"], request.match_info["task_id"]
        )
        return await stream_ndjson(request, "launch", events)

    router.add_post("/api/v1/allocations/{id}/tasks", launch_tasks)
    router.add_get("/api/v1/allocations/{id}/tasks/{task_id}/events", launch_events)
