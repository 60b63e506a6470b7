"""``RemoveAllocations``: terminal allocations leave the state after their retention
(the rule: ``lattice_quorum.retention``). Their final records were stored in the history
store before the command was proposed (``lattice_api.history_sweeper``).

Each listed id is removed only if the rule holds at ``cmd.now`` under
``cmd.retention_seconds`` (``cmd.budgeted_retention_seconds`` for budgeted tenants); others are skipped, never an error, so a batch read on a
slightly older state still applies identically on every member. With an allocation go
what refers only to it: its idempotency key, its task group's and DAG's records once
their last member is gone, ended sessions on it, its dependents list. Its run stays in
its tenant's ledger totals (``Tenant.retired_usage``, ``lattice_common.ledger.retire``),
so the budget penalty and the budget read the same before and after.
"""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common import ledger
from lattice_common.types import Allocation

from lattice_quorum import retention
from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers.common import bump


def remove_allocations(
    state: GlobalState, cmd: c.RemoveAllocations, ch: Changes
) -> c.CommandResult:
    live = retention.live_session_allocations(state)
    removed: list[str] = []
    tenants_touched: set[str] = set()
    units: set[str] = set()  # task groups and DAGs whose last member went
    for aid in dict.fromkeys(cmd.ids):
        a = state.allocations.get(aid)
        if a is None or not retention.removable(
            state, a, cmd.now, cmd.retention_seconds, live, cmd.budgeted_retention_seconds
        ):
            continue
        removed.append(aid)
        _retire(state, a, tenants_touched)
        if a.spec.request_id and state.request_ids.get(a.spec.request_id) == aid:
            del state.request_ids[a.spec.request_id]
        del state.allocations[aid]
        state.active.pop(aid, None)
        state.dependents.pop(aid, None)
        if a.task_group_id in state.task_groups:
            rest = [i for i in state.task_groups[a.task_group_id] if i != aid]
            if rest:
                state.task_groups[a.task_group_id] = rest
            else:
                del state.task_groups[a.task_group_id]
                units.add(a.task_group_id)
        if a.dag_id in state.dags:
            d = state.dags[a.dag_id]
            if not any(i in state.allocations for i in d.members.values()):
                del state.dags[a.dag_id]
                units.add(a.dag_id)
    if not removed:
        return c.CommandResult(revision=state.revision, removed_ids=[])
    gone = set(removed)
    if units:  # a group's or DAG's key is on none of its members: one pass to find it
        for k in [k for k, v in state.request_ids.items() if v in units]:
            del state.request_ids[k]
    for sid in [k for k, x in state.sessions.items() if x.allocation_id in gone]:
        del state.sessions[sid]
    period = cmd.budget_period_seconds or ledger.DEFAULT_BUDGET_PERIOD_DAYS * ledger.SECONDS_PER_DAY
    for name in tenants_touched:
        ledger.prune_retired(
            state.tenants[name].retired_usage,
            now=cmd.now,
            period_days=period / ledger.SECONDS_PER_DAY,
        )
    bump(state)
    ch.tenants |= tenants_touched
    ch.allocations -= gone
    ch.removed_allocations |= gone
    return c.CommandResult(revision=state.revision, removed_ids=removed)


def _retire(state: GlobalState, a: Allocation, touched: set[str]) -> None:
    t = state.tenants.get(a.spec.tenant)
    if t is None or a.started_at is None:
        return
    gpus = {
        n: max(0, int(state.nodes[n].capabilities.gpu_count))
        for n in a.assigned_nodes
        if n in state.nodes
    }
    ledger.retire(t.retired_usage, a, gpus)
    touched.add(t.name)
