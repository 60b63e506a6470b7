"""What the job charger charges, as pure functions of quorum state and the ledger.

Charging is level-triggered: every pass looks at each allocation with an open
reservation and charges the running time not charged yet, ``[charged_up_to, end)``,
where ``charged_up_to`` is the reservation's ``last_charged_at`` (stored in the same SQL
transaction as the charge) or, for the first charge, the allocation's ``started_at``
(when it started Running). A pass that repeats after a crash finds ``charged_up_to``
already moved and charges nothing twice.

* Running (or Checkpointing): charge up to ``now``, or up to the
  last time its nodes were known alive when they all stopped reporting (the watchdog).
* Started before but not holding nodes now (Suspended, or requeued): the time since the
  consumer saw it stop holding nodes is not charged; the charger moves ``charged_up_to``
  forward with a zero charge.
* Terminal: ``finalize`` with the exact total: ``cost(started_at, finished_at)`` for one
  uninterrupted run, else ``charged + cost(charged_up_to, finished_at)``; a total below
  what was charged (charged ahead of the recorded end, or from the assignment's
  ``started_at`` before Running reset it) is refunded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from lattice_common.types import Allocation, AllocationState, LifecycleType, Node

from lattice_accounting.money import ZERO, quantize
from lattice_accounting.prices import Facts, Price, charge_for

# charged while in these states: the job runs on its nodes (the prologue's Staging is
# not charged; the allocation's ``started_at`` is reset when it starts Running)
CHARGED_STATES = frozenset({AllocationState.RUNNING, AllocationState.CHECKPOINTING})


def ts(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, UTC)


@dataclass(frozen=True, slots=True)
class OpenReservation:
    """The charger's view of one open reservation (read in bulk each pass)."""

    allocation_id: str
    tenant: str
    project: str
    held: Decimal
    charged: Decimal
    created_at: datetime
    last_charged_at: datetime | None = None
    started_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Due:
    """What one allocation owes in this pass: ``amount`` for running up to ``up_to``
    (``final``: settle it with ``total`` and release the rest)."""

    allocation_id: str
    amount: Decimal
    up_to: datetime
    final: bool = False
    total: Decimal = ZERO


def resources(a: Allocation, nodes: Mapping[str, Node]) -> tuple[int, int, str]:
    """(nodes, GPUs, GPU type) the allocation holds (its spec when the nodes are gone)."""
    ids = a.assigned_nodes
    count = len(ids) or a.spec.nodes
    gpus, gpu_type = 0, ""
    for nid in ids:
        n = nodes.get(nid)
        if n is not None and n.capabilities.gpu_count:
            gpus += n.capabilities.gpu_count
            gpu_type = gpu_type or n.capabilities.gpu_type
    return count, gpus, gpu_type


def facts(a: Allocation, nodes: Mapping[str, Node], *, gpus_per_node: int = 0) -> Facts:
    """The estimate's inputs for an allocation (the gate sends the same for a spec)."""
    unbounded = a.spec.lifecycle != LifecycleType.BOUNDED or a.spec.walltime_seconds <= 0
    return Facts(
        vcluster=a.spec.vcluster,
        tenant=a.spec.tenant,
        nodes=a.spec.nodes,
        walltime_s=None if unbounded else float(a.spec.walltime_seconds),
        gpus_per_node=gpus_per_node,
    )


def cost(
    a: Allocation,
    nodes: Mapping[str, Node],
    prices: Sequence[Price],
    start: datetime,
    end: datetime,
    *,
    first: bool,
) -> Decimal:
    """The signed cost of ``[start, end)`` (negative when ``end < start``)."""
    n, gpus, gpu_type = resources(a, nodes)
    if end >= start:
        return charge_for(
            (start, end),
            n,
            gpus,
            prices,
            vcluster=a.spec.vcluster,
            tenant=a.spec.tenant,
            gpu_type=gpu_type,
            include_fixed=first,
        )
    return -charge_for(
        (end, start), n, gpus, prices, vcluster=a.spec.vcluster, tenant=a.spec.tenant,
        gpu_type=gpu_type,
    )  # fmt: skip


def one_run(a: Allocation) -> bool:
    """It ran once, never requeued, preempted, checkpointed or resumed."""
    return (
        a.requeue_count == 0
        and a.preempted_count == 0
        and a.last_checkpoint is None
        and not a.resume_from_checkpoint
    )


def due(
    a: Allocation | None,
    r: OpenReservation,
    nodes: Mapping[str, Node],
    prices: Sequence[Price],
    now: datetime,
    *,
    alive_until: datetime | None = None,
    paused_at: datetime | None = None,
    paused_ever: bool = False,
) -> Due | None:
    """What ``a`` owes now (None: nothing to do this pass). ``alive_until``: its nodes
    stopped reporting then (charge no further); ``paused_at``: when it stopped holding
    nodes (Suspended / requeued), as the consumer saw it."""
    if a is None:
        return None  # the watchdog decides about reservations without an allocation
    started = ts(a.started_at)
    since = r.last_charged_at
    first = since is None
    if a.terminal:
        end = ts(a.finished_at) or now
        if alive_until is not None and alive_until < end:
            end = alive_until
        if started is None and since is None:
            return Due(a.id, ZERO, end, final=True, total=r.charged)  # never ran
        if started is not None and one_run(a) and not paused_ever:
            # one uninterrupted run: its exact cost, whatever the passes charged (the
            # first pass may have seen the assignment's started_at, reset at Running)
            exact = cost(a, nodes, prices, started, end, first=True)
            return Due(a.id, ZERO, end, final=True, total=max(quantize(exact), ZERO))
        start = since if since is not None else started
        assert start is not None
        if started is not None and since is not None and started > since:
            start = started  # it ran again after a pause: the gap is not charged
            first = False
        delta = cost(a, nodes, prices, start, end, first=first)
        return Due(a.id, ZERO, end, final=True, total=max(quantize(r.charged + delta), ZERO))
    if a.state in CHARGED_STATES and started is not None:
        end = now if alive_until is None else min(now, alive_until)
        start = since if since is not None else started
        if started > start:
            start = started
            first = first and r.charged == 0
        if end <= start:
            if since is not None and now > since and alive_until is not None:
                return Due(a.id, ZERO, now)  # stalled: move on without charging
            return None
        return Due(a.id, cost(a, nodes, prices, start, end, first=first), end)
    if since is not None or started is not None:
        # not holding nodes now (Suspended, requeued): charge up to the pause, then skip
        if paused_at is not None and since is not None and paused_at > since:
            return Due(a.id, cost(a, nodes, prices, since, paused_at, first=False), paused_at)
        if since is not None and now > since:
            return Due(a.id, ZERO, now)
    return None


__all__ = [
    "CHARGED_STATES",
    "Due",
    "OpenReservation",
    "cost",
    "due",
    "facts",
    "one_run",
    "resources",
    "ts",
]
