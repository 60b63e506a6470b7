"""Tenant and user usage: GetTenantUsage / GetUserUsage and their REST routes.

``GET /api/v1/tenants/{id}/usage?days=90`` and ``GET /api/v1/usage?user=alice&days=90``
(spec: Quota Enforcement, API Access). Numbers come from the internal budget ledger
(:mod:`lattice_common.ledger`) run over the quorum's committed allocation records in
one consistent read, with each node's GPU count taken from the current inventory.

``days`` is the rolling window (default: the budget period,
``scheduling.budget_period_days``, 90). Budget fractions and remaining hours are always
computed over the budget period, whatever window was asked for, because budgets are per
period; with the default window the two coincide.

Who may ask: anyone (but an agent) for their own usage; another user's needs the
``allocation.list_all`` permission; a tenant's needs ``tenant.read``.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import msgspec
from lattice_common.errors import NotFound, ValidationError
from lattice_common.ledger import (
    DEFAULT_BUDGET_PERIOD_DAYS,
    SECONDS_PER_DAY,
    budget_status,
    node_gpu_counts,
    usage,
    usage_by,
)

from lattice_api.auth import Identity, authorize

if TYPE_CHECKING:
    from aiohttp import web
    from lattice_common.proto.lattice import v1

    from lattice_api.service import LatticeService

MIN_DAYS = 1
MAX_DAYS = 3650
DAYS_HINT = f"Pass days as a number from {MIN_DAYS} to {MAX_DAYS}, e.g. days=90."


# --------------------------------------------------------------------------- validation


def period_days(service: Any) -> float:
    """The budget period of this server (``scheduling.budget_period_days``; default 90)."""
    value = float(getattr(service, "budget_period_days", None) or DEFAULT_BUDGET_PERIOD_DAYS)
    return int(value) if value.is_integer() else value


def parse_days(value: Any) -> float | None:
    """``days`` from a query string or a JSON/Python value; None when not given.

    Raises ValidationError (with a hint) unless it is a number from 1 to 3650."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise ValidationError(f"days must be a number, not {value!r}", hint=DAYS_HINT)
    try:
        days = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise ValidationError(f"days must be a number, not {value!r}", hint=DAYS_HINT) from None
    if not math.isfinite(days) or not MIN_DAYS <= days <= MAX_DAYS:
        raise ValidationError(
            f"days must be between {MIN_DAYS} and {MAX_DAYS} (got {value})",
            details={"days": value, "min": MIN_DAYS, "max": MAX_DAYS},
            hint=DAYS_HINT,
        )
    return int(days) if days.is_integer() else days


def window_from_range(
    since: float, until: float, now: float, default_days: float
) -> tuple[float, float]:
    """(window_days, window_end) of a gRPC request's ``since``/``until`` (0 = the current
    accounting period / now). The window never reaches past ``now``."""
    end = min(until, now) if until else now
    if not since:
        return default_days, end
    if not (math.isfinite(since) and math.isfinite(end)) or since >= end:
        raise ValidationError(
            "since must be before until (and before now)",
            details={"since": since, "until": until or now},
            hint="Pass since < until as Unix times in seconds; 0 means the default.",
        )
    days = (end - since) / SECONDS_PER_DAY
    if days > MAX_DAYS:
        raise ValidationError(
            f"the window spans {days:.0f} days; at most {MAX_DAYS} are allowed",
            details={"days": round(days, 3), "max": MAX_DAYS},
            hint="Use a later since.",
        )
    return days, end


# --------------------------------------------------------------------------- operations


def _usage_fields(u: Any) -> dict[str, Any]:
    return {
        "node_hours": u.node_hours,
        "gpu_hours": u.gpu_hours,
        "allocations": u.allocations,
        "running_allocations": u.running_allocations,
        "nodes_in_use": u.nodes_in_use,
    }


