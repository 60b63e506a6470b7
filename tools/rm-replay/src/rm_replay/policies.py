"""The scheduling policies a replay can run: the real Lattice scheduler and two baselines.

* ``lattice``: :func:`lattice_decide` is ``lattice_scheduler.decide.decide_vcluster``,
  the function the live scheduler's cycle runs for each vCluster (queue, cost-function
  order, GreedyTopologyAwareBackfill, node ranges, elastic borrowing, preemption).
  Instead of proposing commands the engine applies its decision the way the quorum
  would. Nothing of the scheduler is re-implemented here.
* ``fcfs``: strict arrival order (original submit time), no backfill: the first
  allocation that does not fit blocks every later one.
* ``easy``: EASY backfill. Arrival order; the first allocation that does not fit (the
  head) gets a reservation: the earliest time enough of its nodes are free, from the
  running allocations' walltime ends, on the nodes freed last by then. A later
  allocation starts now if it fits in free nodes and either ends (now + walltime)
  by the reservation or stays off the reserved nodes. Only the head is protected.

The baselines allocate whole nodes with the live scheduler's one hard filter
(``filters.node_satisfies``: the hard flags such as ``require_unified_memory`` hold,
selection rules such as ``require_conformance`` and the ``prefer_*`` hints are not
node features and the baselines ignore them) and pack with ``placement.pick_nodes``
(fewest dragonfly groups); allocations that no node set could ever satisfy are passed
over instead of blocking the queue. Neither preempts.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Protocol

import msgspec
from lattice_common import ledger
from lattice_common.types import Allocation, AllocationSpec, Node, NodeState
from lattice_common.watch import StateMirror
from lattice_scheduler import decide
from lattice_scheduler.filters import node_satisfies
from lattice_scheduler.placement import pick_nodes
from lattice_scheduler.preemption import PreemptionPolicy
from lattice_scheduler.solver import Pending, Proposal, Reservation
from lattice_scheduler.topology import TopologyModel

__all__ = [
    "POLICIES",
    "Decision",
    "EasyPolicy",
    "FcfsPolicy",
    "LatticePolicy",
    "Placement",
    "Policy",
    "lattice_decide",
    "make_policy",
]

INF = math.inf


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Start ``allocation_id`` on ``node_ids`` now (an ``AssignNodes`` to be)."""

    allocation_id: str
    node_ids: tuple[str, ...]
    vcluster: str = ""
    backfilled: bool = False
    borrowed: bool = False
    groups_spanned: int = 1
    conformance_fitness: float = 1.0


class Decision(msgspec.Struct, kw_only=True):
    """What one cycle decided. ``preemptions``: (victim, preemptor) pairs (a
    ``PreemptAllocation`` each). ``waiting`` / ``reservations``: the solver's view,
    for tests and debugging.

    ``critical_order``: for a decision that placed nothing, the part of the queue
    order its outcome depends on: the allocations up to the one that took the last
    backfill reservation when all ``backfill_depth`` were taken (later ones, and any
    newcomer queued behind them, meet fixed reservations whatever their order), the
    whole order when fewer were taken, ``()`` when order does not matter. ``None``:
    unknown. The engine skips a later decision while the state is unchanged (or
    changed only by arrivals that cannot fit the free nodes) and the queue still
    starts with this sequence: waiting only shrinks backfill windows, so it would
    place nothing either."""

    placements: list[Placement] = msgspec.field(default_factory=list)
    preemptions: list[tuple[str, str]] = msgspec.field(default_factory=list)
    waiting: list[Pending] = msgspec.field(default_factory=list)
    reservations: list[Reservation] = msgspec.field(default_factory=list)
    critical_order: tuple[str, ...] | None = None


class Policy(Protocol):
    """A scheduling policy the engine drives.

    ``per_vcluster``: ``decide`` runs once per vCluster with pending work (True) or
    once per cycle for the whole queue (``vcluster=None``). ``preempts``: it may
    return preemptions. ``borrows``: it may place work on other vClusters' home
    pools. ``node_filter``: whether a node's capabilities can serve an
    allocation (the engine uses it to skip cycles that cannot place anything)."""

    name: str
    per_vcluster: bool
    preempts: bool
    borrows: bool

    def node_filter(self, node: Node, spec: AllocationSpec) -> bool: ...

    def decide(
        self,
        m: StateMirror,
        now: float,
        *,
        vcluster: str | None,
        topology: TopologyModel,
        home_pools: Collection[str] | None = None,
    ) -> Decision: ...

    def queue_order(self, m: StateMirror, now: float, *, vcluster: str | None) -> tuple[str, ...]:
        """The order ``decide`` would consider the queue in at ``now`` (compared with
        a decision's ``critical_order``)."""
        ...


# --------------------------------------------------------------------------- lattice


def _placement(p: Proposal, vc: str, *, borrowed: bool = False) -> Placement:
    return Placement(
        allocation_id=p.allocation_id,
        node_ids=p.node_ids,
        vcluster=vc,
        backfilled=p.backfilled,
        borrowed=borrowed,
        groups_spanned=p.groups_spanned,
        conformance_fitness=p.conformance_fitness,
    )


