"""REST routes of AllocationService: ``/api/v1/allocations`` (submit, list), ``/{id}``
(get, cancel), ``/{id}/watch`` and ``/{id}/logs/stream`` (NDJSON), ``/{id}/logs``."""

from __future__ import annotations

from aiohttp import web
from lattice_common.errors import ValidationError

from lattice_api.http import json_response, query_flag, query_int, read_body, stream_ndjson, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    allocs = ops.allocations

    async def submit(request: web.Request) -> web.Response:
        body = await read_body(request)
        if body.get("test_only") or query_flag(request.query, "test_only"):
            if body.get("task_group") not in (None, ""):
                raise ValidationError("a test-only submission takes a single allocation")
            est = allocs.test_submit(who(request), body)
            return json_response({"test_only": True, "estimate": est})
        if body.get("task_group") not in (None, ""):
            res = await allocs.submit_task_group(who(request), body)
            tasks = res.allocations or []
            return json_response(
                {
                    "task_group_id": res.task_group_id,
                    "allocation_ids": [a.id for a in tasks],
                    "tasks": len(tasks),
                    "concurrency": tasks[0].task_group_concurrency if tasks else 0,
                },
                status=201,
            )
        return json_response(await allocs.submit(who(request), body), status=201)

    async def list_allocations(request: web.Request) -> web.Response:
        q = request.query
        found = allocs.list(
            who(request),
            state=q.get("state") or None,
            tenant=q.get("tenant") or None,
            vcluster=q.get("vcluster") or None,
            user=q.get("user") or None,
            all_users=query_flag(q, "all"),
            limit=query_int(q, "limit"),
            task_group=q.get("task_group") or None,
        )
        return json_response({"allocations": found})

    async def get_allocation(request: web.Request) -> web.Response:
        return json_response(allocs.get(who(request), request.match_info["id"]))

    async def cancel(request: web.Request) -> web.Response:
        return json_response(await allocs.cancel(who(request), request.match_info["id"]))

    async def watch(request: web.Request) -> web.StreamResponse:
        events = allocs.watch(who(request), request.match_info["id"])  # 404 before streaming
        return await stream_ndjson(
            request, "watch", events, lambda ev: {"revision": ev[0], "allocation": ev[1]}
        )

    async def get_logs(request: web.Request) -> web.Response:
        lines = await allocs.logs(
            who(request),
            request.match_info["id"],
            tail=query_int(request.query, "tail"),
            stream=request.query.get("stream", "both"),
        )
        return json_response({"lines": lines})

    async def stream_logs(request: web.Request) -> web.StreamResponse:
        lines = allocs.follow_logs(
            who(request),
            request.match_info["id"],
            tail=query_int(request.query, "tail"),
            stream=request.query.get("stream", "both"),
        )
        return await stream_ndjson(request, "logs", lines)

    router.add_post("/api/v1/allocations", submit)
    router.add_get("/api/v1/allocations", list_allocations)
    router.add_get("/api/v1/allocations/{id}", get_allocation)
    router.add_delete("/api/v1/allocations/{id}", cancel)
    router.add_get("/api/v1/allocations/{id}/watch", watch)
    router.add_get("/api/v1/allocations/{id}/logs", get_logs)
    router.add_get("/api/v1/allocations/{id}/logs/stream", stream_logs)
