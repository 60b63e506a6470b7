"""REST route of CompareMetrics (``lattice compare``):
``GET /api/v1/compare?ids=A,B&metrics=&duration=&step=&align=relative``.

``ids`` the allocations, comma-separated or repeated (also ``id``), the first the
baseline; ``metrics`` catalog names, comma-separated or repeated (also ``metric``;
default gpu_utilization, cpu_utilization, memory_used); ``duration`` the offsets shown
(``1h``, seconds; default the longest run); ``step`` the spacing of the points (at least
the agents' 30 s windows; default automatic); ``align`` only ``relative``. The answer is
:meth:`lattice_api.ops.compare.CompareOps.compare`'s record; the rate limit (10 a minute
per user) is the gRPC RPC's."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    async def compare(request: web.Request) -> web.Response:
        q = request.query
        answer = await ops.compare.compare(
            who(request),
            [*q.getall("ids", []), *q.getall("id", [])],
            metrics=[*q.getall("metrics", []), *q.getall("metric", [])],
            duration=q.get("duration") or None,
            step=q.get("step") or None,
            align=q.get("align") or None,
        )
        return json_response(answer)

    router.add_get("/api/v1/compare", compare)
