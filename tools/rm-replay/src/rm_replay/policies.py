"""The scheduling policies a replay can run: the real Lattice scheduler and two baselines.

* ``lattice``: :func:`lattice_decide` is ``lattice_scheduler.loop.Scheduler.cycle`` for
  one vCluster, step for step, minus the I/O: task-group limits
  (``placement.limit_task_groups``), the cheap path when no node is free
  (``placement.plan_cycle`` for the reasons), scoring with the vCluster's weights
  (``cost.build_context`` + ``cost.score``; arrival order for ``interactive-fifo``),
  ``solver.solve`` (GreedyTopologyAwareBackfill with the vCluster's backfill depth),
  node ranges shrunk to what is free (``min_nodes``), elastic borrowing of idle pools (``solve`` again, depth 0) and preemption
  (``preemption.select_victims`` for the top blocked allocations). Instead of proposing
  commands it returns them as a :class:`Decision`; the engine applies them the way
  the quorum would. Nothing of the scheduler is re-implemented here.
* ``fcfs``: strict arrival order (original submit time), no backfill: the first
  allocation that does not fit blocks every later one.
* ``easy``: EASY backfill. Arrival order; the first allocation that does not fit (the
  head) gets a reservation: the earliest time enough of its nodes are free, from the
  running allocations' walltime ends, on the nodes freed last by then. A later
  allocation starts now if it fits in free nodes and either ends (now + walltime)
  by the reservation or stays off the reserved nodes. Only the head is protected.

The baselines allocate whole nodes with the live scheduler's own filter
(``placement.satisfies``, with the solver's flags such as ``require_conformance``
taken out of the features: the baselines ignore those hints) and pack with
``placement.pick_nodes`` (fewest dragonfly groups); allocations that no node set
could ever satisfy are passed over instead of blocking the queue. Neither preempts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

import msgspec
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    Constraints,
    CostWeights,
    Node,
    NodeState,
    SchedulerType,
)
from lattice_common.watch import StateMirror
from lattice_scheduler import cost, decide
from lattice_scheduler.loop import PREEMPTION_CANDIDATES_PER_CYCLE
from lattice_scheduler.placement import (
    eligible,
    limit_task_groups,
    order_pending,
    pick_nodes,
    plan_cycle,
    satisfies,
)
from lattice_scheduler.preemption import PreemptionPolicy, select_victims
from lattice_scheduler.solver import (
    REASON_OCCUPIED,
    SOLVER_FLAGS,
    Pending,
    Proposal,
    Reservation,
    node_satisfies,
    solve,
)
from lattice_scheduler.topology import TopologyModel

__all__ = [
    "POLICIES",
    "Decision",
    "EasyPolicy",
    "FcfsPolicy",
    "LatticePolicy",
    "Placement",
    "Policy",
    "baseline_constraints",
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


def lattice_scorer(m: StateMirror, vc: str, now: float) -> Callable[[Allocation], float]:
    """``Scheduler._scorer``: Score(j) = sum w_i f_i(j) with the vCluster's weights, or
    arrival order for interactive-fifo."""
    v = m.vclusters.get(vc)
    if v is not None and v.scheduler_type == SchedulerType.INTERACTIVE_FIFO:
        return lambda a: -a.submitted_at
    ctx = cost.build_context(m, now, vcluster=vc)
    weights = v.weights if v is not None else CostWeights()
    return lambda a: cost.score(a, ctx, weights)


def held_back_ids(m: StateMirror) -> set[str]:
    """Preempted allocations waiting until the one they made room for has started."""
    allocs = m.allocations
    return {
        i
        for i in m.pending
        if (p := allocs[i].preempted_by)
        and p in allocs
        and allocs[p].state == AllocationState.PENDING
    }


def solver_order(pending: Iterable[Allocation], scores: Mapping[str, float]) -> tuple[str, ...]:
    """Step 1 of ``solver.solve``: score descending, then preemption class descending,
    original submit time, id."""
    return tuple(
        a.id
        for a in sorted(
            pending, key=lambda a: (-scores[a.id], -a.spec.preemption_class, a.submitted_at, a.id)
        )
    )


def _lattice_queue(
    m: StateMirror, vc: str, held_back: Collection[str]
) -> tuple[list[Allocation], list[Allocation], list[Any]]:
    """What ``Scheduler.cycle`` hands the solver: the vCluster's Pending allocations
    (not held back) within their task-group limits, the held-back-by-limit ones'
    reasons, and the allocations holding nodes."""
    allocs = m.allocations
    pending = [allocs[i] for i in m.pending if allocs[i].spec.vcluster == vc and i not in held_back]
    holding = [allocs[i] for i in m.holding]
    if not pending:
        return [], holding, []
    pending, limited = limit_task_groups(pending, holding)
    return pending, holding, list(limited)


def lattice_queue_order(m: StateMirror, vc: str, now: float) -> tuple[str, ...]:
    """The order ``solver.solve`` sorts this vCluster's queue in at ``now`` (the
    allocations :func:`lattice_decide` passes it, scored by the same scorer)."""
    pending, _, _ = _lattice_queue(m, vc, held_back_ids(m))
    if not pending:
        return ()
    scorer = lattice_scorer(m, vc, now)
    return solver_order(pending, {a.id: float(scorer(a)) for a in pending})


def lattice_decide(
    m: StateMirror,
    vc: str,
    now: float,
    *,
    topology: TopologyModel | None = None,
    preemption_policy: PreemptionPolicy | None = None,
    held_back: Collection[str] | None = None,
    home_pools: Collection[str] | None = None,
) -> Decision:
    """One vCluster's part of ``Scheduler.cycle`` on the mirror ``m`` at ``now``.

    Pure: reads ``m``, changes nothing. ``topology`` defaults to a model built from
    ``m.nodes`` (as the loop does every cycle). ``home_pools``: the set of nodes'
    ``home_vcluster`` values, when the caller knows it (lets borrowing skip its scan
    of every node when no other pool exists; the outcome is the same)."""
    if topology is None:
        topology = TopologyModel.from_nodes(m.nodes)
    policy = preemption_policy or PreemptionPolicy()
    if held_back is None:
        held_back = held_back_ids(m)
    allocs = m.allocations
    pending, holding, limited = _lattice_queue(m, vc, held_back)
    if not pending:
        return Decision(critical_order=())
    v = m.vclusters.get(vc)
    if not any(n.schedulable for n in m.nodes.values()):
        _, waiting = plan_cycle(
            vcluster=vc,
            allocations=allocs,
            nodes=m.nodes,
            tenants=m.tenants,
            pending_ids=[a.id for a in pending],
            holding_ids=m.holding,
        )
        waiting = [Pending(w.allocation_id, w.reason) for w in (*waiting, *limited)]
        return Decision(
            preemptions=_preempt_for(m, vc, waiting, [], now, policy, home_pools),
            waiting=waiting,
            critical_order=(),  # no free node: nothing can start, in any order
        )
    fifo = v is not None and v.scheduler_type == SchedulerType.INTERACTIVE_FIFO
    depth = 0 if fifo else (v.backfill_depth if v is not None else 10)
    scorer = lattice_scorer(m, vc, now)
    result = solve(
        pending,
        m.nodes,
        holding,
        score=scorer,
        now=now,
        backfill_depth=depth,
        vcluster=vc,
        tenants=m.tenants,
        topology=topology,
    )
    proposals = list(result.proposals)
    waiting = [*result.pending, *(Pending(w.allocation_id, w.reason) for w in limited)]
    proposals, waiting = decide.shrink_ranges(m, vc, pending, proposals, waiting, now)
    borrowed: list[Proposal] = []
    other_pools = home_pools is None or any(h not in ("", vc) for h in home_pools)
    if (v is None or v.allow_borrowing) and other_pools:
        borrowed, waiting = decide.borrow(m, vc, pending, waiting, proposals, now, scorer)
    placements = [_placement(p, vc) for p in proposals]
    placements += [_placement(p, vc, borrowed=True) for p in borrowed]
    preemptions = _preempt_for(m, vc, waiting, [*proposals, *borrowed], now, policy, home_pools)
    critical: tuple[str, ...] | None = None
    if not placements and not preemptions:
        order = solver_order(pending, result.scores)
        if depth <= 0:
            critical = ()
        elif len(result.reservations) >= depth:
            critical = order[: order.index(result.reservations[-1].allocation_id) + 1]
        else:
            critical = order
    return Decision(
        placements=placements,
        preemptions=preemptions,
        waiting=waiting,
        reservations=list(result.reservations),
        critical_order=critical,
    )


def _preempt_for(
    m: StateMirror,
    vc: str,
    waiting: list[Pending],
    proposals: list[Proposal],
    now: float,
    policy: PreemptionPolicy,
    home_pools: Collection[str] | None = None,
) -> list[tuple[str, str]]:
    """``Scheduler._preempt_for``: victims for the highest blocked allocations. The
    only change: it returns early, before scanning the nodes, when no running
    allocation could be a victim (nothing of a lower class, nothing reclaimable), in
    which case the loop's ``select_victims`` calls all come back empty."""
    occupied = [w.allocation_id for w in waiting if w.reason == REASON_OCCUPIED]
    if not occupied:
        return []
    allocs = m.allocations
    running = [allocs[i] for i in m.holding if allocs[i].state == AllocationState.RUNNING]
    nodes = m.nodes
    reclaimable: frozenset[str] = frozenset()
    if home_pools is None or vc in home_pools:  # else no node has vc as its home
        reclaimable = frozenset(
            a.id
            for a in running
            if a.spec.vcluster != vc
            and any(n in nodes and nodes[n].home_vcluster == vc for n in a.assigned_nodes)
        )
    top = max(allocs[i].spec.preemption_class for i in occupied)
    if not reclaimable and not any(a.spec.preemption_class < top for a in running):
        return []
    taken = {n for p in proposals for n in p.node_ids}
    free = [n for n in nodes.values() if eligible(n, vc) and n.id not in taken]
    releasing_for = {
        allocs[i].preempted_by
        for i in m.holding
        if allocs[i].state == AllocationState.CHECKPOINTING
    }
    jobs = order_pending(allocs[i] for i in occupied)
    chosen: set[str] = set()
    out: list[tuple[str, str]] = []
    for job in jobs[:PREEMPTION_CANDIDATES_PER_CYCLE]:
        if job.id in releasing_for or (job.spec.preemption_class == 0 and not reclaimable):
            continue
        victims = select_victims(
            job,
            [a for a in running if a.id not in chosen],
            nodes,
            now=now,
            free_nodes=free,
            policy=policy,
            reclaimable=reclaimable,
        )
        if not victims:
            continue
        chosen.update(victims)
        out.extend((victim, job.id) for victim in victims)
    return out


