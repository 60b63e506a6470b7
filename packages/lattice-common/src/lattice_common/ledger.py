"""The internal budget ledger: node-hours and GPU-hours from committed allocation records.

Specification (Quota Enforcement, "Internal Budget Ledger")::

    node_hours_used = Σ (end_time - started_at).hours × assigned_nodes.len()
    gpu_hours_used  = Σ (end_time - started_at).hours × Σ gpu_count_per_node

* running allocations (Staging/Running/Checkpointing): ``end_time = now``;
  completed/failed/cancelled ones: ``end_time = finished_at``;
* only the part of ``[started_at, end_time]`` inside the rolling window
  ``[now - budget_period_days, now]`` counts (``scheduling.budget_period_days``,
  default 90; a rolling window, not a calendar reset);
* a node's GPU count comes from the current hardware inventory (``node_gpus``); for a
  node not in it, the allocation's ``gpu_count`` constraint, and 1 GPU when that is 0
  too ("unknown nodes default to 1 GPU"). A node known to have no GPU adds 0 GPU-hours:
  node-hours is the universal metric;
* when both ``gpu_hours_budget`` and ``node_hours_budget`` are set, the worse (higher)
  fraction used drives the budget penalty (:func:`budget_fraction`).

Everything here is a pure function of its arguments: no clock (``now`` is passed in), no
I/O, and sums taken with :func:`math.fsum` (exactly rounded, so the order of the records
never changes a result). Allocations that were never started (Pending, or requeued and
waiting again) and Suspended ones (their nodes were released and the record keeps no
suspension time) contribute nothing.

The scheduler feeds :func:`budget_utilization` into the cost function; the API serves
:func:`usage` / :func:`usage_by` through GetTenantUsage / GetUserUsage and
``/api/v1/tenants/{id}/usage`` / ``/api/v1/usage``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec

from lattice_common.types import (
    HOLDING_STATES,
    TERMINAL_STATES,
    Allocation,
    LedgerDay,
    Node,
    Tenant,
)

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
DEFAULT_BUDGET_PERIOD_DAYS = 90  # spec: scheduling.budget_period_days
UNKNOWN_NODE_GPUS = 1  # spec: "unknown nodes default to 1 GPU"


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Consumption over the window ``[since, until]`` (``until`` is ``now``)."""

    since: float
    until: float
    window_days: float
    node_hours: float = 0.0
    gpu_hours: float = 0.0
    allocations: int = 0  # allocations that ran (at least partly) in the window
    running_allocations: int = 0  # holding nodes now (Staging/Running/Checkpointing)
    nodes_in_use: int = 0  # nodes held by those now


class BudgetStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's soft budgets against a usage (fractions are ``used / budget``)."""

    gpu_hours_budget: float | None = None
    node_hours_budget: float | None = None
    gpu_fraction: float | None = None  # None: no GPU-hours budget
    node_fraction: float | None = None  # None: no node-hours budget
    fraction: float | None = None  # the worse of the two; None: no budget at all
    gpu_hours_remaining: float | None = None  # max(0, budget - used)
    node_hours_remaining: float | None = None


def node_gpu_counts(nodes: Iterable[Node]) -> dict[str, int]:
    """The hardware inventory the ledger needs: node id -> GPUs on that node."""
    return {n.id: max(0, int(n.capabilities.gpu_count)) for n in nodes}


def _gpus_per_node(a: Allocation, node_id: str | None, node_gpus: Mapping[str, int] | None) -> int:
    if node_id is not None and node_gpus is not None:
        known = node_gpus.get(node_id)
        if known is not None:
            return max(0, int(known))
    requested = a.spec.constraints.gpu_count
    return requested if requested > 0 else UNKNOWN_NODE_GPUS


