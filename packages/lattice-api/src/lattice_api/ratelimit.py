"""Per-user API limits (spec: Rate Limiting) and the per-node heartbeat limit.

One :class:`RateLimiter` per server decides for both transports: the REST middleware
and the gRPC interceptor call :meth:`RateLimiter.admit` with the caller and the call's
name from the permission table (``"Service.Rpc"`` or ``"METHOD /canonical/path"``),
after authentication and the permission check, before the adapter runs.

What each call costs is :data:`KINDS` (the specification's table; a call not listed
there is a ``request``, limited by ``rate_limit.requests_per_minute`` when that is set):

============== ================== ============================================
kind           default            what
============== ================== ============================================
attach         5 concurrent       Attach (PTY per session)
stream_logs    10 concurrent      StreamLogs (ring buffer readers)
stream_metrics 5 concurrent       StreamMetrics (agent fan-out)
query_metrics  60 per minute      QueryMetrics
diagnostics    30 per minute      Diagnostics
compare        10 per minute      Compare
============== ================== ============================================

Concurrent limits count open calls per (user, kind) and free the slot when the call
ends (a stream closes, a WebSocket hangs up). Rates are token buckets per (user, kind)
holding one minute's worth and refilled continuously, so any window of ``t`` seconds
admits at most ``limit + limit * t / 60`` calls. Over a limit the call is refused with
:class:`~lattice_common.errors.RateLimited` (HTTP 429 / RESOURCE_EXHAUSTED) carrying the
specification's message and ``retry_after_seconds`` (the ``Retry-After`` header; for a
concurrent limit 1 s, since no one knows when a session ends). Nothing queues.

Users are the token's subject. Node agents and schedulers (Role.AGENT) are not users
and are not limited. Tenant and system admins share the limits unless
``rate_limit.overrides`` names them (the specification's "Admin override").

The core (:class:`TokenBucket`, :class:`Concurrency`) is plain code over a ``clock``
parameter, tested without sockets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lattice_common.config import RateLimitConfig
from lattice_common.errors import RateLimited
from prometheus_client import Counter

from lattice_api.auth import Identity, Role

Clock = Callable[[], float]

RATE_LIMITED = Counter(
    "lattice_api_rate_limited_total",
    "Calls refused by a per-user limit (429 / RESOURCE_EXHAUSTED)",
    ["kind"],
)

#: call (permission-table name) -> kind; everything else is a "request"
KINDS: dict[str, str] = {
    "AllocationService.Attach": "attach",
    "GET /api/v1/allocations/{id}/attach": "attach",
    "AllocationService.StreamLogs": "stream_logs",
    "GET /api/v1/allocations/{id}/logs/stream": "stream_logs",
    "AllocationService.StreamMetrics": "stream_metrics",
    "GET /api/v1/allocations/{id}/metrics/stream": "stream_metrics",
    "HEAD /api/v1/allocations/{id}/metrics/stream": "stream_metrics",
    "AllocationService.QueryMetrics": "query_metrics",
    "GET /api/v1/allocations/{id}/metrics": "query_metrics",
    "HEAD /api/v1/allocations/{id}/metrics": "query_metrics",
    "AllocationService.GetDiagnostics": "diagnostics",
    "GET /api/v1/allocations/{id}/diagnostics": "diagnostics",
    "HEAD /api/v1/allocations/{id}/diagnostics": "diagnostics",
    "GET /api/v1/allocations/{id}/diagnostics/{section}": "diagnostics",
    "HEAD /api/v1/allocations/{id}/diagnostics/{section}": "diagnostics",
    "AllocationService.CompareMetrics": "compare",
    "GET /api/v1/compare": "compare",
    "HEAD /api/v1/compare": "compare",
}
CONCURRENT = {
    "attach": "attach_max_concurrent",
    "stream_logs": "stream_logs_max_concurrent",
    "stream_metrics": "stream_metrics_max_concurrent",
}
PER_MINUTE = {
    "query_metrics": "query_metrics_per_minute",
    "diagnostics": "diagnostics_per_minute",
    "compare": "compare_per_minute",
    "request": "requests_per_minute",
}
_NAMES = {
    "query_metrics": "QueryMetrics",
    "diagnostics": "Diagnostics",
    "compare": "Compare",
    "request": "API",
}


def kind_of(call: str) -> str:
    """The kind of a call named as in the permission table (``Service.Rpc`` or a
    ``/lattice.v1.Service/Rpc`` path, or ``METHOD /canonical/path``)."""
    if call.startswith("/lattice.v1."):
        call = call.removeprefix("/lattice.v1.").replace("/", ".", 1)
    return KINDS.get(call, "request")


def concurrent_message(limit: int) -> str:
    """The specification's text for every concurrent limit (Attach, StreamLogs,
    StreamMetrics): ``maximum concurrent sessions reached (5/5). Close an existing
    session to open a new one.``"""
    return (
        f"maximum concurrent sessions reached ({limit}/{limit}). "
        "Close an existing session to open a new one."
    )


# --- pure core ------------------------------------------------------------------------


@dataclass
class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second; one per admitted call."""

    capacity: float
    rate: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, capacity: float, rate: float, now: float) -> TokenBucket:
        return cls(capacity, rate, capacity, now)

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def take(self, now: float) -> float:
        """0.0 when a token was taken, else the seconds until one is available."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def is_full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.capacity


class Concurrency:
    """Open calls per key; :meth:`acquire` returns a release function (idempotent) or
    None when ``limit`` are open."""

    def __init__(self) -> None:
        self.open: dict[tuple[str, str], int] = {}

    def count(self, key: tuple[str, str]) -> int:
        return self.open.get(key, 0)

    def acquire(self, key: tuple[str, str], limit: int) -> Callable[[], None] | None:
        if self.open.get(key, 0) >= limit:
            return None
        self.open[key] = self.open.get(key, 0) + 1
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            left = self.open.get(key, 0) - 1
            if left > 0:
                self.open[key] = left
            else:
                self.open.pop(key, None)

        return release


# --- the server's limiter -------------------------------------------------------------


class RateLimiter:
    """Per-user limits from ``rate_limit`` (see the module docstring)."""

    #: idle (full) buckets are dropped when more than this many exist
    MAX_BUCKETS = 10_000

    def __init__(self, config: RateLimitConfig | None = None, *, clock: Clock = time.monotonic):
        self.config = config or RateLimitConfig()
        self.clock = clock
        self.concurrency = Concurrency()
        self.buckets: dict[tuple[str, str], TokenBucket] = {}

    def limit(self, user: str, kind: str) -> int:
        """The user's limit for ``kind`` (a count or a number per minute; 0 = none)."""
        field = CONCURRENT.get(kind) or PER_MINUTE.get(kind)
        if field is None:
            return 0
        override = self.config.overrides.get(user)
        if override is not None and getattr(override, field) is not None:
            return int(getattr(override, field))
        return int(getattr(self.config, field))

    def exempt(self, who: Identity) -> bool:
        return not self.config.enabled or who.role in (Role.AGENT, Role.SERVICE)

    @contextmanager
    def admit(self, who: Identity, call: str) -> Iterator[None]:
        """Hold the caller's slot for ``call`` while the block runs; raise RateLimited
        before it when the caller is over a limit."""
        release = self.check(who, call)
        try:
            yield
        finally:
            if release is not None:
                release()

    def check(self, who: Identity, call: str) -> Callable[[], None] | None:
        """Admit one call now: RateLimited, or a release function for a concurrent
        kind (call it when the call ends), or None."""
        if self.exempt(who):
            return None
        kind = kind_of(call)
        limit = self.limit(who.user, kind)
        if kind in CONCURRENT:
            release = self.concurrency.acquire((who.user, kind), limit)
            if release is None:
                RATE_LIMITED.labels(kind).inc()
                raise RateLimited(
                    concurrent_message(limit),
                    details={"kind": kind, "limit": limit, "retry_after_seconds": 1},
                    hint="Rejected requests are not queued: close one and retry. An admin "
                    "can raise your limit (rate_limit.overrides).",
                )
            return release
        if limit <= 0:
            return None
        now = self.clock()
        key = (who.user, kind)
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) >= self.MAX_BUCKETS:
                self._prune(now)
            bucket = self.buckets[key] = TokenBucket.full(limit, limit / 60.0, now)
        elif bucket.capacity != limit:  # the config changed
            bucket.capacity, bucket.rate = float(limit), limit / 60.0
        wait = bucket.take(now)
        if wait > 0:
            retry = max(1, math.ceil(wait))
            RATE_LIMITED.labels(kind).inc()
            raise RateLimited(
                f"rate limit exceeded: {_NAMES.get(kind, kind)} allows {limit} requests per "
                f"minute per user; retry after {retry} s",
                details={"limit_per_minute": limit, "retry_after_seconds": retry},
                hint=f"Wait {retry} s (the Retry-After header) before the next request; "
                "requests over the limit are not queued.",
            )
        return None

    def _prune(self, now: float) -> None:
        for key in [k for k, b in self.buckets.items() if b.is_full(now)]:
            del self.buckets[key]


