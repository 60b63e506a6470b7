"""``RemoveAllocations``: terminal allocations leave the state after their retention
(the rule: ``lattice_quorum.retention``). Their final records were stored in the history
store before the command was proposed (``lattice_api.history_sweeper``).

Each listed id is removed only if the rule holds at ``cmd.now`` under
``cmd.retention_seconds`` (``cmd.budgeted_retention_seconds`` for budgeted tenants); others are skipped, never an error, so a batch read on a
slightly older state still applies identically on every member. With an allocation go
what refers only to it: its idempotency key, its task group's and DAG's records once
their last member is gone, ended sessions on it, its dependents list.
"""

from __future__ import annotations

from lattice_common import commands as c

from lattice_quorum import retention
from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers.common import bump


def remove_allocations(
    state: GlobalState, cmd: c.RemoveAllocations, ch: Changes
) -> c.CommandResult:
    live = retention.live_session_allocations(state)
    removed: list[str] = []
    units: set[str] = set()  # task groups and DAGs whose last member went
    for aid in dict.fromkeys(cmd.ids):
        a = state.allocations.get(aid)
        if a is None or not retention.removable(
            state, a, cmd.now, cmd.retention_seconds, live, cmd.budgeted_retention_seconds
        ):
            continue
        removed.append(aid)
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
    bump(state)
    ch.allocations -= gone
    ch.removed_allocations |= gone
    return c.CommandResult(revision=state.revision, removed_ids=removed)