def node_and_gpu_count(
    a: Allocation, node_gpus: Mapping[str, int] | None = None
) -> tuple[int, int]:
    """(nodes, GPUs) an allocation holds: its assigned nodes, or ``spec.nodes`` when the
    record has none (then each node counts the requested GPUs, or 1)."""
    if a.assigned_nodes:
        nodes = list(dict.fromkeys(a.assigned_nodes))  # a node counts once
        return len(nodes), sum(_gpus_per_node(a, n, node_gpus) for n in nodes)
    n = max(0, int(a.spec.nodes))
    return n, n * _gpus_per_node(a, None, node_gpus)


def _running(a: Allocation) -> bool:
    return a.state in HOLDING_STATES


def window_seconds_of(a: Allocation, *, now: float, window_days: float) -> float | None:
    """Seconds of the allocation's run inside ``[now - window_days, now]``; None when it
    did not run in the window at all (0.0 when it touched the window for no time)."""
    start = a.started_at
    if start is None or not math.isfinite(start) or start > now:
        return None
    if _running(a):
        end = now
    elif a.state in TERMINAL_STATES and a.finished_at is not None:
        end = min(a.finished_at, now)
    else:  # Pending / Suspended, or a terminal record without an end time
        return None
    window = window_days * SECONDS_PER_DAY
    ago = now - end  # how long before `now` it ended (0 while running)
    if not ago <= window:  # ended before the window opened (also catches NaN)
        return None
    # min(end - start, end - since), written so that a running allocation's share is
    # min(now - start, window): non-decreasing in `now`, never more than the window
    return max(0.0, min(end - start, window - ago))


def allocation_hours(
    a: Allocation,
    *,
    now: float,
    window_days: float,
    node_gpus: Mapping[str, int] | None = None,
) -> tuple[float, float] | None:
    """(node_hours, gpu_hours) one allocation used in the window, or None if it did not
    run in it."""
    secs = window_seconds_of(a, now=now, window_days=window_days)
    if secs is None:
        return None
    nodes, gpus = node_and_gpu_count(a, node_gpus)
    hours = secs / SECONDS_PER_HOUR
    return hours * nodes, hours * gpus


class _Acc:
    __slots__ = ("allocations", "gpu", "node", "nodes_in_use", "running")

    def __init__(self) -> None:
        self.node: list[float] = []
        self.gpu: list[float] = []
        self.allocations = 0
        self.running = 0
        self.nodes_in_use = 0

    def add(
        self, a: Allocation, now: float, window_days: float, node_gpus: Mapping[str, int] | None
    ) -> None:
        hours = allocation_hours(a, now=now, window_days=window_days, node_gpus=node_gpus)
        if hours is not None:
            self.node.append(hours[0])
            self.gpu.append(hours[1])
            self.allocations += 1
        if _running(a):
            self.running += 1
            self.nodes_in_use += len(set(a.assigned_nodes)) or max(0, int(a.spec.nodes))

    def usage(self, now: float, window_days: float) -> Usage:
        return Usage(
            since=now - window_days * SECONDS_PER_DAY,
            until=now,
            window_days=window_days,
            node_hours=math.fsum(self.node),
            gpu_hours=math.fsum(self.gpu),
            allocations=self.allocations,
            running_allocations=self.running,
            nodes_in_use=self.nodes_in_use,
        )


def _check_window(window_days: float) -> None:
    if not (isinstance(window_days, int | float) and math.isfinite(window_days)):
        raise ValueError(f"window_days must be a finite number, got {window_days!r}")
    if window_days <= 0:
        raise ValueError(f"window_days must be greater than zero, got {window_days!r}")


def usage(
    records: Iterable[Allocation],
    *,
    now: float,
    window_days: float = DEFAULT_BUDGET_PERIOD_DAYS,
    tenant: str | None = None,
    user: str | None = None,
    node_gpus: Mapping[str, int] | None = None,
) -> Usage:
    """Usage of the records matching ``tenant`` / ``user`` (None = any) over the rolling
    window ``[now - window_days, now]``."""
    _check_window(window_days)
    acc = _Acc()
    for a in records:
        if tenant is not None and a.spec.tenant != tenant:
            continue
        if user is not None and a.spec.user != user:
            continue
        acc.add(a, now, window_days, node_gpus)
    return acc.usage(now, window_days)


