"""The aiohttp application of lattice-server: the shared middleware (lattice_api.http)
and every service's routes."""

from __future__ import annotations

from aiohttp import web

from lattice_api import http
from lattice_api.auth import Authenticator
from lattice_api.operations import Operations
from lattice_api.rest import (
    accounting,
    admin,
    allocations,
    attach,
    audit,
    backup,
    cache,
    checkpoint,
    compare,
    dags,
    diag,
    launches,
    metrics,
    nodes,
    pki,
    public,
    queue,
    services,
    sessions,
    suspend,
    telemetry,
    usage,
)
from lattice_api.rest import auth as auth_routes


def build_rest_app(ops: Operations, auth: Authenticator) -> web.Application:
    auth.on_failure = ops.recorder.auth_failed  # failed authentications: the audit log
    app = web.Application(
        middlewares=[http.middleware(auth, ops.limiter, ops.settings.token_revalidation_interval)],
        client_max_size=ops.settings.max_request_bytes,
    )
    for routes in (
        public,
        auth_routes,
        allocations,
        launches,
        metrics,
        compare,
        diag,
        telemetry,
        attach,
        dags,
        sessions,
        nodes,
        admin,
        usage,
        queue,
        services,
        cache,
        audit,
        pki,
        backup,
        accounting,  # /api/v1/accounts/..., /api/v1/admin/prices, /admin/accounting/...
        suspend,  # POST /api/v1/allocations/{id}/suspend|resume
        checkpoint,  # POST /api/v1/allocations/{id}/checkpoint
    ):
        routes.add_routes(app.router, ops)
    return app


__all__ = ["build_rest_app"]
