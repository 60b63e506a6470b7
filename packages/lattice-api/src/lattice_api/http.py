"""What the REST routes share: the request metrics, the middleware (authenticate, check
the permission table, count and time), JSON and NDJSON responses, body and query
parsing. Errors become ``{"error": {code, message, details, hint}}`` with the status
mapped once in lattice_common.errors.

The metrics are defined here once; the gRPC interceptor records into the same ones.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from aiohttp import web
from lattice_common.errors import LatticeError, RateLimited, Unauthenticated, ValidationError
from prometheus_client import Counter, Gauge, Histogram

from lattice_api.auth import Authenticator, Identity
from lattice_api.permissions import PUBLIC, ROUTE_PERMISSIONS, authorize
from lattice_api.ratelimit import RateLimiter
from lattice_api.revalidate import STREAMING_ROUTES, run_rechecked

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

IDENTITY = web.RequestKey("identity", Identity)  # set by the middleware on every request
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_json = msgspec.json.Encoder()


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(data), status=status, content_type="application/json")


def error_response(err: LatticeError) -> web.Response:
    return json_response({"error": err.to_dict()}, status=err.http_status)


def who(request: web.Request) -> Identity:
    return request[IDENTITY]


async def read_body(request: web.Request) -> dict[str, Any]:
    """The JSON object in the body ({} when there is none). ``body_exists``, not
    ``can_read_body``: a middleware may have read (and cached) the body already."""
    if not request.body_exists:
        return {}
    try:
        data = json.loads(await request.read() or b"{}")
    except ValueError as e:
        raise ValidationError(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValidationError("request body must be a JSON object")
    return data


def query_int(query: Mapping[str, str], name: str) -> int | None:
    """A whole-number query parameter; None when absent or not a plain number."""
    value = query.get(name)
    return int(value) if value and value.isdigit() else None


def query_flag(query: Mapping[str, str], name: str) -> bool:
    return query.get(name, "").lower() in ("1", "true", "yes")


async def stream_ndjson(
    request: web.Request, kind: str, items: Any, encode: Callable[[Any], Any] = lambda x: x
) -> web.StreamResponse:
    """One JSON object per line from the async iterator ``items``; counted in
    ``lattice_api_active_streams{stream_type=kind}`` while open."""
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    ACTIVE_STREAMS.labels(kind).inc()
    try:
        async for item in items:
            await resp.write(_json.encode(encode(item)) + b"\n")
    finally:
        ACTIVE_STREAMS.labels(kind).dec()
        close = getattr(items, "aclose", None)
        if close is not None:  # its upstream (an agent's stream, a watch) goes at once
            with contextlib.suppress(Exception):
                await close()
    transport = request.transport
    if transport is None or transport.is_closing():
        return resp  # the client left (a watch ended with Ctrl-C): nobody to end it for
    await resp.write_eof()
    return resp


def middleware(
    auth: Authenticator, limiter: RateLimiter | None = None, revalidation_interval: float = 0.0
) -> Any:
    """Authenticate (except public routes), check the route's permission once, admit
    the call through the per-user ``limiter`` (held until the handler returns, so a
    stream holds its slot while open; 429 with ``Retry-After`` when over a limit), and
    record ``lattice_api_requests_total`` / ``lattice_api_request_duration_seconds``."""

    @web.middleware
    async def api_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        t0 = time.perf_counter()
        route = request.match_info.route.resource
        method = f"{request.method} {route.canonical if route else request.path}"
        status = 500
        release = None
        try:
            permission = ROUTE_PERMISSIONS.get(method)
            if permission != PUBLIC:
                try:
                    peercert = (
                        request.transport.get_extra_info("peercert")
                        if request.transport is not None
                        else None
                    )
                    identity = await auth.authenticate_async(request.headers, peercert)
                except Unauthenticated as e:
                    if auth.on_failure is not None:  # the audit log
                        auth.on_failure(request.remote or "", request.headers, e.message)
                    raise
                request[IDENTITY] = identity
                if permission is not None:  # None: no route matched; aiohttp answers
                    authorize(identity, permission)
                    if limiter is not None:
                        release = limiter.check(identity, method)
            if method in STREAMING_ROUTES and IDENTITY in request:
                resp = await _rechecked(request, handler, auth, revalidation_interval)
            else:
                resp = await handler(request)
            status = resp.status
            return resp
        except LatticeError as e:
            status = e.http_status
            resp = error_response(e)
            if isinstance(e, RateLimited):
                resp.headers["Retry-After"] = str(e.retry_after)
            if request.headers.get("Upgrade", "").lower() == "websocket":
                # WebSocket clients rarely see a failed handshake's body (rest/attach.py)
                resp.headers["X-Lattice-Error"] = json.dumps(
                    {"error": e.to_dict()}, ensure_ascii=True
                )
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except Exception:
            log.exception("unhandled error in %s", method)
            return error_response(LatticeError("internal server error", hint="See the server log."))
        finally:
            if release is not None:
                release()
            REQUESTS.labels(method, str(status)).inc()
            LATENCY.labels(method).observe(time.perf_counter() - t0)

    return api_middleware


async def _rechecked(
    request: web.Request, handler: Handler, auth: Authenticator, interval: float
) -> web.StreamResponse:
    """A streaming route whose token is checked again while it streams: once it no
    longer validates, the stream is cut (its status line went out long ago, so the
    connection is closed; the client reconnects and is refused with the reason)."""
    try:
        return await run_rechecked(
            handler(request),
            request[IDENTITY],
            lambda: auth.authenticate_async(request.headers),
            interval,
        )
    except Unauthenticated:
        if request.transport is not None:
            request.transport.close()
        raise


__all__ = [
    "ACTIVE_STREAMS",
    "IDENTITY",
    "LATENCY",
    "REQUESTS",
    "error_response",
    "json_response",
    "middleware",
    "query_flag",
    "query_int",
    "read_body",
    "stream_ndjson",
    "who",
]
