"""Primitives every handler domain shares: revision bumps, change tracking, lookups
that fail with the user-facing NotFound, and the allocation lifecycle steps (finish,
requeue, freeing nodes) that node failures and allocation commands both take.

Only ``state.apply``'s handlers call these, always under its rule: validate first,
then mutate, so a rejected command changes nothing.
"""

from __future__ import annotations

from lattice_common.errors import NotFound
from lattice_common.state_machine import check_transition
from lattice_common.types import HOLDING_STATES, Allocation, AllocationState, Node, NodeState

from lattice_quorum.global_state import Changes, GlobalState


def bump(state: GlobalState) -> int:
    state.revision += 1
    return state.revision


def touch_alloc(state: GlobalState, a: Allocation, ch: Changes) -> None:
    a.revision = state.revision
    ch.allocations.add(a.id)
    if a.state in HOLDING_STATES:
        state.active[a.id] = None
    else:
        state.active.pop(a.id, None)


def touch_node(state: GlobalState, n: Node, ch: Changes) -> None:
    n.revision = state.revision
    ch.nodes.add(n.id)


def find_node(state: GlobalState, node_id: str) -> Node:
    n = state.nodes.get(node_id)
    if n is None:
        raise NotFound(
            f"node {node_id} not found",
            hint="List nodes with `lattice nodes`.",
        )
    return n


def find_alloc(state: GlobalState, alloc_id: str) -> Allocation:
    a = state.allocations.get(alloc_id)
    if a is None:
        raise NotFound(
            f"allocation {alloc_id} not found",
            hint="List your allocations with `lattice status`.",
        )
    return a


def free(n: Node) -> None:
    n.owner = ""
    n.owner_tenant = ""
    n.owner_vcluster = ""
    if n.state == NodeState.DRAINING:
        n.state = NodeState.DRAINED


def release_nodes(state: GlobalState, a: Allocation, ch: Changes) -> None:
    for nid in a.assigned_nodes:
        n = state.nodes.get(nid)
        if n is not None and n.owner == a.id:
            free(n)
            touch_node(state, n, ch)


def finish(
    state: GlobalState,
    a: Allocation,
    target: AllocationState,
    now: float,
    reason: str,
    exit_code: int | None,
    ch: Changes,
    finished_at: float | None = None,
    *,
    resolve_dag: bool = True,
) -> None:
    """End ``a``; a DAG member's end is resolved for its successors in the same command
    (``resolve_dag=False`` only where the resolution itself ends members)."""
    check_transition(a.id, a.state, target)
    bump(state)
    release_nodes(state, a, ch)
    a.state = target
    a.reason = reason
    a.exit_code = exit_code
    a.estimated_start, a.estimate_basis = None, ""
    a.finished_at = finished_at if finished_at is not None else now
    touch_alloc(state, a, ch)
    if resolve_dag and (a.dag_id or a.id in state.dependents):
        from lattice_quorum.handlers.dags import ended  # dags builds on finish

        ended(state, a, now, ch)


def requeue(
    state: GlobalState, a: Allocation, reason: str, ch: Changes, *, preempted: bool = False
) -> None:
    check_transition(a.id, a.state, AllocationState.PENDING)
    bump(state)
    release_nodes(state, a, ch)
    a.state = AllocationState.PENDING
    a.assigned_nodes = []
    a.started_at = None
    if preempted:  # preempted_by stays until it is placed again
        a.preempted_count += 1
        a.resume_from_checkpoint = True
    else:
        a.requeue_count += 1
    a.reason = reason
    touch_alloc(state, a, ch)  # submitted_at is kept: no queue-jumping penalty