def usage_by(
    records: Iterable[Allocation],
    key: Literal["tenant", "user"],
    *,
    now: float,
    window_days: float = DEFAULT_BUDGET_PERIOD_DAYS,
    tenant: str | None = None,
    user: str | None = None,
    node_gpus: Mapping[str, int] | None = None,
) -> dict[str, Usage]:
    """One pass, grouped by ``spec.tenant`` or ``spec.user``; only groups with an
    allocation that ran in the window or holds nodes now, sorted by name."""
    if key not in ("tenant", "user"):
        raise ValueError(f"key must be 'tenant' or 'user', got {key!r}")
    _check_window(window_days)
    accs: dict[str, _Acc] = {}
    for a in records:
        if tenant is not None and a.spec.tenant != tenant:
            continue
        if user is not None and a.spec.user != user:
            continue
        name = a.spec.tenant if key == "tenant" else a.spec.user
        acc = accs.get(name)
        if acc is None:
            acc = accs[name] = _Acc()
        acc.add(a, now, window_days, node_gpus)
    return {
        name: accs[name].usage(now, window_days)
        for name in sorted(accs)
        if accs[name].allocations or accs[name].running
    }


def _fraction(used: float, budget: float) -> float:
    if budget > 0:
        return used / budget
    return 1.0  # a zero budget is exhausted from the start


def budget_status(u: Usage, tenant: Tenant) -> BudgetStatus:
    """Fractions used and hours remaining of the tenant's soft budgets.

    ``u`` should span the budget period (``scheduling.budget_period_days``); budgets are
    per period, and the ledger does not rescale them to other windows."""
    gb, nb = tenant.gpu_hours_budget, tenant.node_hours_budget
    gf = _fraction(u.gpu_hours, gb) if gb is not None else None
    nf = _fraction(u.node_hours, nb) if nb is not None else None
    present = [f for f in (gf, nf) if f is not None]
    return BudgetStatus(
        gpu_hours_budget=gb,
        node_hours_budget=nb,
        gpu_fraction=gf,
        node_fraction=nf,
        fraction=max(present) if present else None,
        gpu_hours_remaining=max(0.0, gb - u.gpu_hours) if gb is not None else None,
        node_hours_remaining=max(0.0, nb - u.node_hours) if nb is not None else None,
    )


def budget_fraction(u: Usage, tenant: Tenant) -> float | None:
    """The worse (higher) of ``gpu_hours / gpu_hours_budget`` and
    ``node_hours / node_hours_budget``; None when the tenant has neither budget.
    A budget of 0 counts as fully used (1.0)."""
    return budget_status(u, tenant).fraction


