"""REST routes of DAG workflows (see lattice_api.ops.dags): ``POST /api/v1/dags``
submits one (a JSON body in either documented form, ``{"yaml": TEXT}``, or the YAML
file itself as ``application/yaml``/``text/yaml``), ``GET /api/v1/dags`` lists (the
caller's own unless ``?all=true`` or ``?user=``), ``GET``/``DELETE /api/v1/dags/{id}``
read and cancel one."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from lattice_common.errors import ValidationError

from lattice_api.http import json_response, query_flag, query_int, read_body, who
from lattice_api.operations import Operations

YAML_TYPES = frozenset({"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"})


async def read_dag_body(request: web.Request) -> dict[str, Any]:
    """The JSON body, or ``{"yaml": TEXT}`` for a YAML body (its defaults, such as
    ``tenant`` and ``vcluster``, then come from the query string)."""
    if request.content_type not in YAML_TYPES:
        return await read_body(request)
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValidationError(
            f"the DAG file is not valid UTF-8 (byte {e.start})", hint="Save the file as UTF-8."
        ) from None
    body: dict[str, Any] = {"yaml": text}
    for key in ("tenant", "vcluster", "request_id"):
        if request.query.get(key):
            body[key] = request.query[key]
    return body


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    dags = ops.dags

    async def submit(request: web.Request) -> web.Response:
        res = await dags.submit(who(request), await read_dag_body(request))
        return json_response(
            {
                "dag_id": res.dag.id,
                "allocation_ids": [a.id for a in res.allocations],
                "dag": res.dag,
                "allocations": res.allocations,
            },
            status=201,
        )

    async def list_dags(request: web.Request) -> web.Response:
        q = request.query
        found = dags.list(
            who(request),
            tenant=q.get("tenant") or None,
            user=q.get("user") or None,
            state=q.get("state") or None,
            all_users=query_flag(q, "all"),
            limit=query_int(q, "limit"),
        )
        return json_response({"dags": found})

    async def get_dag(request: web.Request) -> web.Response:
        return json_response(dags.get(who(request), request.match_info["id"]))

    async def cancel(request: web.Request) -> web.Response:
        reason = request.query.get("reason", "")
        if request.body_exists:
            reason = str((await read_body(request)).get("reason") or reason)
        dag, cancelled = await dags.cancel(who(request), request.match_info["id"], reason)
        return json_response({"dag": dag, "cancelled_allocation_ids": cancelled})

    router.add_post("/api/v1/dags", submit)
    router.add_get("/api/v1/dags", list_dags)
    router.add_get("/api/v1/dags/{id}", get_dag)
    router.add_delete("/api/v1/dags/{id}", cancel)
