"""The rules an assignment and a preemption must pass, written once.

The quorum's ``AssignNodes``, ``ScaleAllocation`` and ``PreemptAllocation`` (in
``lattice_quorum.state``) and RM-Replay's engine, which applies the scheduler's
decisions the way the quorum would, both call these checks, so a replay rejects
exactly what the live quorum rejects. Pure: the caller passes what it knows (the
allocation, the resolved nodes, the tenant, usage counters) and gets a typed
:class:`~lattice_common.errors.LatticeError` with the figures and a hint, or nothing.

* the allocation is Pending, the decision is not stale (``expected_revision``);
* the node list is non-empty, distinct and within the node range {min_nodes, nodes};
* each node is takeable: unowned, Ready, not claimed for another user's sensitive use;
* the sensitive pool (``sensitive_pool_size``) is not exceeded by new claims;
* the tenant's hard quotas ``max_nodes`` and ``max_concurrent_allocations`` hold
  (current, requested, limit);
* preemption only moves down a class (never class 10), except that the home vCluster
  reclaiming a borrowed node may preempt any class below 10.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lattice_common.errors import (
    InvalidTransition,
    OwnershipConflict,
    QuotaExceeded,
    StaleRevision,
    ValidationError,
)
from lattice_common.state_machine import check_transition
from lattice_common.types import (
    NEVER_PREEMPTED_CLASS,
    Allocation,
    AllocationState,
    Node,
    NodeState,
    SchedulerType,
    Tenant,
    VCluster,
    claimant,
)

__all__ = [
    "check_assignment",
    "check_fresh",
    "check_max_concurrent_allocations",
    "check_max_nodes",
    "check_preemption",
    "check_sensitive_pool",
    "check_takeable",
    "is_reclaim",
    "is_sensitive",
]


def is_sensitive(a: Allocation, vclusters: Mapping[str, VCluster]) -> bool:
    """``a`` runs in a sensitive-reservation vCluster (its nodes get claimed)."""
    v = vclusters.get(a.spec.vcluster)
    return v is not None and v.scheduler_type == SchedulerType.SENSITIVE_RESERVATION


def check_fresh(kind: str, ident: str, revision: int, expected: int) -> None:
    """Reject a decision taken on a state older than the object's last change."""
    if expected and revision > expected:
        raise StaleRevision(
            f"{kind} {ident} changed since revision {expected}",
            details={"expected_revision": expected, "current": revision},
        )


def check_takeable(n: Node, a: Allocation, *, sensitive: bool) -> None:
    """A node can go to ``a``: free, Ready, and not claimed by someone else (claimed
    nodes run only their claiming user's sensitive work)."""
    if n.owner:
        raise OwnershipConflict(
            f"node {n.id} is already owned by allocation {n.owner}",
            details={"node": n.id, "owner": n.owner},
        )
    if n.state != NodeState.READY:
        raise OwnershipConflict(
            f"node {n.id} is {n.state.value}, not Ready",
            details={"node": n.id, "state": n.state.value},
        )
    if n.id in a.excluded_nodes:
        raise OwnershipConflict(
            f"node {n.id} failed the prologue of allocation {a.id}",
            details={"node": n.id, "allocation": a.id},
            hint="It is retried on other nodes.",
        )
    if n.claimed_by and not (sensitive and claimant(a) == n.claimed_by):
        raise OwnershipConflict(
            f"node {n.id} is claimed by user {n.claimed_by} for sensitive use",
            details={"node": n.id, "claimed_by": n.claimed_by},
            hint="Claimed nodes run only their claiming user's sensitive allocations.",
        )


def check_sensitive_pool(
    nodes: Sequence[Node],
    *,
    sensitive: bool,
    limit: int | None,
    claimed: Callable[[], int],
) -> None:
    """Sensitive work claims the unclaimed ``nodes`` it gets; the claimed total stays
    within ``limit``. ``claimed``: the nodes claimed now (called only when needed)."""
    if limit is None or not sensitive:
        return
    new = sum(1 for n in nodes if not n.claimed_by)
    if not new:
        return
    current = claimed()
    if current + new > limit:
        raise QuotaExceeded(
            f"allocation rejected: would exceed sensitive_pool_size "
            f"(current: {current}, requested: {new}, limit: {limit})",
            details={"current": current, "requested": new, "limit": limit},
            hint="Release idle sensitive claims (lattice node release NODE) or ask an "
            "administrator to raise sensitive_pool_size.",
        )


def check_max_nodes(t: Tenant, current: int, requested: int) -> None:
    if t.max_nodes is not None and current + requested > t.max_nodes:
        raise QuotaExceeded(
            f'allocation rejected: tenant "{t.name}" would exceed max_nodes quota '
            f"(current: {current}, requested: {requested}, limit: {t.max_nodes})",
            details={"current": current, "requested": requested, "limit": t.max_nodes},
            hint="Cancel running allocations or request a quota increase from your tenant admin.",
        )