def lattice_decide(
    m: StateMirror,
    vc: str,
    now: float,
    *,
    topology: TopologyModel | None = None,
    preemption_policy: PreemptionPolicy | None = None,
    held_back: Collection[str] | None = None,
    home_pools: Collection[str] | None = None,
    budget_period_days: float = ledger.DEFAULT_BUDGET_PERIOD_DAYS,
) -> Decision:
    """``lattice_scheduler.decide.decide_vcluster`` (what the live scheduler runs for
    one vCluster each cycle) as a :class:`Decision`, plus the decision's
    ``critical_order`` for the engine's idle-cycle skipping."""
    d = decide.decide_vcluster(
        m,
        vc,
        now,
        topology=topology,
        preemption_policy=preemption_policy,
        exclude=held_back,
        home_pools=home_pools,
        budget_period_days=budget_period_days,
    )
    placements = [_placement(p, vc) for p in d.proposals]
    placements += [_placement(p, vc, borrowed=True) for p in d.borrowed]
    critical: tuple[str, ...] | None = None
    if d.nothing_free or not d.queue:
        critical = ()  # nothing queued, or no free node: nothing can start, in any order
    elif not placements and not d.preemptions:
        order = decide.solver_order(d.queue, d.scores)
        if d.backfill_depth <= 0:
            critical = ()
        elif len(d.reservations) >= d.backfill_depth:
            critical = order[: order.index(d.reservations[-1].allocation_id) + 1]
        else:
            critical = order
    return Decision(
        placements=placements,
        preemptions=[(p.victim, p.preemptor) for p in d.preemptions],
        waiting=d.waiting,
        reservations=d.reservations,
        critical_order=critical,
    )


def lattice_queue_order(
    m: StateMirror,
    vc: str,
    now: float,
    budget_period_days: float = ledger.DEFAULT_BUDGET_PERIOD_DAYS,
) -> tuple[str, ...]:
    """The order ``solver.solve`` sorts this vCluster's queue in at ``now``."""
    return decide.queue_order(m, vc, now, budget_period_days=budget_period_days)


class LatticePolicy:
    """The real scheduler (see :func:`lattice_decide`). ``budget_period_days``: the
    budget ledger's window (the live scheduler's ``scheduling.budget_period_days``)."""

    name = "lattice"
    per_vcluster = True
    preempts = True
    borrows = True

    def __init__(
        self,
        preemption_policy: PreemptionPolicy | None = None,
        *,
        budget_period_days: float = ledger.DEFAULT_BUDGET_PERIOD_DAYS,
    ) -> None:
        self.preemption_policy = preemption_policy or PreemptionPolicy()
        self.budget_period_days = budget_period_days

    def node_filter(self, node: Node, spec: AllocationSpec) -> bool:
        return node_satisfies(node, spec)

    def decide(
        self,
        m: StateMirror,
        now: float,
        *,
        vcluster: str | None,
        topology: TopologyModel,
        home_pools: Collection[str] | None = None,
    ) -> Decision:
        assert vcluster is not None
        return lattice_decide(
            m,
            vcluster,
            now,
            topology=topology,
            preemption_policy=self.preemption_policy,
            home_pools=home_pools,
            budget_period_days=self.budget_period_days,
        )

    def queue_order(self, m: StateMirror, now: float, *, vcluster: str | None) -> tuple[str, ...]:
        assert vcluster is not None
        return lattice_queue_order(m, vcluster, now, self.budget_period_days)


# --------------------------------------------------------------------------- baselines


def _end(a: Allocation, start: float) -> float:
    w = a.spec.walltime_seconds
    return start + w if w > 0 else INF


