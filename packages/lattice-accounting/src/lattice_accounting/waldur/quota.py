"""Waldur's remaining budget, for the budget factor (f7) of the cost function.

Why this module exists: "When Waldur is available, its remaining_budget() response
takes precedence over the internal ledger. When Waldur is unavailable (transient
failure), the internal ledger provides fallback data" (spec: Quota Enforcement, Waldur
Override). Waldur keeps each customer's (tenant's) quotas with their usage
(``GET /api/customers/{id}/quotas/``); the quotas read here are ``gpu_hours`` and
``node_hours`` (``limit`` -1 or null = no budget).

Interface for the scheduler (the cost function takes ``budget_fraction_used``, tenant
-> fraction of the budget used; see lattice_scheduler.cost.scoring_context)::

    override = BudgetOverride(client, max_age_seconds=120)
    await override.refresh(tenant_names)          # periodically, off the scheduling path
    fractions = merge_fractions(
        override.fractions(now),                  # Waldur's, where fresh
        ledger.budget_utilization(...),           # the internal ledger, for the rest
    )

:func:`remaining_budget` is the single call (raises the client's typed
:class:`~lattice_accounting.waldur.client.WaldurError` when Waldur cannot answer).
Fractions follow the internal ledger's rules (lattice_common.ledger.budget_status):
``used / budget``, a zero budget counts as used up, the worse of GPU-hours and
node-hours drives the penalty.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
from lattice_common import ledger
from lattice_common.types import Tenant

from lattice_accounting.waldur.client import WaldurClient, WaldurError

__all__ = [
    "BudgetOverride",
    "WaldurBudget",
    "budget_from_quotas",
    "merge_fractions",
    "remaining_budget",
]

log = logging.getLogger("lattice.accounting.waldur.quota")

GPU_QUOTA = "gpu_hours"
NODE_QUOTA = "node_hours"


class WaldurBudget(msgspec.Struct, frozen=True, kw_only=True):
    tenant: str
    gpu_hours_budget: float | None = None
    gpu_hours_used: float = 0.0
    node_hours_budget: float | None = None
    node_hours_used: float = 0.0
    fetched_at: float = 0.0

    def status(self) -> ledger.BudgetStatus:
        usage = ledger.Usage(
            since=self.fetched_at,
            until=self.fetched_at,
            window_days=0.0,
            gpu_hours=self.gpu_hours_used,
            node_hours=self.node_hours_used,
        )
        t = Tenant(
            name=self.tenant,
            gpu_hours_budget=self.gpu_hours_budget,
            node_hours_budget=self.node_hours_budget,
        )
        return ledger.budget_status(usage, t)

    @property
    def remaining_budget(self) -> float | None:
        """GPU-hours left (node-hours for a tenant with only a node-hours budget)."""
        s = self.status()
        return (
            s.gpu_hours_remaining if s.gpu_hours_remaining is not None else (s.node_hours_remaining)
        )

    @property
    def fraction_used(self) -> float | None:
        return self.status().fraction


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def budget_from_quotas(tenant: str, quotas: Any, *, now: float) -> WaldurBudget:
    """Read Waldur's quota answer: a list of ``{"name", "limit", "usage"}`` (or a
    mapping name -> ``{"limit", "usage"}``). Unknown quotas are ignored."""
    if isinstance(quotas, Mapping):
        items = [{"name": k, **v} for k, v in quotas.items() if isinstance(v, Mapping)]
    elif isinstance(quotas, list):
        items = [q for q in quotas if isinstance(q, Mapping)]
    else:
        raise ValueError("Waldur quotas must be a list or a mapping")
    found: dict[str, tuple[float | None, float]] = {}
    for q in items:
        name = str(q.get("name", ""))
        if name not in (GPU_QUOTA, NODE_QUOTA):
            continue
        limit = _number(q.get("limit"))
        if limit is not None and limit < 0:
            limit = None  # Waldur's -1: unlimited
        found[name] = (limit, max(0.0, _number(q.get("usage")) or 0.0))
    gb, gu = found.get(GPU_QUOTA, (None, 0.0))
    nb, nu = found.get(NODE_QUOTA, (None, 0.0))
    return WaldurBudget(
        tenant=tenant,
        gpu_hours_budget=gb,
        gpu_hours_used=gu,
        node_hours_budget=nb,
        node_hours_used=nu,
        fetched_at=now,
    )


async def remaining_budget(
    client: WaldurClient, tenant: str, *, now: float | None = None
) -> WaldurBudget:
    """Waldur's budget and usage for ``tenant`` (its customer)."""
    raw = await client.customer_quotas(tenant)
    return budget_from_quotas(tenant, raw, now=time.time() if now is None else now)


def merge_fractions(waldur: Mapping[str, float], internal: Mapping[str, float]) -> dict[str, float]:
    """The cost function's budget map: Waldur's fraction where it has one, the internal
    ledger's for every other tenant."""
    return {**internal, **waldur}


class BudgetOverride:
    """Waldur budgets kept fresh for the scheduler; stale or failed ones fall away so
    that the internal ledger takes over."""

    def __init__(self, client: WaldurClient, *, max_age_seconds: float = 120.0) -> None:
        self.client = client
        self.max_age_seconds = max_age_seconds
        self.budgets: dict[str, WaldurBudget] = {}
        self.last_error = ""

    async def refresh(
        self, tenants: Iterable[str], *, now: float | None = None
    ) -> dict[str, WaldurBudget]:
        """Read every tenant's budget; stop at the first failure (Waldur is down: the
        entries age out and the ledger takes over). A tenant Waldur does not know (a
        rejected request) is forgotten."""
        stamp = time.time() if now is None else now
        for name in tenants:
            try:
                self.budgets[name] = await remaining_budget(self.client, name, now=stamp)
            except WaldurError as e:
                self.last_error = e.message
                log.warning("cannot read Waldur budgets: %s; using the internal ledger", e.message)
                break
            except Exception as e:  # WaldurRejected (404: no such customer), bad answer
                self.budgets.pop(name, None)
                log.info("no Waldur budget for tenant %s: %s", name, e)
        return dict(self.budgets)

    def fractions(self, now: float | None = None) -> dict[str, float]:
        """tenant -> fraction used, for the budgets read within ``max_age_seconds``."""
        t = time.time() if now is None else now
        out: dict[str, float] = {}
        for name, b in self.budgets.items():
            if t - b.fetched_at > self.max_age_seconds:
                continue
            f = b.fraction_used
            if f is not None:
                out[name] = f
        return out
