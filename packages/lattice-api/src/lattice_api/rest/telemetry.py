"""REST routes of live telemetry (:mod:`lattice_api.ops.telemetry`):

* ``GET /api/v1/allocations/{id}/metrics/stream?metrics=&node=&alerts_only=&interval=``
  (``lattice watch``): NDJSON, one record per line (StreamMetrics); ``metrics`` catalog
  names, comma-separated or repeated (also as ``metric``); ``node`` one node only;
  ``alerts_only`` (1/true) alerts and nodes dropping out only; ``interval`` seconds
  between metric records at most. Counted against the caller's StreamMetrics limit
  (5 open streams) and its token re-checked while it streams.
* ``PATCH /api/v1/allocations/{id}`` (``lattice telemetry``) with
  ``{"telemetry_mode": "debug", "duration": "30m"}`` or the specification's
  ``{"telemetry": {"mode": "debug", "duration": "30m"}}``: the mode on every node of the
  allocation; answers ``{allocation_id, telemetry_mode, duration_seconds, until,
  nodes}``. Other fields of an update (walltime, tags, preemption class) are not
  implemented yet (501).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from lattice_common.aiter import watched

from lattice_api.http import json_response, query_flag, read_body, stream_ndjson, who
from lattice_api.operations import Operations


def _while_connected(
    request: web.Request, records: AsyncIterator[Any], check: float = 1.0
) -> AsyncIterator[Any]:
    """``records`` until the client goes away: a quiet stream (prod mode: a record per
    30 s window) notices within ``check`` seconds, not at its next write, and so frees the
    caller's StreamMetrics slot and the agents' streams at once."""

    def left() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    return watched(records, check, left)


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    async def stream_metrics(request: web.Request) -> web.StreamResponse:
        q = request.query
        names = [
            n.strip()
            for item in (*q.getall("metrics", []), *q.getall("metric", []))
            for n in item.split(",")
            if n.strip()
        ]
        raw = q.get("interval", "").strip()
        try:
            interval = float(raw) if raw else 0.0
        except ValueError:
            interval = math.nan
        records = ops.telemetry.open_stream(  # refusals before the stream starts
            who(request),
            request.match_info["id"],
            metrics=names,
            node_id=q.get("node") or q.get("node_id") or "",
            alerts_only=query_flag(q, "alerts_only"),
            interval=interval,
        )
        return await stream_ndjson(request, "metrics", _while_connected(request, records))

    async def update_allocation(request: web.Request) -> web.Response:
        body = await read_body(request)
        return json_response(
            await ops.telemetry.update(who(request), request.match_info["id"], body)
        )

    router.add_get("/api/v1/allocations/{id}/metrics/stream", stream_metrics)
    router.add_patch("/api/v1/allocations/{id}", update_allocation)
