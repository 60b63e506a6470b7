"""REST routes of AdminService: ``/api/v1/tenants``, ``/api/v1/vclusters`` (list,
create, get, update) and ``/api/v1/raft/status``. (Usage is rest/usage.py.)
``PUT /api/v1/tenants/{name}`` is the quota update of the spec's REST form, the one
Waldur calls with its service token (quota fields only for that token)."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, read_body, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    admin = ops.admin

    async def list_tenants(request: web.Request) -> web.Response:
        return json_response({"tenants": admin.list_tenants(who(request))})

    async def create_tenant(request: web.Request) -> web.Response:
        t = await admin.create_tenant(who(request), await read_body(request))
        return json_response(t, status=201)

    async def get_tenant(request: web.Request) -> web.Response:
        return json_response(admin.get_tenant(who(request), request.match_info["name"]))

    async def update_tenant(request: web.Request) -> web.Response:
        name, body = request.match_info["name"], await read_body(request)
        return json_response(await admin.update_tenant(who(request), name, body))

    async def put_tenant(request: web.Request) -> web.Response:
        name, body = request.match_info["name"], await read_body(request)
        return json_response(await admin.put_tenant(who(request), name, body))

    async def list_vclusters(request: web.Request) -> web.Response:
        return json_response({"vclusters": admin.list_vclusters(who(request))})

    async def create_vcluster(request: web.Request) -> web.Response:
        v = await admin.create_vcluster(who(request), await read_body(request))
        return json_response(v, status=201)

    async def get_vcluster(request: web.Request) -> web.Response:
        return json_response(admin.get_vcluster(who(request), request.match_info["name"]))

    async def update_vcluster(request: web.Request) -> web.Response:
        name, body = request.match_info["name"], await read_body(request)
        return json_response(await admin.update_vcluster(who(request), name, body))

    async def raft_status(request: web.Request) -> web.Response:
        return json_response(admin.raft_status(who(request)))

    router.add_get("/api/v1/tenants", list_tenants)
    router.add_post("/api/v1/tenants", create_tenant)
    router.add_get("/api/v1/tenants/{name}", get_tenant)
    router.add_patch("/api/v1/tenants/{name}", update_tenant)
    router.add_put("/api/v1/tenants/{name}", put_tenant)
    router.add_get("/api/v1/vclusters", list_vclusters)
    router.add_post("/api/v1/vclusters", create_vcluster)
    router.add_get("/api/v1/vclusters/{name}", get_vcluster)
    router.add_patch("/api/v1/vclusters/{name}", update_vcluster)
    router.add_get("/api/v1/raft/status", raft_status)
