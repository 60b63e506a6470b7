"""Which terminal allocations may leave the state: the pure rule that both the
proposer (the leader's history sweeper, through :func:`expired`) and every member's
apply (``handlers.retention``, through :func:`removable`) use, so that all members
remove the same ones.

An allocation is removable at ``now`` when it is terminal and ended at least
``retention_seconds`` before ``now``; a task-group member only when every member of its
group still in the state is; a DAG member only when its DAG has ended and every member
still in the state is; never while a session that has not ended refers to it.

A tenant with an internal budget (``node_hours_budget`` or ``gpu_hours_budget``) keeps
its allocations at least ``budgeted_seconds`` when that is given (the lattice-server's
sweeper passes 0: the removal keeps each run in the tenant's ledger totals,
``Tenant.retired_usage``, which the budget penalty reads, so budgeted tenants'
allocations leave after the same retention as everyone's).
"""

from __future__ import annotations

import msgspec
from lattice_common.types import Allocation

from lattice_quorum.global_state import GlobalState

__all__ = ["expired", "expired_records", "live_session_allocations", "removable", "unit_of"]

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Allocation)


def _due(
    s: GlobalState, a: Allocation, now: float, retention_seconds: float, budgeted_seconds: float
) -> bool:
    if not a.terminal or a.finished_at is None:
        return False
    keep = retention_seconds
    if budgeted_seconds > keep:
        t = s.tenants.get(a.spec.tenant)
        if t is not None and (t.node_hours_budget is not None or t.gpu_hours_budget is not None):
            keep = budgeted_seconds
    return now - a.finished_at >= keep


def live_session_allocations(s: GlobalState) -> set[str]:
    return {x.allocation_id for x in s.sessions.values() if x.ended_at is None}


def unit_of(s: GlobalState, a: Allocation) -> list[str]:
    """The ids that leave together with ``a`` (still in the state): its DAG's members,
    else its task group's, else itself."""
    if a.dag_id and a.dag_id in s.dags:
        ids = list(s.dags[a.dag_id].members.values())
    elif a.task_group_id and a.task_group_id in s.task_groups:
        ids = list(s.task_groups[a.task_group_id])
    else:
        return [a.id]
    if a.id not in ids:
        ids.append(a.id)
    return [i for i in dict.fromkeys(ids) if i in s.allocations]


def removable(
    s: GlobalState,
    a: Allocation,
    now: float,
    retention_seconds: float,
    live_sessions: set[str] | None = None,
    budgeted_seconds: float = 0.0,
) -> bool:
    """The module's rule for one allocation."""
    if not _due(s, a, now, retention_seconds, budgeted_seconds):
        return False
    if a.dag_id and a.dag_id in s.dags and s.dags[a.dag_id].state == "Running":
        return False
    live = live_session_allocations(s) if live_sessions is None else live_sessions
    for i in unit_of(s, a):
        if i in live or not _due(s, s.allocations[i], now, retention_seconds, budgeted_seconds):
            return False
    return True


def expired(
    s: GlobalState,
    now: float,
    retention_seconds: float,
    limit: int,
    budgeted_seconds: float = 0.0,
) -> list[str]:
    """Up to about ``limit`` removable ids, oldest submission first, whole units only
    (a DAG or task group larger than ``limit`` comes alone, whole)."""
    live = live_session_allocations(s)
    seen: set[str] = set()
    out: list[str] = []
    cutoff = now - retention_seconds
    for a in s.allocations.values():
        # the state keeps submission order, and nothing ends before it was submitted:
        # past the cutoff nothing is due, so a sweep with nothing to do reads little
        if a.submitted_at > cutoff:
            break
        if a.id in seen or not _due(s, a, now, retention_seconds, budgeted_seconds):
            continue
        unit = unit_of(s, a)
        seen.update(unit)
        if not removable(s, a, now, retention_seconds, live, budgeted_seconds):
            continue
        if out and len(out) + len(unit) > limit:
            break
        out.extend(unit)
        if len(out) >= limit:
            break
    return out


def expired_records(
    s: GlobalState,
    now: float,
    retention_seconds: float,
    limit: int,
    budgeted_seconds: float = 0.0,
) -> tuple[int, list[Allocation]]:
    """A query (``quorum.read``): the state's revision and deep copies of the final
    records of :func:`expired` (what the sweeper stores before proposing removal)."""
    ids = expired(s, now, retention_seconds, limit, budgeted_seconds)
    return s.revision, [_dec.decode(_enc.encode(s.allocations[i])) for i in ids]
