"""REST gateway under /api/v1 (aiohttp), plus /healthz and /metrics.

Every handler authenticates, then calls LatticeService. Errors become
``{"error": {code, message, details, hint}}`` with the status mapped once in
lattice_common.errors.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from lattice_common.errors import LatticeError, ValidationError
from lattice_common.types import AllocationReport
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from lattice_api.auth import Authenticator, Identity
from lattice_api.logs import LogProxy
from lattice_api.node_monitor import NodeMonitor
from lattice_api.service import LatticeService

log = logging.getLogger("lattice.api.rest")

REQUESTS = Counter("lattice_api_requests_total", "Total API requests", ["method", "status"])
LATENCY = Histogram(
    "lattice_api_request_duration_seconds",
    "Request latency",
    ["method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
ACTIVE_STREAMS = Gauge(
    "lattice_api_active_streams", "Active streaming connections", ["stream_type"]
)

_json = msgspec.json.Encoder()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(data), status=status, content_type="application/json")


def error_response(err: LatticeError) -> web.Response:
    return json_response({"error": err.to_dict()}, status=err.http_status)


PUBLIC = {"/healthz", "/metrics", "/api/v1/auth/discovery"}
IDENTITY = web.RequestKey("identity", Identity)  # set by the middleware on every request


class RestApi:
    def __init__(
        self,
        service: LatticeService,
        auth: Authenticator,
        monitor: NodeMonitor,
        logs: LogProxy,
        *,
        oidc_issuer: str = "",
        oidc_client_id: str = "lattice",
        max_request_bytes: int = 1_048_576,
    ) -> None:
        self.svc = service
        self.auth = auth
        self.monitor = monitor
        self.logs = logs
        self.oidc_issuer = oidc_issuer
        self.oidc_client_id = oidc_client_id
        self.app = web.Application(
            middlewares=[self._middleware], client_max_size=max_request_bytes
        )
        r = self.app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/api/v1/auth/discovery", self.discovery)
        r.add_post("/api/v1/allocations", self.submit)
        r.add_get("/api/v1/allocations", self.list_allocations)
        r.add_get("/api/v1/allocations/{id}", self.get_allocation)
        r.add_delete("/api/v1/allocations/{id}", self.cancel)
        r.add_get("/api/v1/allocations/{id}/watch", self.watch)
        r.add_get("/api/v1/allocations/{id}/logs", self.get_logs)
        r.add_get("/api/v1/allocations/{id}/logs/stream", self.stream_logs)
        r.add_get("/api/v1/nodes", self.list_nodes)
        r.add_post("/api/v1/nodes/register", self.register_node)
        r.add_get("/api/v1/nodes/{id}", self.get_node)
        r.add_post("/api/v1/nodes/{id}/heartbeat", self.heartbeat)
        r.add_post(
            "/api/v1/nodes/{id}/{action:drain|undrain|disable|enable|release}", self.node_action
        )
        r.add_get("/api/v1/tenants", self.list_tenants)
        r.add_post("/api/v1/tenants", self.create_tenant)
        r.add_get("/api/v1/tenants/{name}", self.get_tenant)
        r.add_patch("/api/v1/tenants/{name}", self.update_tenant)
        r.add_get("/api/v1/vclusters", self.list_vclusters)
        r.add_post("/api/v1/vclusters", self.create_vcluster)
        r.add_get("/api/v1/vclusters/{name}", self.get_vcluster)
        r.add_patch("/api/v1/vclusters/{name}", self.update_vcluster)
        r.add_get("/api/v1/raft/status", self.raft_status)
        # --- usage: /api/v1/tenants/{name}/usage, /api/v1/usage (lattice_api.usage) ---
        from lattice_api.usage import add_rest_routes as add_usage_routes

        add_usage_routes(r, self.svc)
        # --- end usage ---

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        t0 = time.perf_counter()
        route = request.match_info.route.resource
        method = f"{request.method} {route.canonical if route else request.path}"
        status = 500
        try:
            if request.path not in PUBLIC:
                request[IDENTITY] = self.auth.authenticate(request.headers)
            resp = await handler(request)
            status = resp.status
            return resp
        except LatticeError as e:
            status = e.http_status
            return error_response(e)
        except web.HTTPException as e:
            status = e.status
            raise
        except Exception:
            log.exception("unhandled error in %s", method)
            return error_response(LatticeError("internal server error", hint="See the server log."))
        finally:
            REQUESTS.labels(method, str(status)).inc()
            LATENCY.labels(method).observe(time.perf_counter() - t0)

    @staticmethod
    def who(request: web.Request) -> Identity:
        return request[IDENTITY]

    @staticmethod
    async def body(request: web.Request) -> dict[str, Any]:
        if not request.can_read_body:
            return {}
        try:
            data = json.loads(await request.read() or b"{}")
        except ValueError as e:
            raise ValidationError(f"request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValidationError("request body must be a JSON object")
        return data

    # --- public -----------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        st = self.svc.member.status()
        return json_response(
            {
                "status": "ok",
                "member_id": st["member_id"],
                "is_leader": st["is_leader"],
                "leader_address": st["leader_address"],
                "revision": st["revision"],
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        self.svc.member.status()  # refreshes raft gauges
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def discovery(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "idp_url": self.oidc_issuer,
                "client_id": self.oidc_client_id,
                "issuer": self.oidc_issuer,
            }
        )

    # --- allocations --------------------------------------------------------------------

    async def submit(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        if body.get("task_group") not in (None, ""):
            res = await self.svc.submit_task_group(self.who(request), body)
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
        a = await self.svc.submit(self.who(request), body)
        return json_response(a, status=201)

    async def list_allocations(self, request: web.Request) -> web.Response:
        q = request.query
        limit = q.get("limit")
        allocs = self.svc.list_allocations(
            self.who(request),
            state=q.get("state") or None,
            tenant=q.get("tenant") or None,
            vcluster=q.get("vcluster") or None,
            user=q.get("user") or None,
            all_users=q.get("all", "").lower() in ("1", "true", "yes"),
            limit=int(limit) if limit and limit.isdigit() else None,
            task_group=q.get("task_group") or None,
        )
        return json_response({"allocations": allocs})

    async def get_allocation(self, request: web.Request) -> web.Response:
        return json_response(self.svc.get_allocation(self.who(request), request.match_info["id"]))

    async def cancel(self, request: web.Request) -> web.Response:
        return json_response(await self.svc.cancel(self.who(request), request.match_info["id"]))

    async def _ndjson(self, request: web.Request, kind: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        ACTIVE_STREAMS.labels(kind).inc()
        return resp

    async def watch(self, request: web.Request) -> web.StreamResponse:
        who, alloc_id = self.who(request), request.match_info["id"]
        self.svc.get_allocation(who, alloc_id)  # 404 before the stream starts
        resp = await self._ndjson(request, "watch")
        try:
            async for rev, a in self.svc.watch(who, alloc_id):
                await resp.write(_json.encode({"revision": rev, "allocation": a}) + b"\n")
        finally:
            ACTIVE_STREAMS.labels("watch").dec()
        await resp.write_eof()
        return resp

    async def get_logs(self, request: web.Request) -> web.Response:
        who, alloc_id = self.who(request), request.match_info["id"]
        a = self.svc.get_allocation(who, alloc_id)
        tail = request.query.get("tail")
        lines = await self.logs.fetch(
            a,
            tail=int(tail) if tail and tail.isdigit() else None,
            stream=request.query.get("stream", "both"),
        )
        return json_response({"lines": lines})

    async def stream_logs(self, request: web.Request) -> web.StreamResponse:
        who, alloc_id = self.who(request), request.match_info["id"]
        a = self.svc.get_allocation(who, alloc_id)
        tail = request.query.get("tail")
        resp = await self._ndjson(request, "logs")
        try:
            async for line in self.logs.follow(
                a,
                tail=int(tail) if tail and tail.isdigit() else None,
                stream=request.query.get("stream", "both"),
            ):
                await resp.write(_json.encode(line) + b"\n")
        finally:
            ACTIVE_STREAMS.labels("logs").dec()
        await resp.write_eof()
        return resp

    # --- nodes --------------------------------------------------------------------------

    async def list_nodes(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "nodes": self.svc.list_nodes(
                    self.who(request), state=request.query.get("state") or None
                )
            }
        )

    async def get_node(self, request: web.Request) -> web.Response:
        return json_response(self.svc.get_node(self.who(request), request.match_info["id"]))

    async def node_action(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        n = await self.svc.node_action(
            self.who(request),
            request.match_info["id"],
            request.match_info["action"],
            str(body.get("reason") or ""),
        )
        return json_response(n)

    async def register_node(self, request: web.Request) -> web.Response:
        return json_response(
            await self.svc.register_node(self.who(request), await self.body(request))
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        from lattice_api.auth import authorize

        authorize(self.who(request), "node.agent")
        body = await self.body(request)
        try:
            reports = msgspec.convert(body.get("reports") or [], list[AllocationReport])
        except msgspec.ValidationError as e:
            raise ValidationError(f"invalid reports: {e}") from None
        out = await self.monitor.heartbeat(
            request.match_info["id"],
            int(body.get("sequence") or 0),
            reports,
            str(body.get("conformance_fingerprint") or ""),
        )
        return json_response(out)

    # --- tenants / vClusters -----------------------------------------------------------

    async def list_tenants(self, request: web.Request) -> web.Response:
        return json_response({"tenants": self.svc.list_tenants(self.who(request))})

    async def create_tenant(self, request: web.Request) -> web.Response:
        return json_response(
            await self.svc.create_tenant(self.who(request), await self.body(request)), status=201
        )

    async def get_tenant(self, request: web.Request) -> web.Response:
        return json_response(self.svc.get_tenant(self.who(request), request.match_info["name"]))

    async def update_tenant(self, request: web.Request) -> web.Response:
        return json_response(
            await self.svc.update_tenant(
                self.who(request), request.match_info["name"], await self.body(request)
            )
        )

    async def list_vclusters(self, request: web.Request) -> web.Response:
        return json_response({"vclusters": self.svc.list_vclusters(self.who(request))})

    async def create_vcluster(self, request: web.Request) -> web.Response:
        return json_response(
            await self.svc.create_vcluster(self.who(request), await self.body(request)), status=201
        )

    async def get_vcluster(self, request: web.Request) -> web.Response:
        return json_response(self.svc.get_vcluster(self.who(request), request.match_info["name"]))

    async def update_vcluster(self, request: web.Request) -> web.Response:
        return json_response(
            await self.svc.update_vcluster(
                self.who(request), request.match_info["name"], await self.body(request)
            )
        )

    async def raft_status(self, request: web.Request) -> web.Response:
        return json_response(self.svc.raft_status(self.who(request)))