def budget_utilization(
    records: Iterable[Allocation],
    tenants: Iterable[Tenant],
    *,
    now: float,
    period_days: float = DEFAULT_BUDGET_PERIOD_DAYS,
    node_gpus: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """The cost function's budget map: tenant name -> fraction of its budget used over
    the period, for every tenant that has a budget (tenants without one are absent).

    ``records`` are the allocations still in the state; what already left it is each
    tenant's ``retired_usage`` (:func:`retire`), added here, so the fraction does not
    change when an allocation leaves the state."""
    by_tenant = usage_by(records, "tenant", now=now, window_days=period_days, node_gpus=node_gpus)
    empty = Usage(since=now - period_days * SECONDS_PER_DAY, until=now, window_days=period_days)
    out: dict[str, float] = {}
    for t in tenants:
        if t.gpu_hours_budget is None and t.node_hours_budget is None:
            continue
        u = by_tenant.get(t.name, empty)
        if t.retired_usage:
            node_h, gpu_h, n = retired_hours(t.retired_usage, now=now, period_days=period_days)
            u = msgspec.structs.replace(
                u,
                node_hours=u.node_hours + node_h,
                gpu_hours=u.gpu_hours + gpu_h,
                allocations=u.allocations + n,
            )
        f = budget_fraction(u, t)
        if f is not None:
            out[t.name] = f
    return out


# --- retired usage: the ledger's totals of allocations that left the state ---------
#
# An allocation leaves the quorum's state 24 h after it ended (lattice_quorum.retention);
# the budget period is 90 days. Its share of the rolling window is kept as per-UTC-day
# totals on its tenant: the run split over the days it covered (node- and GPU-seconds,
# GPUs from the inventory at removal), and the day it ended counted once. A window
# [now - period, now] then reads whole days, and the one day its start falls in
# pro rata (the only approximation: at most that day's retired usage, at the far edge
# of the window). Days wholly before any window that can be asked for are dropped.


def _day(t: float) -> int:
    return math.floor(t / SECONDS_PER_DAY)


def retire(
    days: dict[int, LedgerDay], a: Allocation, node_gpus: Mapping[str, int] | None = None
) -> None:
    """Add an ended allocation's run to ``days`` (changed in place; a pure function of
    its arguments, so every quorum member computes the same totals). One never
    started, or without an end, adds nothing."""
    start, end = a.started_at, a.finished_at
    if a.state not in TERMINAL_STATES or start is None or end is None:
        return
    if not (math.isfinite(start) and math.isfinite(end)) or end < start:
        return
    nodes, gpus = node_and_gpu_count(a, node_gpus)
    first, last = _day(start), _day(end)
    for d in range(first, last + 1):
        lo = max(start, d * SECONDS_PER_DAY)
        hi = min(end, (d + 1) * SECONDS_PER_DAY)
        secs = max(0.0, hi - lo)
        b = days.get(d)
        if b is None:
            b = days[d] = LedgerDay()
        b.node_seconds += secs * nodes
        b.gpu_seconds += secs * gpus
        if d == last:
            b.allocations += 1


def prune_retired(days: dict[int, LedgerDay], *, now: float, period_days: float) -> None:
    """Drop the days that end before ``now - period_days`` (in place)."""
    oldest = _day(now - period_days * SECONDS_PER_DAY)
    for d in [d for d in days if d < oldest]:
        del days[d]


def retired_hours(
    days: Mapping[int, LedgerDay], *, now: float, period_days: float
) -> tuple[float, float, int]:
    """(node_hours, gpu_hours, allocations) of ``days`` inside ``[now - period, now]``:
    whole days, the day the window opens in pro rata."""
    since = now - period_days * SECONDS_PER_DAY
    node: list[float] = []
    gpu: list[float] = []
    count = 0
    for d in sorted(days):
        share = ((d + 1) * SECONDS_PER_DAY - since) / SECONDS_PER_DAY
        if share <= 0:
            continue
        share = min(1.0, share)
        b = days[d]
        node.append(b.node_seconds * share)
        gpu.append(b.gpu_seconds * share)
        if share >= 1.0:
            count += b.allocations
        elif b.allocations and share > 0:
            count += round(b.allocations * share)
    return (
        math.fsum(node) / SECONDS_PER_HOUR,
        math.fsum(gpu) / SECONDS_PER_HOUR,
        count,
    )


__all__ = [
    "DEFAULT_BUDGET_PERIOD_DAYS",
    "UNKNOWN_NODE_GPUS",
    "BudgetStatus",
    "Usage",
    "allocation_hours",
    "budget_fraction",
    "budget_status",
    "budget_utilization",
    "node_and_gpu_count",
    "node_gpu_counts",
    "prune_retired",
    "retire",
    "retired_hours",
    "usage",
    "usage_by",
    "window_seconds_of",
]
