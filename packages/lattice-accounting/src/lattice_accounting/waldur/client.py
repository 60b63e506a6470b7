"""HTTP client for the Waldur endpoints the accounting chapter names.

Why this module exists: the pusher and the budget override talk to Waldur's REST API
(spec: Accounting via Waldur, "Waldur API Endpoints Used"):

* ``POST /api/marketplace-orders/`` — report resource usage: one order per event
  (a Lattice allocation is a Waldur order, a vCluster an offering, a tenant a customer,
  a project a project);
* ``POST /api/invoices/{id}/items/`` — add billing line items: one per
  ``allocation.completed`` (GPU-hours, or node-hours on CPU nodes) and per
  ``node.released`` (claimed node-hours, billable even when idle); the invoice is
  addressed by the customer (the tenant);
* ``GET /api/customers/{id}/quotas/`` — read the customer's quotas and usage.

Every order and invoice item carries the event's deterministic id as ``backend_id``, so
a replayed or reconciled event is recognised by Waldur; a ``409 Conflict`` (already
recorded) counts as success.

The token is a :class:`pydantic.SecretStr` resolved from a secret reference by
:func:`lattice_common.config.load_config` (``accounting.waldur_token_secret_ref``,
``vault://``, ``file://`` or ``env://``; see lattice_common.secrets); it is sent as
``Authorization: Token <token>`` (Waldur's scheme) and appears in no log line, error
or ``repr``. :meth:`WaldurClient.set_token` swaps it on rotation
(``SecretResolver.watch``). Errors are typed: :class:`WaldurUnreachable` (refused,
reset, DNS), :class:`WaldurTimeout`, :class:`WaldurServerError` (5xx),
:class:`WaldurAuthError` (401/403), :class:`WaldurRejected` (another 4xx: the request
itself is wrong, retrying will not help).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from lattice_common.errors import FailedPrecondition, Unavailable, ValidationError
from lattice_common.secrets import redact, remember
from pydantic import SecretStr

from lattice_accounting.waldur.events import AccountingEvent, EventType

__all__ = [
    "WaldurAuthError",
    "WaldurClient",
    "WaldurError",
    "WaldurRejected",
    "WaldurServerError",
    "WaldurTimeout",
    "WaldurUnreachable",
    "invoice_item",
    "order_payload",
]

_HINT = "Check Waldur's availability; events stay buffered and are replayed in order."


class WaldurError(Unavailable):
    """Waldur did not take a request. ``kind`` names the failure for metrics/status."""

    kind = "error"


class WaldurUnreachable(WaldurError):
    kind = "unreachable"


class WaldurTimeout(WaldurError):
    kind = "timeout"


class WaldurServerError(WaldurError):
    kind = "server"


class WaldurAuthError(WaldurError):
    kind = "auth"


class WaldurRejected(FailedPrecondition):
    """A 4xx other than auth: this request is wrong and retrying it will not help."""

    kind = "rejected"


# --- payloads (pure) ----------------------------------------------------------------

_ORDER_TYPES = {
    EventType.ALLOCATION_STARTED: "Create",
    EventType.ALLOCATION_CHECKPOINTED: "Update",
    EventType.ALLOCATION_COMPLETED: "Terminate",
    EventType.NODE_CLAIMED: "Create",
    EventType.NODE_RELEASED: "Terminate",
}


def _resource_name(e: AccountingEvent) -> str:
    if e.allocation_id:
        return f"allocation {e.allocation_id}"
    return f"sensitive claim {','.join(e.nodes)} by {e.user}"


def order_payload(e: AccountingEvent) -> dict[str, Any]:
    """The marketplace order that reports ``e`` (entity mapping of the spec: tenant ->
    customer, project -> project, vCluster -> offering, allocation -> order)."""
    attributes = {
        k: v
        for k, v in {
            "event": e.type.value,
            "timestamp": e.timestamp,
            "allocation_id": e.allocation_id,
            "user": e.user,
            "nodes": list(e.nodes),
            "gpus": e.gpus,
            "gpu_type": e.gpu_type,
            "started_at": e.started_at,
            "ended_at": e.ended_at,
            "estimated_duration_seconds": e.estimated_duration_seconds or None,
            "duration_seconds": e.duration_seconds,
            "node_hours": e.node_hours,
            "gpu_hours": e.gpu_hours,
            "exit_status": e.exit_status,
            "state": e.state,
            "reason": e.reason,
            "wipe_confirmed": e.wipe_confirmed,
        }.items()
        if v not in (None, "", [])
    }
    return {
        "backend_id": e.event_id,
        "type": _ORDER_TYPES[e.type],
        "customer": e.tenant,
        "project": e.project or e.tenant,
        "offering": e.vcluster or "sensitive-nodes",
        "name": _resource_name(e),
        "attributes": attributes,
    }


def invoice_item(e: AccountingEvent) -> tuple[str, dict[str, Any]] | None:
    """``(invoice id, item)`` for a billable event, None for the others."""
    if e.type not in (EventType.ALLOCATION_COMPLETED, EventType.NODE_RELEASED):
        return None
    if e.gpus > 0 and e.gpu_hours is not None:
        unit, quantity = "gpu_hours", e.gpu_hours
    else:
        unit, quantity = "node_hours", e.node_hours or 0.0
    return e.tenant, {
        "backend_id": e.event_id,
        "name": _resource_name(e),
        "project": e.project or e.tenant,
        "unit": unit,
        "quantity": round(quantity, 6),
        "start": e.started_at,
        "end": e.ended_at,
        "details": {"event": e.type.value, "user": e.user, "nodes": list(e.nodes)},
    }


# --- the client -----------------------------------------------------------------------


def api_base(url: str) -> str:
    """``https://w.example.com/api/`` from either that or ``https://w.example.com``."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValidationError(
            f"invalid Waldur URL {url!r}",
            hint="Set accounting.waldur_url to an http(s) URL, e.g. https://waldur.example.com/api/.",
        )
    if not base.endswith("/api"):
        base += "/api"
    return base + "/"


