"""REST routes of interactive sessions (see lattice_api.ops.sessions): ``POST
/api/v1/sessions`` (an allocation body; entrypoint and walltime have defaults), ``GET
/api/v1/sessions[?all=&user=]``, ``GET /api/v1/sessions/{id}``, ``DELETE
/api/v1/sessions/{id}`` (its allocation is cancelled)."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, query_flag, read_body, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    sessions = ops.sessions

    async def create(request: web.Request) -> web.Response:
        return json_response(await sessions.create(who(request), await read_body(request)), 201)

    async def list_sessions(request: web.Request) -> web.Response:
        rows = sessions.list(
            who(request),
            user=request.query.get("user") or None,
            all_users=query_flag(request.query, "all"),
        )
        return json_response({"sessions": rows})

    async def get(request: web.Request) -> web.Response:
        return json_response(sessions.get(who(request), request.match_info["id"]))

    async def delete(request: web.Request) -> web.Response:
        return json_response(await sessions.delete(who(request), request.match_info["id"]))

    router.add_post("/api/v1/sessions", create)
    router.add_get("/api/v1/sessions", list_sessions)
    router.add_get("/api/v1/sessions/{id}", get)
    router.add_delete("/api/v1/sessions/{id}", delete)
