"""REST routes of the internal CA (AdminService.InitCertificateAuthority,
GetCertificateAuthority, IssueCertificate; NodeService.SignNodeCertificate):
``POST /api/v1/admin/ca`` ``{rotate}`` -> the CA; ``GET /api/v1/admin/ca`` -> the CA;
``POST /api/v1/admin/ca/issue`` ``{kind, name, csr_pem, lifetime_seconds, hosts}`` and
``POST /api/v1/nodes/{id}/certificate`` ``{csr_pem}`` -> ``{cert_pem, ca_pem, serial,
not_after}``."""

from __future__ import annotations

from aiohttp import web

from lattice_api.http import json_response, read_body, who
from lattice_api.operations import Operations


def add_routes(router: web.UrlDispatcher, ops: Operations) -> None:
    pki = ops.pki

    async def init_ca(request: web.Request) -> web.Response:
        body = await read_body(request)
        return json_response(await pki.init_ca(who(request), rotate=bool(body.get("rotate"))))

    async def get_ca(request: web.Request) -> web.Response:
        return json_response(pki.view())

    async def issue(request: web.Request) -> web.Response:
        body = await read_body(request)
        hosts = body.get("hosts") or []
        out = await pki.issue(
            who(request),
            kind=str(body.get("kind") or ""),
            name=str(body.get("name") or ""),
            csr_pem=str(body.get("csr_pem") or ""),
            lifetime=float(body.get("lifetime_seconds") or 0.0),
            hosts=[str(h) for h in hosts] if isinstance(hosts, list) else [],
        )
        return json_response(out)

    async def sign_node(request: web.Request) -> web.Response:
        body = await read_body(request)
        node_id = request.match_info["id"]
        return json_response(
            await pki.sign_node(who(request), node_id, str(body.get("csr_pem") or ""))
        )

    router.add_post("/api/v1/admin/ca", init_ca)
    router.add_get("/api/v1/admin/ca", get_ca)
    router.add_post("/api/v1/admin/ca/issue", issue)
    router.add_post("/api/v1/nodes/{id}/certificate", sign_node)
