"""Tenant and user usage (AdminService GetTenantUsage / GetUserUsage, and
``GET /api/v1/tenants/{name}/usage``, ``GET /api/v1/usage``).

Numbers come from the internal budget ledger (:mod:`lattice_common.ledger`) run over
the quorum's committed allocation records in one consistent read
(:func:`lattice_quorum.queries.tenant_usage` / ``user_usage``), with each node's GPU
count taken from the current inventory.

The window is ``days`` (REST) or ``since``/``until`` (gRPC); by default the budget
period, ``scheduling.budget_period_days``. Budget fractions and remaining hours are
always computed over the budget period, whatever window was asked for, because budgets
are per period; with the default window the two coincide.

Who may ask: the permission table lets every role but the agents' in; another user's
usage needs ``allocation.list_all`` (lattice_api.access.usage_user).
"""

from __future__ import annotations

import math
import time
from typing import Any

from lattice_common.errors import NotFound, ValidationError
from lattice_common.ledger import DEFAULT_BUDGET_PERIOD_DAYS, SECONDS_PER_DAY
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api import access
from lattice_api.auth import Identity

MIN_DAYS = 1
MAX_DAYS = 3650
DAYS_HINT = f"Pass days as a number from {MIN_DAYS} to {MAX_DAYS}, e.g. days=90."


def _whole(value: float) -> float:
    return int(value) if float(value).is_integer() else value


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
    return _whole(days)


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


def _tenant_not_found(tenant: str | None) -> NotFound:
    return NotFound(
        f'tenant "{tenant}" not found', hint="List tenants with `lattice admin tenant list`."
    )


class UsageOps:
    def __init__(
        self, quorum: Quorum, *, budget_period_days: float = DEFAULT_BUDGET_PERIOD_DAYS
    ) -> None:
        self.quorum = quorum
        self.period_days = _whole(float(budget_period_days or DEFAULT_BUDGET_PERIOD_DAYS))

    # --- REST shape: days -----------------------------------------------------------

    def tenant_usage(
        self, who: Identity, tenant: str, days: Any = None, *, now: float | None = None
    ) -> dict[str, Any]:
        """A tenant's usage over the last ``days`` (default: the budget period), its
        budgets (fraction used and remaining over the budget period) and its quotas."""
        window = parse_days(days)
        return self._tenant(tenant, window, time.time() if now is None else now)

    def user_usage(
        self,
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
        target = access.usage_user(who, user)
        return self._user(target, window, tenant or None, time.time() if now is None else now)

    # --- gRPC shape: since/until ----------------------------------------------------

    def tenant_usage_between(
        self, who: Identity, tenant: str, since: float, until: float
    ) -> dict[str, Any]:
        """``since``/``until`` (0 = budget period / now) select the window."""
        if not tenant:
            raise ValidationError(
                "GetTenantUsage needs a tenant", hint="Set tenant to a tenant name."
            )
        days, end = window_from_range(since, until, time.time(), self.period_days)
        return self._tenant(tenant, days, end)

    def user_usage_between(
        self, who: Identity, user: str, tenant: str, since: float, until: float
    ) -> dict[str, Any]:
        """``user`` "" = the caller, ``tenant`` "" = every tenant."""
        target = access.usage_user(who, user)
        days, end = window_from_range(since, until, time.time(), self.period_days)
        return self._user(target, days, tenant or None, end)

    # --- the reads ------------------------------------------------------------------

    def _tenant(self, tenant: str, window: float | None, now: float) -> dict[str, Any]:
        self.quorum.require_caught_up()
        out = self.quorum.read(
            queries.tenant_usage,
            tenant,
            window_days=self.period_days if window is None else window,
            period_days=self.period_days,
            now=now,
        )
        if out is None:
            raise _tenant_not_found(tenant)
        return out

    def _user(
        self, user: str, window: float | None, tenant: str | None, now: float
    ) -> dict[str, Any]:
        self.quorum.require_caught_up()
        out = self.quorum.read(
            queries.user_usage,
            user,
            tenant=tenant,
            window_days=self.period_days if window is None else window,
            now=now,
        )
        if out is None:
            raise _tenant_not_found(tenant)
        return out


__all__ = ["MAX_DAYS", "MIN_DAYS", "UsageOps", "parse_days", "window_from_range"]
