"""Tenant and user usage (AdminService GetTenantUsage / GetUserUsage, and
``GET /api/v1/tenants/{name}/usage``, ``GET /api/v1/usage``).

Numbers come from the internal budget ledger (:mod:`lattice_common.ledger`) run over
the quorum's committed allocation records in one consistent read
(:func:`lattice_quorum.queries.tenant_usage` / ``user_usage``), with each node's GPU
count taken from the current inventory. Allocations that ended longer ago than
``storage.allocation_retention_hours`` have left the quorum for the history store
(lattice_common.history): the ``read_*`` methods, which the adapters call, count those
too (the sync methods read the quorum alone).

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
from collections.abc import Callable
from typing import Any

from lattice_common.errors import NotFound, ValidationError
from lattice_common.history import HistoryStore
from lattice_common.ledger import DEFAULT_BUDGET_PERIOD_DAYS, SECONDS_PER_DAY
from lattice_common.types import Allocation
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
        # the history store (lattice_common.history): allocations moved out of the
        # quorum's state count too; set by lattice-server (None: the state alone)
        self.history: HistoryStore | None = None
        # storage.allocation_retention_hours: live allocations that ended longer ago than
        # this (less a margin for clocks) may be in the store too; 0 = any ended one
        self.retention_seconds = 0.0

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

    # --- with the history store (what the gRPC and REST adapters call) --------------

    async def read_tenant_usage(
        self, who: Identity, tenant: str, days: Any = None, *, now: float | None = None
    ) -> dict[str, Any]:
        """:meth:`tenant_usage` counting the history store's allocations too."""
        window = parse_days(days)
        end = time.time() if now is None else now
        w = self.period_days if window is None else window
        return await self._with_sums(
            lambda st, ids: self._tenant(tenant, window, end, stored=st, stored_ids=ids),
            [w, self.period_days],
            end,
        )

    async def read_user_usage(
        self,
        who: Identity,
        user: str | None = None,
        days: Any = None,
        *,
        tenant: str | None = None,
        now: float | None = None,
    ) -> dict[str, Any]:
        """:meth:`user_usage` counting the history store's allocations too."""
        window = parse_days(days)
        target = access.usage_user(who, user)
        end = time.time() if now is None else now
        w = self.period_days if window is None else window
        return await self._with_sums(
            lambda st, ids: self._user(
                target, window, tenant or None, end, stored=st, stored_ids=ids
            ),
            [w],
            end,
            user=target,
        )

    async def read_tenant_usage_between(
        self, who: Identity, tenant: str, since: float, until: float
    ) -> dict[str, Any]:
        if not tenant:
            raise ValidationError(
                "GetTenantUsage needs a tenant", hint="Set tenant to a tenant name."
            )
        days, end = window_from_range(since, until, time.time(), self.period_days)
        return await self._with_sums(
            lambda st, ids: self._tenant(tenant, days, end, stored=st, stored_ids=ids),
            [days, self.period_days],
            end,
        )

    async def read_user_usage_between(
        self, who: Identity, user: str, tenant: str, since: float, until: float
    ) -> dict[str, Any]:
        target = access.usage_user(who, user)
        days, end = window_from_range(since, until, time.time(), self.period_days)
        return await self._with_sums(
            lambda st, ids: self._user(
                target, days, tenant or None, end, stored=st, stored_ids=ids
            ),
            [days],
            end,
            user=target,
        )

    async def _with_sums(
        self,
        compute: Callable[[dict[float, Any] | None, set[str]], dict[str, Any]],
        windows: list[float],
        now: float,
        *,
        user: str | None = None,
    ) -> dict[str, Any]:
        """``compute(sums, stored_ids)``: the quorum's allocations plus the history
        store's ledger sums for each window (summed by the database, one row per tenant
        and user: a request costs what it returns, not the history's size). A live
        allocation the store already holds (stored, its removal not yet applied) is
        counted by the store alone: the ids of the live ended allocations old enough to
        have been stored are looked up first. Should the store's cursor move meanwhile
        (a batch stored), all is read again, so nothing is missed or counted twice."""
        if self.history is None:
            return compute(None, set())
        margin = 600.0  # the leader's clock against this member's
        cutoff = now - self.retention_seconds + margin if self.retention_seconds > 0 else now
        out: dict[str, Any] = {}
        for _ in range(3):
            before = await self.history.cursor()
            candidates = self.quorum.read(_ended_before, cutoff)
            ids = await self.history.stored_ids(candidates) if candidates else set()
            sums = {
                w: await self.history.usage_sums(now - w * SECONDS_PER_DAY, now, user=user)
                for w in dict.fromkeys(windows)
            }
            out = compute(sums, ids)
            if await self.history.cursor() == before:
                return out
        return out

    async def _with_history(
        self,
        compute: Callable[[list[Allocation]], dict[str, Any]],
        window: float | None,
        now: float,
        *,
        user: str | None = None,
    ) -> dict[str, Any]:
        """``compute(records)`` over the quorum plus the store's records that ended
        inside the longest window asked (the budget period or ``window``). The store is
        read before the quorum; a batch moved in between (the cursor moved) is read
        again, so nothing that left the quorum is missed."""
        if self.history is None:
            return compute([])
        days = max(self.period_days, window or 0.0)
        since = now - days * 86400.0
        for _ in range(3):
            before = await self.history.cursor()
            records = await self.history.ended_since(since, user=user)
            out = compute(records)
            if await self.history.cursor() == before:
                return out
        return out

    # --- the reads ------------------------------------------------------------------

    def _tenant(
        self,
        tenant: str,
        window: float | None,
        now: float,
        history: list[Allocation] | None = None,
        *,
        stored: dict[float, Any] | None = None,
        stored_ids: set[str] | None = None,
    ) -> dict[str, Any]:
        self.quorum.require_caught_up()
        out = self.quorum.read(
            queries.tenant_usage,
            tenant,
            window_days=self.period_days if window is None else window,
            period_days=self.period_days,
            now=now,
            history=history or (),
            stored=stored,
            stored_ids=stored_ids or (),
        )
        if out is None:
            raise _tenant_not_found(tenant)
        return out

    def _user(
        self,
        user: str,
        window: float | None,
        tenant: str | None,
        now: float,
        history: list[Allocation] | None = None,
        *,
        stored: dict[float, Any] | None = None,
        stored_ids: set[str] | None = None,
    ) -> dict[str, Any]:
        self.quorum.require_caught_up()
        out = self.quorum.read(
            queries.user_usage,
            user,
            tenant=tenant,
            window_days=self.period_days if window is None else window,
            now=now,
            history=history or (),
            stored=stored,
            stored_ids=stored_ids or (),
        )
        if out is None:
            raise _tenant_not_found(tenant)
        return out


def _ended_before(s: Any, cutoff: float) -> list[str]:
    """A query: the ids of the ended allocations in the state that ended by ``cutoff``
    (the only ones the history sweeper may have stored already)."""
    return [
        a.id
        for a in s.allocations.values()
        if a.terminal and a.finished_at is not None and a.finished_at <= cutoff
    ]


__all__ = ["MAX_DAYS", "MIN_DAYS", "UsageOps", "parse_days", "window_from_range"]
