"""The INTERNAL HTTP API of lattice-accounting, for lattice-server only.

Every route but ``/healthz`` needs ``Authorization: Bearer <accounting.service_token>``
(compared in constant time, never logged). Users never call it: lattice-server checks
their identity and permissions (lattice_api.ops.accounting) and calls these routes with
the service token. Errors travel as ``{"error": LatticeError.to_dict()}`` with the
error's HTTP status, so the API re-raises the very same typed error with its hint.

==========================================  =============================================
route                                       what
==========================================  =============================================
``POST /v1/reservations``                   the gate: reserve a submission's estimate
``DELETE /v1/reservations/{key}``           the proposal failed: release it
``GET /v1/balance?tenant=&project=``        available, reserved, spent
``POST /v1/topup``                          ``{tenant, amount, who}``
``POST /v1/transfer``                       ``{tenant, project, amount, who}``
``GET /v1/transactions``                    filters: tenant project allocation kind user
                                            since until limit before_id
``GET /v1/costs?by=&tenant=&since=&until=``  breakdown by tenant|project|user|vcluster|day
``GET /v1/allocations/costs?ids=a,b``       what each allocation cost
``GET /v1/prices`` / ``POST /v1/prices``    the price list / a new price
``GET /v1/status``                          consumer, cursor, last pass, Waldur push
``POST /v1/reconcile``                      ``{since, until}``: check the books; with
                                            Waldur, regenerate the range's events
==========================================  =============================================
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from aiohttp import web
from lattice_common.errors import LatticeError, Unauthenticated, ValidationError

from lattice_accounting.gate import GateRequest
from lattice_accounting.money import fmt
from lattice_accounting.prices import Price
from lattice_accounting.service import AccountingService

log = logging.getLogger("lattice.accounting.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_time(value: Any, what: str) -> datetime | None:
    """ISO 8601 (a date alone is midnight UTC) or epoch seconds; None when not given."""
    if value in (None, ""):
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return datetime.fromtimestamp(float(value), UTC)
    text = str(value).strip()
    try:
        return datetime.fromtimestamp(float(text), UTC)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValidationError(
            f"{what} is not a time",
            details={what: text},
            hint="Give an ISO 8601 date or time (2026-03-01, 2026-03-01T12:00:00Z).",
        ) from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def parse_decimal(value: Any, what: str, default: Decimal | None = None) -> Decimal:
    if value in (None, "") and default is not None:
        return default
    if isinstance(value, bool | float):
        value = repr(value)
    try:
        d = Decimal(str(value).strip())
    except (InvalidOperation, ValueError):
        raise ValidationError(
            f"{what} is not a number",
            details={what: str(value)},
            hint=f"Give {what} as a decimal number, e.g. 5.00.",
        ) from None
    if not d.is_finite():
        raise ValidationError(f"{what} is not a finite number", details={what: str(value)})
    return d


def _error(e: LatticeError) -> web.Response:
    return web.json_response({"error": e.to_dict()}, status=e.http_status)


def _money(d: Decimal) -> str:
    return fmt(d)


def build_app(
    svc: AccountingService,
    token: str,
    *,
    waldur: Any = None,
) -> web.Application:
    """``waldur``: the Waldur pusher when ``provider: waldur`` (status and reconcile)."""
    expected = token.encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if request.path != "/healthz":
                got = request.headers.get("Authorization", "")
                scheme, _, value = got.partition(" ")
                if (
                    not expected
                    or scheme.lower() != "bearer"
                    or not hmac.compare_digest(value.strip().encode(), expected)
                ):
                    raise Unauthenticated(
                        "the accounting service needs its service token",
                        hint="lattice-server sends accounting.service_token; set the same "
                        "value on both (LATTICE_ACCOUNTING__SERVICE_TOKEN).",
                    )
            return await handler(request)
        except LatticeError as e:
            return _error(e)
        except web.HTTPException:
            raise
        except Exception:
            log.exception("internal API %s %s failed", request.method, request.path)
            return _error(LatticeError("accounting service error", hint="See its log."))

    app = web.Application(middlewares=[guard])
    ledger = svc.ledger

    async def body(request: web.Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError:
            raise ValidationError("the request body is not JSON") from None
        if not isinstance(data, dict):
            raise ValidationError("the request body must be a JSON object")
        return data

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "synced": svc.synced})

    async def reserve(request: web.Request) -> web.Response:
        return web.json_response(await svc.reserve(GateRequest.from_json(await body(request))))

    async def unreserve(request: web.Request) -> web.Response:
        return web.json_response(await svc.unreserve(request.match_info["key"]))

    async def balance(request: web.Request) -> web.Response:
        q = request.query
        tenant, project = q.get("tenant", ""), q.get("project", "")
        ref = f"{tenant}/{project}" if project else tenant
        b = await ledger.balance(ref)
        return web.json_response(
            {
                "account": b.account,
                "tenant": tenant,
                "project": project,
                "available": _money(b.available),
                "reserved": _money(b.reserved),
                "spent": _money(b.spent),
                "allocated": _money(b.allocated),
            }
        )

    async def topup(request: web.Request) -> web.Response:
        d = await body(request)
        tenant = str(d.get("tenant") or "")
        await ledger.open_tenant(tenant)
        jid = await ledger.topup(tenant, d.get("amount"), who=d.get("who"))
        return web.json_response({"journal_id": jid, **_bal(await ledger.balance(tenant))})

    async def transfer(request: web.Request) -> web.Response:
        d = await body(request)
        tenant, project = str(d.get("tenant") or ""), str(d.get("project") or "default")
        await ledger.balance(tenant)  # an unknown tenant: NotFound, nothing opened
        await ledger.open_project(tenant, project)
        jid = await ledger.transfer(tenant, project, d.get("amount"), who=d.get("who"))
        return web.json_response(
            {"journal_id": jid, **_bal(await ledger.balance(f"{tenant}/{project}"))}
        )

    async def transactions(request: web.Request) -> web.Response:
        q = request.query
        page = await ledger.transactions(
            tenant=q.get("tenant") or None,
            project=q.get("project") or None,
            allocation_id=q.get("allocation") or None,
            kind=q.get("kind") or None,
            user=q.get("user") or None,
            since=parse_time(q.get("since"), "since"),
            until=parse_time(q.get("until"), "until"),
            limit=_int(q.get("limit"), "limit", 100),
            before_id=_int(q.get("before_id"), "before_id", None),
        )
        return web.json_response(
            {
                "transactions": [
                    {
                        "id": t.id,
                        "at": t.at.isoformat(),
                        "kind": t.kind,
                        "amount": str(t.amount),
                        "allocation_id": t.allocation_id,
                        "tenant": t.tenant,
                        "project": t.project,
                        "user": t.user,
                        "vcluster": t.vcluster,
                        "who": t.who,
                        "properties": t.properties,
                        "legs": [{"account": g.account, "amount": str(g.amount)} for g in t.legs],
                    }
                    for t in page.items
                ],
                "next_before_id": page.next_before_id,
            }
        )

    async def costs(request: web.Request) -> web.Response:
        q = request.query
        rows = await ledger.costs(
            q.get("by", "project"),
            tenant=q.get("tenant") or None,
            project=q.get("project") or None,
            since=parse_time(q.get("since"), "since"),
            until=parse_time(q.get("until"), "until"),
        )
        return web.json_response(
            {
                "by": q.get("by", "project"),
                "costs": [{"key": k, "amount": _money(v)} for k, v in rows],
            }
        )

    async def allocation_costs(request: web.Request) -> web.Response:
        ids = [i for i in request.query.get("ids", "").split(",") if i]
        return web.json_response({"costs": await svc.allocation_costs(ids)})

    async def list_prices(request: web.Request) -> web.Response:
        ps = await ledger.prices(request.query.get("vcluster") or None)
        return web.json_response({"prices": [_price(p) for p in ps]})

    async def add_price(request: web.Request) -> web.Response:
        d = await body(request)
        p = Price(
            vcluster=str(d.get("vcluster") or ""),
            resource=str(d.get("resource") or "node_hour"),
            rate=parse_decimal(d.get("rate"), "rate"),
            valid_from=parse_time(d.get("valid_from"), "valid_from") or svc.clock(),
            valid_until=parse_time(d.get("valid_until"), "valid_until"),
            gpu_type=str(d.get("gpu_type") or ""),
            tenant=str(d.get("tenant") or ""),
            multiplier=parse_decimal(d.get("multiplier"), "multiplier", Decimal(1)),
            fixed_cost=parse_decimal(d.get("fixed_cost"), "fixed_cost", Decimal(0)),
        )
        if not p.vcluster:
            raise ValidationError("a price needs a vCluster", hint="Give --vcluster NAME.")
        saved = await ledger.add_price(p, who=d.get("who"))
        svc.prices_changed()
        return web.json_response(_price(saved))

    async def status(_: web.Request) -> web.Response:
        out = await svc.status()
        out["provider"] = "waldur" if waldur is not None else "none"
        if waldur is not None:
            out["waldur"] = waldur.status().to_dict()
        return web.json_response(out)

    async def reconcile(request: web.Request) -> web.Response:
        d = await body(request)
        since = parse_time(d.get("since"), "since")
        until = parse_time(d.get("until"), "until")
        if since is None or until is None or until <= since:
            raise ValidationError(
                "reconcile needs --since before --until",
                hint="e.g. lattice admin accounting reconcile --since 2026-03-01 --until 2026-03-02",
            )
        problems = await ledger.verify()
        out: dict[str, Any] = {
            "since": since.isoformat(),
            "until": until.isoformat(),
            "discrepancies": [
                {
                    "what": p.what,
                    "subject": p.subject,
                    "expected": str(p.expected),
                    "actual": str(p.actual),
                }
                for p in problems
            ],
            "events_queued": 0,
        }
        if waldur is not None:
            from lattice_accounting.waldur.feed import reconcile as regenerate

            out["events_queued"] = regenerate(
                waldur,
                svc.mirror.allocations.values(),
                since=since.timestamp(),
                until=until.timestamp(),
                nodes=svc.mirror.nodes,
            )
        return web.json_response(out)

    r = app.router
    r.add_get("/healthz", healthz)
    r.add_post("/v1/reservations", reserve)
    r.add_delete("/v1/reservations/{key}", unreserve)
    r.add_get("/v1/balance", balance)
    r.add_post("/v1/topup", topup)
    r.add_post("/v1/transfer", transfer)
    r.add_get("/v1/transactions", transactions)
    r.add_get("/v1/costs", costs)
    r.add_get("/v1/allocations/costs", allocation_costs)
    r.add_get("/v1/prices", list_prices)
    r.add_post("/v1/prices", add_price)
    r.add_get("/v1/status", status)
    r.add_post("/v1/reconcile", reconcile)
    return app


def _bal(b: Any) -> dict[str, str]:
    return {
        "available": _money(b.available),
        "reserved": _money(b.reserved),
        "spent": _money(b.spent),
    }


def _int(value: Any, what: str, default: int | None) -> Any:
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ValidationError(f"{what} must be a whole number", details={what: value}) from None


def _price(p: Price) -> dict[str, Any]:
    return {
        "id": p.id,
        "vcluster": p.vcluster,
        "resource": p.resource,
        "gpu_type": p.gpu_type,
        "tenant": p.tenant,
        "rate": str(p.rate),
        "multiplier": str(p.multiplier),
        "fixed_cost": str(p.fixed_cost),
        "valid_from": p.valid_from.isoformat(),
        "valid_until": p.valid_until.isoformat() if p.valid_until else None,
    }


__all__ = ["build_app", "parse_decimal", "parse_time"]
