"""REST route of QueryMetrics (``lattice top``):
``GET /api/v1/allocations/{id}/metrics?mode=&duration=&metrics=&node=``.

``mode`` summary (default) | per-node | per-gpu; ``duration`` how far back the latest
values are looked for (``5m``, ``1h``, ``300``: seconds; default 5 minutes); ``metrics``
catalog names, comma-separated or repeated (also as ``metric``); ``node`` one node only.
The answer is :meth:`lattice_api.ops.metrics.MetricsOps.query`'s record."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    async def query_metrics(request: web.Request) -> web.Response:
        q = request.query
        names = [*q.getall("metrics", []), *q.getall("metric", [])]
        snapshot = await ops.metrics.query(
            who(request),
            request.match_info["id"],
            mode=q.get("mode") or None,
            duration=q.get("duration") or None,
            metrics=names,
            node_id=q.get("node") or q.get("node_id") or "",
        )
        return json_response(snapshot)

    router.add_get("/api/v1/allocations/{id}/metrics", query_metrics)