class LatticePolicy:
    """The real scheduler (see :func:`lattice_decide`)."""

    name = "lattice"
    per_vcluster = True
    preempts = True
    borrows = True

    def __init__(self, preemption_policy: PreemptionPolicy | None = None) -> None:
        self.preemption_policy = preemption_policy or PreemptionPolicy()

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
        )

    def queue_order(self, m: StateMirror, now: float, *, vcluster: str | None) -> tuple[str, ...]:
        assert vcluster is not None
        return lattice_queue_order(m, vcluster, now)


# --------------------------------------------------------------------------- baselines


def baseline_constraints(spec: AllocationSpec) -> Constraints:
    """The hard constraints the baselines check with ``placement.satisfies``: the
    request without the solver's flags (``require_conformance`` and friends live in
    ``features`` but are not node features)."""
    c = spec.constraints
    if not any(f in SOLVER_FLAGS for f in c.features):
        return c
    return Constraints(
        gpu_type=c.gpu_type,
        gpu_count=c.gpu_count,
        features=[f for f in c.features if f not in SOLVER_FLAGS],
        memory_gb=c.memory_gb,
        topology=c.topology,
    )


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
        return satisfies(node, baseline_constraints(spec))

    def _never(self, a: Allocation, nodes: Iterable[Node]) -> bool:
        """No set of usable nodes (up or coming back, in its pool) could ever hold it."""
        c = baseline_constraints(a.spec)
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
                and satisfies(n, c)
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
        c = baseline_constraints(a.spec)
        vc = a.spec.vcluster
        cands = [
            n
            for n in free
            if n.id not in taken
            and n.home_vcluster in ("", vc)
            and (avoid is None or n.id not in avoid)
            and satisfies(n, c)
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
        c = baseline_constraints(head.spec)
        vc = head.spec.vcluster
        k = max(1, head.spec.nodes)
        avail: list[tuple[float, str]] = []
        for n in nodes:
            if (
                n.state != NodeState.READY
                or n.disabled
                or n.home_vcluster not in ("", vc)
                or not satisfies(n, c)
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


def make_policy(name: str, *, preemption_policy: PreemptionPolicy | None = None) -> Policy:
    """The policy called ``name`` (one of :data:`POLICIES`)."""
    if name == "lattice":
        return LatticePolicy(preemption_policy)
    if name == "fcfs":
        return FcfsPolicy()
    if name == "easy":
        return EasyPolicy()
    raise ValueError(f"unknown policy {name!r}; one of: {', '.join(POLICIES)}")