def tenant_usage(
    service: LatticeService,
    who: Identity,
    tenant: str,
    days: Any = None,
    *,
    now: float | None = None,
) -> dict[str, Any]:
    """A tenant's usage over the last ``days`` (default: the budget period), its budgets
    (fraction used and remaining over the budget period) and its quotas."""
    authorize(who, "tenant.read")
    window = parse_days(days)
    return _tenant_usage(service, tenant, window, time.time() if now is None else now)


def _tenant_usage(
    service: LatticeService, tenant: str, window: float | None, now: float
) -> dict[str, Any]:
    period = period_days(service)
    window = period if window is None else window
    service.member.require_caught_up()

    def pick(s: Any) -> dict[str, Any] | None:
        t = s.tenants.get(tenant)
        if t is None:
            return None
        inv = node_gpu_counts(s.nodes.values())
        allocs = s.allocations.values()
        u = usage(allocs, now=now, window_days=window, tenant=tenant, node_gpus=inv)
        p = (
            u
            if window == period
            else usage(allocs, now=now, window_days=period, tenant=tenant, node_gpus=inv)
        )
        total = usage(allocs, now=now, window_days=window, node_gpus=inv).node_hours
        users = usage_by(allocs, "user", now=now, window_days=window, tenant=tenant, node_gpus=inv)
        b = budget_status(p, t)
        return {
            "tenant": tenant,
            "days": window,
            "since": u.since,
            "until": u.until,
            **_usage_fields(u),
            "max_nodes": t.max_nodes,
            "max_concurrent_allocations": t.max_concurrent_allocations,
            "fair_share_target": t.fair_share_target,
            "fair_share_usage": u.node_hours / total if total > 0 else 0.0,
            "budget_period_days": period,
            "node_hours_used": p.node_hours,
            "gpu_hours_used": p.gpu_hours,
            "node_hours_budget": t.node_hours_budget,
            "gpu_hours_budget": t.gpu_hours_budget,
            "budget_fraction_used": b.fraction,
            "node_budget_fraction": b.node_fraction,
            "gpu_budget_fraction": b.gpu_fraction,
            "node_hours_remaining": b.node_hours_remaining,
            "gpu_hours_remaining": b.gpu_hours_remaining,
            "budget_source": "internal",
            "users": [
                {"user": name, **_usage_fields(x)}
                for name, x in sorted(users.items(), key=lambda kv: (-kv[1].node_hours, kv[0]))
            ],
        }

    out = service.member.read(pick)
    if out is None:
        raise NotFound(
            f'tenant "{tenant}" not found', hint="List tenants with `lattice admin tenant list`."
        )
    return out


