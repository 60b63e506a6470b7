"""REST routes of the nodes' uenv image caches (lattice_api.ops.cache):
``GET /api/v1/cache?node=`` (one node's or every node's cache), ``POST
/api/v1/cache/warm`` ``{image, nodes?, group?, all?}`` and ``POST /api/v1/cache/evict``
``{image, node}``."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from lattice_common.errors import ValidationError

from lattice_api.http import json_response, read_body, who
from lattice_api.operations import Operations


def _nodes(value: Any) -> list[str] | None:
    """``nodes`` as a list of ids or one comma-separated string."""
    if value is None:
        return None
    if isinstance(value, str):
        return [n for n in value.split(",") if n.strip()]
    if isinstance(value, list) and all(isinstance(n, str) for n in value):
        return value
    raise ValidationError(
        "nodes must be a list of node ids",
        details={"nodes": str(value)[:80]},
        hint='e.g. {"image": "prgenv-gnu/24.11:v1", "nodes": ["x1000c0s0b0n0"]}',
    )


def _group(value: Any) -> int | None:
    """``group``: a dragonfly group number (a node's GROUP in ``lattice nodes``)."""
    if value is None or value == "":
        return None
    try:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError
        return int(value)
    except ValueError:
        raise ValidationError(
            "group must be a whole number",
            details={"group": str(value)[:80]},
            hint="A group is a dragonfly group number, as in the GROUP column of `lattice nodes`.",
        ) from None


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    cache = ops.cache

    async def status(request: web.Request) -> web.Response:
        return json_response(await cache.status(who(request), request.query.get("node") or None))

    async def warm(request: web.Request) -> web.Response:
        body = await read_body(request)
        out = await cache.warm(
            who(request),
            str(body.get("image") or ""),
            nodes=_nodes(body.get("nodes")),
            group=_group(body.get("group")),
            all=body.get("all") is True,
        )
        return json_response(out)

    async def evict(request: web.Request) -> web.Response:
        body = await read_body(request)
        out = await cache.evict(
            who(request), str(body.get("image") or ""), str(body.get("node") or "")
        )
        return json_response(out)

    router.add_get("/api/v1/cache", status)
    router.add_post("/api/v1/cache/warm", warm)
    router.add_post("/api/v1/cache/evict", evict)