def check_max_concurrent_allocations(t: Tenant, current: int) -> None:
    limit = t.max_concurrent_allocations
    if limit is not None and current + 1 > limit:
        raise QuotaExceeded(
            f'allocation rejected: tenant "{t.name}" would exceed max_concurrent_allocations '
            f"quota (current: {current}, requested: 1, limit: {limit})",
            details={"current": current, "requested": 1, "limit": limit},
            hint="Wait for running allocations to finish or request a quota increase.",
        )


def check_assignment(
    a: Allocation,
    node_ids: Sequence[str],
    node: Callable[[str], Node],
    *,
    sensitive: bool,
    tenant: Tenant | None,
    tenant_usage: Callable[[], tuple[int, int]],
    expected_revision: int = 0,
    sensitive_pool_size: int | None = None,
    claimed_nodes: Callable[[], int] = lambda: 0,
) -> list[Node]:
    """Every rule of assigning ``node_ids`` to ``a`` (module docstring), in the order
    the quorum reports them; returns the nodes. ``node``: id -> Node, raising
    ``NotFound`` for an unknown id. ``tenant_usage``: (nodes, allocations) the tenant
    holds now, called only when the tenant has a hard quota. ``expected_revision``:
    the state revision the decision was taken on (0: not checked)."""
    if a.state != AllocationState.PENDING:
        raise InvalidTransition(
            f"allocation {a.id} is {a.state.value}, not Pending",
            details={"allocation": a.id, "state": a.state.value},
        )
    if a.held:
        raise InvalidTransition(
            f"allocation {a.id} waits for its dependencies",
            details={"allocation": a.id, "dag": a.dag_id},
            hint="It enters the queue when its DAG's conditions hold.",
        )
    check_fresh("allocation", a.id, a.revision, expected_revision)
    if not node_ids or len(set(node_ids)) != len(node_ids):
        raise ValidationError("assign needs a non-empty list of distinct nodes")
    least = a.spec.min_nodes or a.spec.nodes
    if not least <= len(node_ids) <= a.spec.nodes:
        raise ValidationError(
            f"allocation {a.id} needs {least}..{a.spec.nodes} nodes, got {len(node_ids)}"
        )
    nodes = [node(nid) for nid in node_ids]
    for n in nodes:
        check_fresh("node", n.id, n.revision, expected_revision)
        check_takeable(n, a, sensitive=sensitive)
    check_sensitive_pool(
        nodes, sensitive=sensitive, limit=sensitive_pool_size, claimed=claimed_nodes
    )
    if tenant is not None and (
        tenant.max_nodes is not None or tenant.max_concurrent_allocations is not None
    ):
        held_nodes, held_allocs = tenant_usage()
        check_max_nodes(tenant, held_nodes, len(nodes))
        check_max_concurrent_allocations(tenant, held_allocs)
    check_transition(a.id, a.state, AllocationState.RUNNING)
    return nodes


def is_reclaim(victim: Allocation, preemptor: Allocation, nodes: Mapping[str, Node]) -> bool:
    """The preemptor's vCluster takes back a node of its home pool that ``victim``
    borrowed."""
    return victim.spec.vcluster != preemptor.spec.vcluster and any(
        (n := nodes.get(nid)) is not None and n.home_vcluster == preemptor.spec.vcluster
        for nid in victim.assigned_nodes
    )


def check_preemption(victim: Allocation, preemptor: Allocation, nodes: Mapping[str, Node]) -> None:
    """``preemptor`` (Pending) may preempt ``victim`` (Running): a strictly lower class,
    or any class but 10 when reclaiming a borrowed node (:func:`is_reclaim`)."""
    if victim.state != AllocationState.RUNNING:
        raise InvalidTransition(
            f"allocation {victim.id} is {victim.state.value}; only running allocations can "
            "be preempted",
            details={"allocation": victim.id, "state": victim.state.value},
        )
    vc, pc = victim.spec.preemption_class, preemptor.spec.preemption_class
    if vc >= NEVER_PREEMPTED_CLASS or (vc >= pc and not is_reclaim(victim, preemptor, nodes)):
        raise ValidationError(
            f"allocation {victim.id} (class {vc}) cannot be preempted by "
            f"{preemptor.id} (class {pc}): preemption only moves down",
            details={"victim_class": vc, "preemptor_class": pc},
        )
    if preemptor.state != AllocationState.PENDING:
        raise InvalidTransition(f"preemptor {preemptor.id} is {preemptor.state.value}, not Pending")
    check_transition(victim.id, victim.state, AllocationState.CHECKPOINTING)
