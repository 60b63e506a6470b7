"""REST routes of the audit log (AdminService.QueryAudit/ExportAudit/VerifyAudit):
``GET /api/v1/admin/audit`` (also ``GET /api/v1/audit``, the specification's path, which
takes ``from``/``to`` too) -> ``{entries, next_page_token}``;
``GET /api/v1/admin/audit/export`` -> the export file (JSON lines, a signed header
first); ``POST /api/v1/admin/audit/verify`` -> the committed chain checked here."""

from __future__ import annotations

import time

from aiohttp import web

from lattice_api.http import json_response, who
from lattice_api.operations import Operations
from lattice_api.ops.audit import entry_view


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    audit = ops.audit

    async def query(request: web.Request) -> web.Response:
        page = await audit.query(who(request), dict(request.query))
        return json_response(
            {
                "entries": [entry_view(e) for e in page["entries"]],
                "next_page_token": page["next_page_token"],
            }
        )

    async def export(request: web.Request) -> web.StreamResponse:
        lines = await audit.export(who(request))
        name = time.strftime("lattice-audit-%Y%m%dT%H%M%SZ.jsonl", time.gmtime())
        resp = web.StreamResponse(
            headers={
                "Content-Type": "application/x-ndjson",
                "Content-Disposition": f'attachment; filename="{name}"',
            }
        )
        await resp.prepare(request)
        chunk = bytearray()
        for line in lines:
            chunk += line
            if len(chunk) >= 65536:
                await resp.write(bytes(chunk))
                chunk.clear()
        await resp.write(bytes(chunk))
        await resp.write_eof()
        return resp

    async def verify(request: web.Request) -> web.Response:
        return json_response(await audit.verify(who(request)))

    router.add_get("/api/v1/admin/audit", query)
    router.add_get("/api/v1/audit", query)
    router.add_get("/api/v1/admin/audit/export", export)
    router.add_post("/api/v1/admin/audit/verify", verify)
