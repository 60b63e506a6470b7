"""Command handlers that give nodes to allocations or take them back: assignment,
scaling a running allocation (and the autoscaler's status of reactive ones), preemption,
and releasing a sensitive node claim.

The checks (freshness, exclusive ownership, quotas, sensitive claims and pool size,
preemption rules) are ``lattice_common.assignment``'s, shared with RM-Replay; this
module only applies their outcome to the state.
"""

from __future__ import annotations

from lattice_common import assignment
from lattice_common import audit as audit_log
from lattice_common import commands as c
from lattice_common.errors import InvalidTransition, PermissionDenied, ValidationError
from lattice_common.types import Allocation, AllocationState, Node, ScalingStatus, claimant

from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers.audit import note
from lattice_quorum.handlers.common import (
    bump,
    find_alloc,
    find_node,
    free,
    touch_alloc,
    touch_node,
)
from lattice_quorum.handlers.staging import needs_staging


def _tenant_usage(state: GlobalState, tenant: str) -> tuple[int, int]:
    """(nodes held, allocations holding nodes) of a tenant, for its hard quotas; from
    the ``active`` index so the cost does not grow with finished allocations."""
    nodes = allocs = 0
    for aid in state.active:
        a = state.allocations[aid]
        if a.spec.tenant == tenant:
            allocs += 1
            nodes += len(a.assigned_nodes)
    return nodes, allocs


def assign_nodes(state: GlobalState, cmd: c.AssignNodes, ch: Changes) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    nodes = assignment.check_assignment(
        a,
        cmd.node_ids,
        lambda nid: find_node(state, nid),
        sensitive=assignment.is_sensitive(a, state.vclusters),
        tenant=state.tenants.get(a.spec.tenant),
        tenant_usage=lambda: _tenant_usage(state, a.spec.tenant),
        expected_revision=cmd.expected_revision,
        sensitive_pool_size=state.sensitive_pool_size,
        claimed_nodes=lambda: _claimed_nodes(state),
    )
    bump(state)
    for n in nodes:
        _take(state, n, a, cmd.vcluster, cmd.now)
        touch_node(state, n, ch)
    a.assigned_nodes = list(cmd.node_ids)
    a.pending_reason = ""
    a.estimated_start, a.estimate_basis = None, ""
    a.preempted_by = ""
    a.staged_nodes = []
    a.state = AllocationState.STAGING if needs_staging(a.spec) else AllocationState.RUNNING
    a.started_at = cmd.now  # when the nodes were taken; Running resets it
    a.reason = ""
    touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def _claimed_nodes(state: GlobalState) -> int:
    return sum(1 for n in state.nodes.values() if n.claimed_by)


def _take(state: GlobalState, n: Node, a: Allocation, vcluster: str, now: float) -> None:
    n.owner = a.id
    n.owner_tenant = a.spec.tenant
    n.owner_vcluster = vcluster or a.spec.vcluster
    if assignment.is_sensitive(a, state.vclusters) and not n.claimed_by:
        # the claim outlives the allocation: idle claimed nodes stay with their user
        n.claimed_by = claimant(a)
        n.claimed_at = now
        note(
            state,
            now=now,
            actor=n.claimed_by,
            action=audit_log.NODE_CLAIM,
            target=f"node:{n.id}",
            tenant=a.spec.tenant,
            details={"allocation_id": a.id},
        )