class HeartbeatLimiter:
    """Per-node heartbeat limit (spec: "max 1 heartbeat per interval"): a bucket of
    ``burst`` refilled one per ``interval`` seconds. ``burst`` 0 = no limit."""

    def __init__(self, interval: float, burst: int, *, clock: Clock = time.monotonic) -> None:
        self.interval = interval
        self.burst = burst
        self.clock = clock
        self.buckets: dict[str, TokenBucket] = {}

    def check(self, node_id: str) -> None:
        if self.burst <= 0 or self.interval <= 0:
            return
        now = self.clock()
        bucket = self.buckets.get(node_id)
        if bucket is None:
            bucket = self.buckets[node_id] = TokenBucket.full(self.burst, 1 / self.interval, now)
        wait = bucket.take(now)
        if wait > 0:
            retry = max(1, math.ceil(wait))
            raise RateLimited(
                f"heartbeat rate limit of node {node_id} exceeded: at most one per "
                f"{self.interval:g} s (bursts of {self.burst})",
                details={"node": node_id, "retry_after_seconds": retry},
                hint="The agent's heartbeat interval must not be shorter than "
                "node_agent.heartbeat_interval_seconds of the quorum.",
            )

    def forget(self, node_id: str) -> None:
        self.buckets.pop(node_id, None)


__all__ = [
    "CONCURRENT",
    "KINDS",
    "PER_MINUTE",
    "Concurrency",
    "HeartbeatLimiter",
    "RateLimiter",
    "TokenBucket",
    "concurrent_message",
    "kind_of",
]