class WaldurClient:
    """One aiohttp session to one Waldur. ``timeout`` bounds each request."""

    def __init__(
        self,
        url: str,
        token: SecretStr | None,
        *,
        timeout: float = 10.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base = api_base(url)
        remember(token)  # masked by lattice_common.secrets.redact wherever text is logged
        self._token = token
        self.timeout = timeout
        self._session = session
        self._own_session = session is None

    def __repr__(self) -> str:
        return f"WaldurClient({self.base!r})"

    def set_token(self, token: SecretStr) -> None:
        """Use a rotated token from now on (``SecretResolver.watch`` callback)."""
        remember(token)
        self._token = token

    async def close(self) -> None:
        if self._session is not None and self._own_session:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> WaldurClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- endpoints -----------------------------------------------------------------------

    async def create_order(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", "marketplace-orders/", payload)

    async def add_invoice_item(self, invoice_id: str, item: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", f"invoices/{_seg(invoice_id)}/items/", item)

    async def customer_quotas(self, customer: str) -> Any:
        return await self._call("GET", f"customers/{_seg(customer)}/quotas/", None)

    async def push_event(self, e: AccountingEvent) -> None:
        """Report one event: its order, then its invoice item when it bills."""
        await self.create_order(order_payload(e))
        item = invoice_item(e)
        if item is not None:
            await self.add_invoice_item(*item)

    # -- HTTP ----------------------------------------------------------------------------

    async def _call(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession()
            self._own_session = True
        url = self.base + path
        headers = {"Accept": "application/json"}
        if self._token is not None:
            headers["Authorization"] = f"Token {self._token.get_secret_value()}"
        where = {"url": url, "method": method}
        try:
            async with self._session.request(
                method,
                url,
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            ) as r:
                text = await r.text()
                status = r.status
        except TimeoutError:
            raise WaldurTimeout(
                f"Waldur did not answer {method} {url} within {self.timeout:g}s",
                details=where,
                hint=_HINT,
            ) from None
        except aiohttp.ClientError as e:
            raise WaldurUnreachable(
                f"cannot reach Waldur at {url}: {redact(str(e)) or type(e).__name__}",
                details=where,
                hint=_HINT,
            ) from None
        if status == 409:
            return {}  # already recorded (same backend_id): a replay
        if 200 <= status < 300:
            try:
                return json.loads(text) if text.strip() else {}
            except ValueError:
                return {}
        detail = redact(text.strip())[:200]
        msg = f"Waldur answered {status} to {method} {url}" + (f": {detail}" if detail else "")
        details = {**where, "status": status}
        if status in (401, 403):
            raise WaldurAuthError(
                msg,
                details=details,
                hint="Check the Waldur token (accounting.waldur_token_secret_ref) and its "
                "permissions; it is re-read when it rotates.",
            )
        if status >= 500 or status in (408, 429):
            raise WaldurServerError(msg, details=details, hint=_HINT)
        raise WaldurRejected(
            msg, details=details, hint="The event was refused as invalid; see the detail."
        )


def _seg(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")