def user_usage(
    service: LatticeService,
    who: Identity,
    user: str | None = None,
    days: Any = None,
    *,
    tenant: str | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """A user's usage (default: the caller's) over the last ``days`` (default: the
    budget period), in all tenants or only ``tenant``, with a per-tenant breakdown."""
    window = parse_days(days)
    target = _authorize_user(who, user)
    return _user_usage(service, target, window, tenant or None, time.time() if now is None else now)


def _authorize_user(who: Identity, user: str | None) -> str:
    authorize(who, "tenant.read")  # every role but the node agents'
    target = (user or "").strip() or who.user
    if target != who.user:
        authorize(who, "allocation.list_all")
    return target


def _user_usage(
    service: LatticeService, user: str, window: float | None, tenant: str | None, now: float
) -> dict[str, Any]:
    window = period_days(service) if window is None else window
    service.member.require_caught_up()

    def pick(s: Any) -> dict[str, Any] | None:
        if tenant is not None and tenant not in s.tenants:
            return None
        inv = node_gpu_counts(s.nodes.values())
        allocs = s.allocations.values()
        u = usage(allocs, now=now, window_days=window, tenant=tenant, user=user, node_gpus=inv)
        by_tenant = usage_by(
            allocs, "tenant", now=now, window_days=window, tenant=tenant, user=user, node_gpus=inv
        )
        return {
            "user": user,
            "tenant": tenant or "",
            "days": window,
            "since": u.since,
            "until": u.until,
            **_usage_fields(u),
            "tenants": [{"tenant": name, **_usage_fields(x)} for name, x in by_tenant.items()],
        }

    out = service.member.read(pick)
    if out is None:
        raise NotFound(
            f'tenant "{tenant}" not found', hint="List tenants with `lattice admin tenant list`."
        )
    return out


# --------------------------------------------------------------------------- REST

_json = msgspec.json.Encoder()


def _response(data: Any) -> web.Response:
    from aiohttp import web

    return web.Response(body=_json.encode(data), content_type="application/json")


def add_rest_routes(router: web.UrlDispatcher, service: LatticeService) -> None:
    """``GET /api/v1/tenants/{name}/usage?days=N`` and
    ``GET /api/v1/usage?user=U&tenant=T&days=N`` (identity set by the REST middleware)."""

    async def get_tenant_usage(request: web.Request) -> web.Response:
        return _response(
            tenant_usage(
                service,
                request[_identity_key()],
                request.match_info["name"],
                request.query.get("days"),
            )
        )

    async def get_user_usage(request: web.Request) -> web.Response:
        q = request.query
        return _response(
            user_usage(
                service,
                request[_identity_key()],
                q.get("user") or None,
                q.get("days"),
                tenant=q.get("tenant") or None,
            )
        )

    router.add_get("/api/v1/tenants/{name}/usage", get_tenant_usage)
    router.add_get("/api/v1/usage", get_user_usage)


# --------------------------------------------------------------------------- gRPC


def grpc_tenant_usage(
    service: LatticeService, who: Identity, message: v1.GetTenantUsageRequest
) -> v1.TenantUsage:
    """AdminService.GetTenantUsage: ``since``/``until`` (0 = budget period / now) select
    the window; the reply carries the proto's fields of :func:`tenant_usage`."""
    from lattice_common.proto.lattice import v1

    authorize(who, "tenant.read")
    if not message.tenant:
        raise ValidationError("GetTenantUsage needs a tenant", hint="Set tenant to a tenant name.")
    days, end = window_from_range(message.since, message.until, time.time(), period_days(service))
    d = _tenant_usage(service, message.tenant, days, end)
    return v1.TenantUsage(
        tenant=d["tenant"],
        node_hours=d["node_hours"],
        gpu_hours=d["gpu_hours"],
        node_hours_budget=d["node_hours_budget"],
        gpu_hours_budget=d["gpu_hours_budget"],
        nodes_in_use=d["nodes_in_use"],
        max_nodes=d["max_nodes"],
        running_allocations=d["running_allocations"],
        max_concurrent_allocations=d["max_concurrent_allocations"],
        fair_share_target=d["fair_share_target"],
        fair_share_usage=d["fair_share_usage"],
    )


def grpc_user_usage(
    service: LatticeService, who: Identity, message: v1.GetUserUsageRequest
) -> v1.UserUsage:
    """AdminService.GetUserUsage: ``user`` "" = the caller, ``tenant`` "" = all."""
    from lattice_common.proto.lattice import v1

    target = _authorize_user(who, message.user)
    days, end = window_from_range(message.since, message.until, time.time(), period_days(service))
    d = _user_usage(service, target, days, message.tenant or None, end)
    return v1.UserUsage(
        user=d["user"],
        tenant=d["tenant"],
        node_hours=d["node_hours"],
        gpu_hours=d["gpu_hours"],
        allocations=d["allocations"],
    )


__all__ = [
    "MAX_DAYS",
    "MIN_DAYS",
    "add_rest_routes",
    "grpc_tenant_usage",
    "grpc_user_usage",
    "parse_days",
    "period_days",
    "tenant_usage",
    "user_usage",
    "window_from_range",
]


def _identity_key() -> web.RequestKey[Identity]:
    from lattice_api.rest import IDENTITY  # rest imports this module: resolve at call time

    return IDENTITY