def release_node_claim(state: GlobalState, cmd: c.ReleaseNodeClaim, ch: Changes) -> c.CommandResult:
    n = find_node(state, cmd.node_id)
    if not n.claimed_by:
        raise ValidationError(
            f"node {n.id} is not claimed",
            hint="`lattice nodes -o wide` shows which nodes are claimed and by whom.",
        )
    if not cmd.admin and cmd.user != n.claimed_by:
        raise PermissionDenied(
            f"node {n.id} is claimed by {n.claimed_by}; only that user or an administrator "
            "can release it",
            details={"node": n.id, "claimed_by": n.claimed_by},
        )
    if n.owner:
        raise InvalidTransition(
            f"node {n.id} still runs allocation {n.owner}",
            details={"node": n.id, "owner": n.owner},
            hint=f"Wait for it to finish or cancel it (lattice cancel {n.owner}).",
        )
    bump(state)
    note(
        state,
        now=cmd.now,
        actor=cmd.user or "lattice",
        action=audit_log.NODE_RELEASE,
        target=f"node:{n.id}",
        details={"claimed_by": n.claimed_by, "as_admin": str(cmd.admin).lower()},
    )
    n.claimed_by = ""
    n.claimed_at = None
    touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def scale_allocation(state: GlobalState, cmd: c.ScaleAllocation, ch: Changes) -> c.CommandResult:
    """Grow or shrink a running allocation with a node range within {min_nodes, nodes}."""
    a = find_alloc(state, cmd.allocation_id)
    if a.state != AllocationState.RUNNING:
        raise InvalidTransition(
            f"allocation {a.id} is {a.state.value}; only running allocations scale",
            details={"allocation": a.id, "state": a.state.value},
        )
    if not a.spec.min_nodes:
        raise ValidationError(
            f"allocation {a.id} has a fixed node count",
            hint="Only allocations submitted with a node range (--nodes MIN-MAX) scale.",
        )
    assignment.check_fresh("allocation", a.id, a.revision, cmd.expected_revision)
    add, remove = list(cmd.add_node_ids), list(cmd.remove_node_ids)
    if not add and not remove:
        raise ValidationError("scale needs nodes to add or remove")
    if len(set(add)) != len(add) or set(add) & set(a.assigned_nodes):
        raise ValidationError("nodes to add must be distinct and not already assigned")
    if not set(remove) <= set(a.assigned_nodes) or (remove and remove[0] == a.assigned_nodes[0]):
        raise ValidationError(
            "only assigned nodes other than the first (where the allocation's launcher "
            "runs) can be removed"
        )
    size = len(a.assigned_nodes) + len(add) - len(remove)
    if not a.spec.min_nodes <= size <= a.spec.nodes:
        raise ValidationError(
            f"allocation {a.id} needs {a.spec.min_nodes}..{a.spec.nodes} nodes, "
            f"scaling would give {size}"
        )
    nodes = [find_node(state, nid) for nid in add]
    sensitive = assignment.is_sensitive(a, state.vclusters)
    for n in nodes:
        assignment.check_fresh("node", n.id, n.revision, cmd.expected_revision)
        assignment.check_takeable(n, a, sensitive=sensitive)
    assignment.check_sensitive_pool(
        nodes,
        sensitive=sensitive,
        limit=state.sensitive_pool_size,
        claimed=lambda: _claimed_nodes(state),
    )
    t = state.tenants.get(a.spec.tenant)
    if t is not None and nodes:
        assignment.check_max_nodes(t, _tenant_usage(state, t.name)[0], len(nodes))
    bump(state)
    for n in nodes:
        _take(state, n, a, cmd.vcluster, cmd.now)
        touch_node(state, n, ch)
    for nid in remove:
        n = state.nodes.get(nid)
        if n is not None and n.owner == a.id:
            free(n)
            touch_node(state, n, ch)
    gone = set(remove)
    a.assigned_nodes = [nid for nid in a.assigned_nodes if nid not in gone] + add
    if cmd.status is not None:  # the autoscaler's decision, with the change it made
        a.scaling_status = _bounded_status(cmd.status)
    touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def set_scaling_status(state: GlobalState, cmd: c.SetScalingStatus, ch: Changes) -> c.CommandResult:
    """The autoscaler's word on reactive allocations it did not scale; allocations that
    are gone, not running or not reactive are skipped, and only differences change
    anything."""
    changed: list[Allocation] = []
    for aid in sorted(cmd.statuses):
        a = state.allocations.get(aid)
        if a is None or a.state != AllocationState.RUNNING or a.spec.scaling is None:
            continue
        status = _bounded_status(cmd.statuses[aid])
        if status != a.scaling_status:
            a.scaling_status = status
            changed.append(a)
    if not changed:
        return c.CommandResult(revision=state.revision)
    bump(state)
    for a in changed:
        touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision)


def _bounded_status(s: ScalingStatus) -> ScalingStatus:
    """Texts cut to 200 characters, like pending reasons."""
    return ScalingStatus(
        target=s.target,
        last_decision=s.last_decision[:8],
        reason=s.reason[:200],
        at=s.at,
        blocked=s.blocked[:200],
        releasing=list(s.releasing),
        release_at=s.release_at,
        release_by=s.release_by,
    )


def preempt_allocation(
    state: GlobalState, cmd: c.PreemptAllocation, ch: Changes
) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    p = find_alloc(state, cmd.preemptor_id)
    assignment.check_preemption(a, p, state.nodes)
    bump(state)
    a.state = AllocationState.CHECKPOINTING
    a.preempted_by = p.id
    a.reason = cmd.reason
    a.checkpoint_hint_at = cmd.now  # the broker / agent act on it from here
    touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)
