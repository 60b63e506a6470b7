"""Long streams re-check the caller's token (spec: OIDC token refresh for long-lived
streams): a stream opened with a bearer token is checked again every
``api.token_revalidation_interval_seconds`` (5 min) and ended with UNAUTHENTICATED
once the token has expired or its signing key was withdrawn. Clients log in again (or
refresh) and reconnect.

Streams of certificate identities are not cut: an agent's desired-state stream must
outlive its certificate's renewals; the certificate was checked at the handshake and
its renewals are checked at theirs. Nor are those of the agent token or of dev mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from lattice_common.errors import Unauthenticated
from prometheus_client import Counter

from lattice_api.auth import Identity

log = logging.getLogger("lattice.api.revalidate")

T = TypeVar("T")

STREAMS_ENDED = Counter(
    "lattice_api_streams_unauthenticated_total",
    "Long streams ended because their token no longer validates",
)

#: the REST routes that stream (canonical paths)
STREAMING_ROUTES = frozenset(
    {
        "GET /api/v1/allocations/{id}/watch",
        "GET /api/v1/allocations/{id}/logs/stream",
        "GET /api/v1/allocations/{id}/metrics/stream",
        "GET /api/v1/allocations/{id}/attach",
    }
)


def needs_recheck(who: Identity | None) -> bool:
    return who is not None and who.cert is None and who.method in ("oidc", "hmac")


async def run_rechecked(
    run: Awaitable[T],
    who: Identity,
    recheck: Callable[[], Awaitable[object]],
    interval: float,
) -> T:
    """Await ``run``; every ``interval`` seconds ``recheck()`` authenticates the caller
    again, and an Unauthenticated ends ``run`` (cancelled) and is raised."""
    if interval <= 0 or not needs_recheck(who):
        return await run
    task = asyncio.ensure_future(run)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            if done:
                return task.result()
            try:
                await recheck()
            except Unauthenticated as e:
                STREAMS_ENDED.inc()
                log.info("ending a stream of %s: %s", who.user, e.message)
                raise Unauthenticated(
                    f"the stream's token is no longer valid: {e.message}",
                    hint="Log in again (`lattice login`) and reconnect.",
                ) from None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


__all__ = ["STREAMING_ROUTES", "needs_recheck", "run_rechecked"]