class _ArrivalOrder:
    """FCFS and EASY: one queue in arrival order over every vCluster."""

    name = "fcfs"
    per_vcluster = False
    preempts = False
    borrows = False
    backfill = False

    def __init__(self) -> None:
        self._usable: dict[tuple[object, ...], int] = {}

    def node_filter(self, node: Node, spec: AllocationSpec) -> bool:
        return node_satisfies(node, spec)

    def _never(self, a: Allocation, nodes: Iterable[Node]) -> bool:
        """No set of usable nodes (up or coming back, in its pool) could ever hold it."""
        c = a.spec.constraints
        vc = a.spec.vcluster
        key = (vc, c.gpu_type, c.gpu_count, c.memory_gb, tuple(c.features))
        usable = self._usable.get(key)
        if usable is None:
            usable = self._usable[key] = sum(
                1
                for n in nodes
                if n.state not in (NodeState.DOWN, NodeState.FAILED)
                and not n.disabled
                and n.home_vcluster in ("", vc)
                and node_satisfies(n, a.spec)
            )
        return usable < max(1, a.spec.nodes)

    def decide(
        self,
        m: StateMirror,
        now: float,
        *,
        vcluster: str | None = None,
        topology: TopologyModel | None = None,
        home_pools: Collection[str] | None = None,
    ) -> Decision:
        allocs = m.allocations
        queue = sorted(
            (
                allocs[i]
                for i in m.pending
                if vcluster is None or allocs[i].spec.vcluster == vcluster
            ),
            key=lambda a: (a.submitted_at, a.id),
        )
        if not queue:
            return Decision(critical_order=())
        all_nodes = list(m.nodes.values())
        free = [
            n for n in all_nodes if n.state == NodeState.READY and not n.owner and not n.disabled
        ]
        taken: dict[str, float] = {}  # node id -> expected end of the job placed on it now
        out = Decision()
        head: Allocation | None = None
        rest: list[Allocation] = []
        for i, a in enumerate(queue):
            if self._never(a, all_nodes):
                continue
            chosen = self._fit(a, free, taken, None)
            if chosen is None:
                head, rest = a, queue[i + 1 :]
                break
            self._place(out, a, chosen, taken, now, backfilled=False)
        if head is None or not self.backfill:
            return self._settle(out)
        shadow, reserved = self._reservation(head, m, all_nodes, taken, now)
        for a in rest:
            if self._never(a, all_nodes):
                continue
            avoid = None if _end(a, now) <= shadow else reserved
            chosen = self._fit(a, free, taken, avoid)
            if chosen is not None:
                self._place(out, a, chosen, taken, now, backfilled=True)
        return self._settle(out)

    @staticmethod
    def _settle(out: Decision) -> Decision:
        # Arrival order is fixed and each later allocation is tried on its own: a
        # decision that placed nothing stays so until the state changes or a
        # newcomer fits the free nodes.
        if not out.placements:
            out.critical_order = ()
        return out

    def queue_order(
        self, m: StateMirror, now: float, *, vcluster: str | None = None
    ) -> tuple[str, ...]:
        """Not needed: arrival order never changes (``critical_order`` is ``()``)."""
        return ()

    @staticmethod
    def _fit(
        a: Allocation, free: list[Node], taken: dict[str, float], avoid: set[str] | None
    ) -> list[Node] | None:
        vc = a.spec.vcluster
        cands = [
            n
            for n in free
            if n.id not in taken
            and n.home_vcluster in ("", vc)
            and (avoid is None or n.id not in avoid)
            and node_satisfies(n, a.spec)
        ]
        return pick_nodes(cands, max(1, a.spec.nodes))

    @staticmethod
    def _place(
        out: Decision,
        a: Allocation,
        chosen: list[Node],
        taken: dict[str, float],
        now: float,
        *,
        backfilled: bool,
    ) -> None:
        end = _end(a, now)
        for n in chosen:
            taken[n.id] = end
        out.placements.append(
            Placement(
                allocation_id=a.id,
                node_ids=tuple(sorted(n.id for n in chosen)),
                vcluster=a.spec.vcluster,
                backfilled=backfilled,
                groups_spanned=len({n.group for n in chosen}),
                conformance_fitness=max(
                    sum(1 for x in chosen if x.conformance_group == n.conformance_group)
                    for n in chosen
                )
                / len(chosen),
            )
        )

    @staticmethod
    def _reservation(
        head: Allocation,
        m: StateMirror,
        nodes: list[Node],
        taken: dict[str, float],
        now: float,
    ) -> tuple[float, set[str]]:
        """(shadow time, reserved node ids) for the head: the earliest time ``k`` of
        its nodes are free by the walltimes known now, on the nodes freed last by
        then (so nodes free now stay open to backfill). (inf, {}) when never."""
        vc = head.spec.vcluster
        k = max(1, head.spec.nodes)
        avail: list[tuple[float, str]] = []
        for n in nodes:
            if (
                n.state != NodeState.READY
                or n.disabled
                or n.home_vcluster not in ("", vc)
                or not node_satisfies(n, head.spec)
            ):
                continue
            if n.id in taken:
                t = taken[n.id]
            elif n.owner:
                owner = m.allocations.get(n.owner)
                t = (
                    INF
                    if owner is None or owner.started_at is None
                    else _end(owner, owner.started_at)
                )
                t = max(now, t)
            else:
                t = now
            avail.append((t, n.id))
        avail.sort()
        if len(avail) < k or avail[k - 1][0] == INF:
            return INF, set()
        shadow = avail[k - 1][0]
        ready = [nid for t, nid in avail if t <= shadow]
        return shadow, set(ready[-k:])


class FcfsPolicy(_ArrivalOrder):
    """First come, first served; the head of the queue blocks everything behind it."""

    name = "fcfs"
    backfill = False


class EasyPolicy(_ArrivalOrder):
    """EASY backfill: a reservation for the head only; later jobs may start if they
    do not delay it."""

    name = "easy"
    backfill = True


POLICIES = ("lattice", "fcfs", "easy")


def make_policy(
    name: str,
    *,
    preemption_policy: PreemptionPolicy | None = None,
    budget_period_days: float = ledger.DEFAULT_BUDGET_PERIOD_DAYS,
) -> Policy:
    """The policy called ``name`` (one of :data:`POLICIES`)."""
    if name == "lattice":
        return LatticePolicy(preemption_policy, budget_period_days=budget_period_days)
    if name == "fcfs":
        return FcfsPolicy()
    if name == "easy":
        return EasyPolicy()
    raise ValueError(f"unknown policy {name!r}; one of: {', '.join(POLICIES)}")
