"""REST routes of GetDiagnostics (``lattice diag``):
``GET /api/v1/allocations/{id}/diagnostics?section=network|storage`` and the
specification's ``.../diagnostics/network`` and ``.../diagnostics/storage``.

No ``section`` (or ``all``): network, storage and GPUs. The answer is
:meth:`lattice_api.ops.diag.DiagOps.diagnose`'s record; the rate limit (30 a minute per
user) is the gRPC RPC's, shared by all three routes."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, who
from lattice_api.operations import Operations
from lattice_api.ops.diag import DiagOps


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    # QueryMetrics' TSDB settings and audit log, the agents' channels of the server
    diag = DiagOps(ops.metrics, ops.launches.agents)

    async def diagnostics(request: web.Request) -> web.Response:
        section = request.match_info.get("section") or request.query.get("section") or None
        answer = await diag.diagnose(who(request), request.match_info["id"], section)
        return json_response(answer)

    router.add_get("/api/v1/allocations/{id}/diagnostics", diagnostics)
    router.add_get("/api/v1/allocations/{id}/diagnostics/{section:network|storage}", diagnostics)
