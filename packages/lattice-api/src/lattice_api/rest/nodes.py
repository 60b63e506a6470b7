"""REST routes of NodeService: ``/api/v1/nodes`` (list, ``/{id}``), one route per admin
action (``/{id}/drain|undrain|disable|enable|release``), and the agents' ``/register``,
``/{id}/heartbeat`` and ``/heartbeats`` (many nodes' heartbeats in one call)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web
from lattice_common.errors import ValidationError
from lattice_common.types import AllocationReport, Node

from lattice_api.auth import Identity
from lattice_api.http import json_response, read_body, who
from lattice_api.operations import Operations
from lattice_api.ops.nodes import Beat

Action = Callable[[Identity, str, str], Awaitable[Node]]


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    nodes = ops.nodes

    async def list_nodes(request: web.Request) -> web.Response:
        found = nodes.list(who(request), state=request.query.get("state") or None)
        return json_response({"nodes": found})

    async def get_node(request: web.Request) -> web.Response:
        return json_response(nodes.get(who(request), request.match_info["id"]))

    def action(run: Action) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            body = await read_body(request)
            node = await run(who(request), request.match_info["id"], str(body.get("reason") or ""))
            return json_response(node)

        return handler

    async def register_node(request: web.Request) -> web.Response:
        return json_response(await nodes.register(who(request), await read_body(request)))

    async def heartbeat(request: web.Request) -> web.Response:
        body = await read_body(request)
        try:
            reports = msgspec.convert(body.get("reports") or [], list[AllocationReport])
        except msgspec.ValidationError as e:
            raise ValidationError(f"invalid reports: {e}") from None
        out = await nodes.heartbeat(
            who(request),
            request.match_info["id"],
            int(body.get("sequence") or 0),
            reports,
            str(body.get("conformance_fingerprint") or ""),
        )
        return json_response(out)

    async def heartbeats(request: web.Request) -> web.Response:
        body = await read_body(request)
        try:
            beats = msgspec.convert(body.get("heartbeats") or [], list[Beat])
        except msgspec.ValidationError as e:
            raise ValidationError(
                f"invalid heartbeats: {e}",
                hint='Send {"heartbeats": [{"node_id": ..., "sequence": ..., "reports": '
                "[...]}, ...]}.",
            ) from None
        return json_response({"results": await nodes.heartbeats(who(request), beats)})

    router.add_get("/api/v1/nodes", list_nodes)
    router.add_post("/api/v1/nodes/register", register_node)
    router.add_get("/api/v1/nodes/{id}", get_node)
    router.add_post("/api/v1/nodes/{id}/heartbeat", heartbeat)
    router.add_post("/api/v1/nodes/heartbeats", heartbeats)
    # one route per action, so each maps to one permission (release is not node.admin)
    router.add_post("/api/v1/nodes/{id}/drain", action(nodes.drain))
    router.add_post("/api/v1/nodes/{id}/undrain", action(nodes.undrain))
    router.add_post("/api/v1/nodes/{id}/disable", action(nodes.disable))
    router.add_post("/api/v1/nodes/{id}/enable", action(nodes.enable))
    router.add_post("/api/v1/nodes/{id}/release", action(nodes.release))
