"""REST routes of backups (AdminService.CreateBackup, VerifyBackup, RestoreBackup), at the
specification's paths:

* ``POST /api/v1/admin/backup`` ``{path}`` -> BackupInfo (``path`` on this member or
  ``s3://...``; empty = ``quorum.backup_dir``). ``{download: true}`` streams the file back
  instead (``application/octet-stream``; the info in ``X-Lattice-Backup-*`` headers):
  what ``lattice admin backup create --to ./local-file`` uses.
* ``GET /api/v1/admin/backup/verify?path=...`` -> ``{valid, ...counts}`` or ``{valid:
  false, message, hint}`` (empty path = the latest scheduled snapshot).
* ``POST /api/v1/admin/restore`` ``{path, force}`` -> ``{info, message}``: the file
  verified and the restart steps (spec: "requires restart").
"""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, read_body, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    backups = ops.backup

    async def create(request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        if body.get("download"):
            data, info = await backups.download(who(request))
            headers = {
                "X-Lattice-Backup-Checksum": str(info["checksum"]),
                "X-Lattice-Backup-Revision": str(info["revision"]),
                "Content-Disposition": 'attachment; filename="backup.lattice"',
            }
            return web.Response(body=data, content_type="application/octet-stream", headers=headers)
        return json_response(await backups.create(who(request), str(body.get("path") or "")))

    async def verify(request: web.Request) -> web.Response:
        return json_response(await backups.verify(who(request), request.query.get("path", "")))

    async def restore(request: web.Request) -> web.Response:
        body = await read_body(request)
        out = await backups.restore(
            who(request), str(body.get("path") or ""), force=bool(body.get("force"))
        )
        return json_response(out)

    router.add_post("/api/v1/admin/backup", create)
    router.add_get("/api/v1/admin/backup/verify", verify)
    router.add_post("/api/v1/admin/restore", restore)
