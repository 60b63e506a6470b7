"""Lifecycle transition tables for allocations and nodes.

The quorum consults these before committing any state change; an invalid move is
rejected with :class:`~lattice_common.errors.InvalidTransition` and changes nothing.
"""

from __future__ import annotations

from lattice_common.errors import InvalidTransition
from lattice_common.types import AllocationState as A
from lattice_common.types import NodeState as N

ALLOCATION_TRANSITIONS: dict[A, frozenset[A]] = {
    A.PENDING: frozenset({A.STAGING, A.RUNNING, A.CANCELLED, A.FAILED}),
    A.STAGING: frozenset({A.RUNNING, A.PENDING, A.FAILED, A.CANCELLED}),
    # Running -> Pending is a requeue (node failure). A Running allocation reaches
    # Suspended only through Checkpointing (a checkpoint is recorded on the way).
    A.RUNNING: frozenset({A.COMPLETED, A.FAILED, A.CANCELLED, A.CHECKPOINTING, A.PENDING}),
    # Checkpointing -> Pending: preempted without a checkpoint (checkpoint: none) or the
    # node failed mid-checkpoint; -> Failed: the checkpoint failed (not Suspended).
    A.CHECKPOINTING: frozenset(
        {A.SUSPENDED, A.RUNNING, A.FAILED, A.CANCELLED, A.COMPLETED, A.PENDING}
    ),
    # Suspended -> Pending: requeued after preemption, or resumed on demand
    A.SUSPENDED: frozenset({A.PENDING, A.CANCELLED, A.FAILED}),
    A.COMPLETED: frozenset(),
    A.FAILED: frozenset(),
    A.CANCELLED: frozenset(),
}

NODE_TRANSITIONS: dict[N, frozenset[N]] = {
    N.UNKNOWN: frozenset({N.BOOTING, N.READY, N.DOWN, N.FAILED}),
    N.BOOTING: frozenset({N.READY, N.FAILED, N.DOWN}),
    N.READY: frozenset({N.DEGRADED, N.DRAINING, N.DRAINED, N.DOWN}),
    N.DEGRADED: frozenset({N.READY, N.DOWN, N.DRAINING, N.DRAINED}),
    N.DOWN: frozenset({N.READY, N.BOOTING, N.DEGRADED}),
    N.DRAINING: frozenset({N.DRAINED, N.DOWN, N.DEGRADED}),
    N.DRAINED: frozenset({N.READY, N.DOWN, N.DEGRADED}),
    N.FAILED: frozenset({N.BOOTING, N.DOWN}),
}


def can_transition(current: A, target: A) -> bool:
    return target in ALLOCATION_TRANSITIONS[current]


def check_transition(alloc_id: str, current: A, target: A) -> None:
    """Raise InvalidTransition unless ``current -> target`` is in the table."""
    if not can_transition(current, target):
        raise InvalidTransition(
            f"allocation {alloc_id} cannot move from {current.value} to {target.value}",
            details={"allocation": alloc_id, "from": current.value, "to": target.value},
            hint=_hint(current),
        )


def check_node_transition(node_id: str, current: N, target: N) -> None:
    if target != current and target not in NODE_TRANSITIONS[current]:
        raise InvalidTransition(
            f"node {node_id} cannot move from {current.value} to {target.value}",
            details={"node": node_id, "from": current.value, "to": target.value},
        )


def _hint(current: A) -> str:
    if current in (A.COMPLETED, A.FAILED, A.CANCELLED):
        return "The allocation has already finished; submit a new one."
    return "Check the allocation's current state with `lattice status ID`."
