"""REST routes of login and identity (lattice_api.ops.auth): ``GET /api/v1/auth/discovery``
(public: where clients log in) and ``GET /api/v1/auth/whoami`` (the caller)."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    auth = ops.auth

    async def discovery(request: web.Request) -> web.Response:
        return json_response(await auth.discovery())

    async def whoami(request: web.Request) -> web.Response:
        return json_response(auth.whoami(who(request)))

    router.add_get("/api/v1/auth/discovery", discovery)
    router.add_get("/api/v1/auth/whoami", whoami)
