"""Handing a node to its next allocation in the commit that ends its owner.

Without it a short job's node goes: owner ends (commit) -> the scheduler sees the node
free -> a cycle -> AssignNodes (commit) -> the agent starts the next job; the middle
hops were a fifth of a trivial job's turnaround. A scheduler queues, from its
reservations, the pending one-node allocation that should follow on a busy node
(``SetNextAllocations`` -> ``Node.next_allocation``); when the owner ends through
``UpdateAllocationState`` (Completed or Failed, the agent's report), :func:`hand_off`
assigns the node to it in the same command, with every check an ``AssignNodes`` makes
(Pending, not held, takeable node, quotas, sensitive rules). An entry that no longer
passes is dropped silently: the next cycle decides as before. Cancellation, requeue
and preemption release nodes without a hand-over (a preemption's node is its
preemptor's).
"""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.errors import LatticeError, ValidationError
from lattice_common.types import Allocation, AllocationState

from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers.assignment import assign_nodes
from lattice_quorum.handlers.common import bump, find_node, touch_node


def set_next_allocations(
    state: GlobalState, cmd: c.SetNextAllocations, ch: Changes
) -> c.CommandResult:
    """Record each node's next allocation. Refused whole (nothing recorded) when a node
    or allocation is unknown, an allocation is not a Pending one-node allocation, or one
    allocation is queued on two nodes."""
    chosen = [a for a in cmd.next.values() if a]
    if len(chosen) != len(set(chosen)):
        raise ValidationError(
            "an allocation may follow on one node only",
            hint="Queue each pending allocation behind a single node.",
        )
    nodes = [find_node(state, nid) for nid in cmd.next]
    for aid in chosen:
        a = state.allocations.get(aid)
        if a is None or not _may_follow(a):
            raise ValidationError(
                f"allocation {aid} cannot be queued on a node: it must be a Pending "
                "one-node allocation",
                details={"allocation": aid},
                hint="Queue only what the next cycle would place on a single node.",
            )
    changed = [n for n in nodes if n.next_allocation != cmd.next[n.id]]
    if changed:
        bump(state)
        for n in changed:
            n.next_allocation = cmd.next[n.id]
            touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision)


def _may_follow(a: Allocation) -> bool:
    return a.state == AllocationState.PENDING and a.spec.nodes == 1 and not a.held


def hand_off(state: GlobalState, ended: Allocation, now: float, ch: Changes) -> None:
    """The nodes ``ended`` just released go to their next allocations, where those may
    still take them; every entry is cleared either way."""
    for nid in ended.assigned_nodes:
        n = state.nodes.get(nid)
        if n is None or not n.next_allocation:
            continue
        nxt = state.allocations.get(n.next_allocation)
        n.next_allocation = ""
        touch_node(state, n, ch)
        if n.owner or nxt is None or not _may_follow(nxt):
            continue
        try:
            assign_nodes(
                state,
                c.AssignNodes(
                    allocation_id=nxt.id, node_ids=[nid], vcluster=nxt.spec.vcluster, now=now
                ),
                ch,
            )
        except LatticeError:
            continue  # no longer fits (drained, quota, claimed...): the next cycle decides
