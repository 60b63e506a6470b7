"""REST routes of AllocationService: ``/api/v1/allocations`` (submit, list), ``/{id}``
(get, cancel), ``/{id}/watch`` and ``/{id}/logs/stream`` (NDJSON), ``/{id}/logs``."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from aiohttp import web
from lattice_common.errors import ValidationError

from lattice_api.http import json_response, query_flag, query_int, read_body, stream_ndjson, who
from lattice_api.operations import Operations


def query_time(query: Mapping[str, str], name: str) -> float | None:
    """A time query parameter: seconds since the epoch or RFC 3339
    (``2026-03-01T10:00:00Z``; without a zone: UTC). None when absent."""
    value = query.get(name, "").strip()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    except ValueError:
        raise ValidationError(
            f"{name}={value!r} is not a time",
            details={name: value},
            hint="Give seconds since the epoch or RFC 3339, e.g. 2026-03-01T10:00:00Z.",
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


def _log_query(query: Mapping[str, str]) -> dict[str, object]:
    """The filters of both log routes: stream, node, since, until."""
    return {
        "stream": query.get("stream") or "both",
        "node": query.get("node") or None,
        "since": query_time(query, "since"),
        "until": query_time(query, "until"),
    }


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
        a = await allocs.submit(who(request), body)
        if query_flag(request.query, "ids_only"):  # as gRPC's SubmitRequest.ids_only
            return json_response({"allocation_ids": [a.id]}, status=201)
        return json_response(a, status=201)

    async def list_allocations(request: web.Request) -> web.Response:
        q = request.query
        found = await allocs.list_with_history(
            who(request),
            state=q.get("state") or None,
            tenant=q.get("tenant") or None,
            vcluster=q.get("vcluster") or None,
            user=q.get("user") or None,
            all_users=query_flag(q, "all"),
            limit=query_int(q, "limit"),
            task_group=q.get("task_group") or None,
            # ended in [since, until): epoch seconds or RFC 3339 (lattice history)
            ended_since=query_time(q, "since"),
            ended_until=query_time(q, "until"),
        )
        return json_response({"allocations": found})

    async def get_allocation(request: web.Request) -> web.Response:
        return json_response(await allocs.find(who(request), request.match_info["id"]))

    async def cancel(request: web.Request) -> web.Response:
        return json_response(await allocs.cancel(who(request), request.match_info["id"]))

    async def watch(request: web.Request) -> web.StreamResponse:
        events = allocs.watch(who(request), request.match_info["id"])  # 404 before streaming
        return await stream_ndjson(
            request, "watch", events, lambda ev: {"revision": ev[0], "allocation": ev[1]}
        )

    async def get_logs(request: web.Request) -> web.Response:
        # ?tail=&stream=&node=&since=&until=&offset=&limit= (history from the log store)
        q = request.query
        limit = query_int(q, "limit")
        lines = await allocs.logs(
            who(request),
            request.match_info["id"],
            tail=query_int(q, "tail"),
            offset=query_int(q, "offset"),
            limit=None if limit is None else limit + 1,
            **_log_query(q),  # type: ignore[arg-type]
        )
        truncated = limit is not None and len(lines) > limit
        return json_response(
            {"lines": lines[:limit] if truncated else lines, "truncated": truncated}
        )

    async def stream_logs(request: web.Request) -> web.StreamResponse:
        lines = allocs.follow_logs(
            who(request),
            request.match_info["id"],
            tail=query_int(request.query, "tail"),
            **_log_query(request.query),  # type: ignore[arg-type]
        )
        return await stream_ndjson(request, "logs", lines)

    router.add_post("/api/v1/allocations", submit)
    router.add_get("/api/v1/allocations", list_allocations)
    router.add_get("/api/v1/allocations/{id}", get_allocation)
    router.add_delete("/api/v1/allocations/{id}", cancel)
    router.add_get("/api/v1/allocations/{id}/watch", watch)
    router.add_get("/api/v1/allocations/{id}/logs", get_logs)
    router.add_get("/api/v1/allocations/{id}/logs/stream", stream_logs)
