"""Estimated start times for a vCluster's pending allocations.

Three sources, best first:

* ``now``: the cycle is starting it (a proposal of the cycle's decision);
* ``reservation``: the backfill reservation the solver made for it this cycle (the top
  of the queue, exactly as reserved);
* ``simulation``: a forward simulation of the rest of the queue with the decision
  function itself (:func:`lattice_scheduler.decide.decide_vcluster`, the one RM-Replay
  replays), in which every allocation holding nodes ends at the end of its walltime
  (never, without one), a preemption victim releases its nodes
  ``PREEMPTION_RELEASE_SECONDS`` after it was asked to checkpoint and goes back to the
  queue (held back until its preemptor has started, as the live scheduler does), and
  nothing new arrives. It decides at each expected end and, like the live loop, one
  cycle interval after a decision that started or preempted something (a job just
  started can be a victim at the next cycle); it stops at a horizon or when the
  caller's budget runs out. A simulated start earlier than a
  reservation (the allocation preempts its way in) replaces the reservation.

A cycle that finds no free node skips the solver (``decide``'s shortcut), so it makes
no reservation; the simulation then asks the solver for the reservations such a cycle
would have made, so the top of a full cluster's queue is still estimated exactly as
reserved.

Everything here is pure except :class:`Simulation`'s own copy of the state: the live
loop runs the simulation between cycles, step by step, and drops it when the next cycle
is due (:mod:`lattice_scheduler.loop`), so an estimate never delays a decision.
Estimates are rounded to whole seconds so that a state that did not change publishes
nothing new.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import msgspec
from lattice_common.types import (
    ESTIMATE_NOW,
    ESTIMATE_RESERVATION,
    ESTIMATE_SIMULATION,
    Allocation,
    AllocationState,
    StartEstimate,
)
from lattice_common.watch import StateMirror

from lattice_scheduler import decide
from lattice_scheduler.solver import Proposal, solve
from lattice_scheduler.topology import TopologyModel

DEFAULT_HORIZON_SECONDS = 14 * 86_400.0
"""How far the simulation looks ahead; allocations that would start later get none."""

PREEMPTION_RELEASE_SECONDS = 60.0
"""How long a preemption victim is expected to take to checkpoint and release its
nodes (RM-Replay's default ``checkpoint_seconds``)."""

INF = math.inf


def from_decision(d: decide.CycleDecision, now: float) -> dict[str, StartEstimate]:
    """The estimates a cycle's decision gives directly: what it starts (``now``) and
    what it reserved (``reservation``)."""
    out: dict[str, StartEstimate] = {}
    for p in (*d.proposals, *d.borrowed):
        out[p.allocation_id] = _estimate(now, ESTIMATE_NOW, p.node_ids)
    for r in d.reservations:
        out.setdefault(r.allocation_id, _estimate(r.start_time, ESTIMATE_RESERVATION, r.node_ids))
    return out


def _estimate(t: float, basis: str, node_ids: Iterable[str]) -> StartEstimate:
    ids = sorted(node_ids)
    return StartEstimate(
        estimated_start=float(round(t)), estimate_basis=basis, nodes=len(ids), node_ids=ids
    )


def expected_end(a: Allocation, now: float) -> float:
    """When an allocation holding nodes gives them back if it runs its full walltime
    (never without one; at ``now`` at the earliest)."""
    w = a.spec.walltime_seconds
    if w <= 0:
        return INF
    started = a.started_at if a.started_at is not None else now
    return max(now, started + w)


class Simulation:
    """A forward simulation of one vCluster's queue from a cycle's decision.

    Works on its own copy of the nodes and of the allocations it changes (the caller's
    mirror is never touched; the rest of the allocations are read through a snapshot
    the mirror keeps consistent while the live loop applies deltas between steps). :meth:`step` advances to the next expected end and runs
    one decision; :attr:`done` says when there is nothing left to simulate.
    """

    def __init__(
        self,
        m: StateMirror,
        vc: str,
        now: float,
        decision: decide.CycleDecision,
        *,
        horizon_seconds: float = DEFAULT_HORIZON_SECONDS,
        budget_period_days: float | None = None,
    ) -> None:
        self.vc = vc
        self.now = now
        self.limit = now + horizon_seconds
        self.budget_kw = (
            {} if budget_period_days is None else {"budget_period_days": budget_period_days}
        )
        self.estimates = from_decision(decision, now)
        sim = StateMirror()
        sim.revision = m.revision
        sim.nodes = {nid: msgspec.structs.replace(n) for nid, n in m.nodes.items()}
        # copy-on-write: the simulation's own records over the mirror's as they are
        # now (copying all of them cost O(history) per estimate round)
        snapshot = getattr(m, "snapshot_allocations", None)
        sim.allocations = snapshot() if snapshot is not None else dict(m.allocations)  # type: ignore[assignment]
        sim.tenants, sim.vclusters = m.tenants, m.vclusters
        sim.pending, sim.holding = dict(m.pending), dict(m.holding)
        self.m = sim
        self.topology = TopologyModel.from_nodes(sim.nodes)  # owners are read live
        self.home_pools = {n.home_vcluster for n in sim.nodes.values()}
        self.ends: dict[str, float] = {i: expected_end(m.allocations[i], now) for i in m.holding}
        # victim -> its preemptor, for victims that go back to the queue when they end
        self.requeue: dict[str, str] = {}
        for i in m.holding:
            a = m.allocations[i]
            if a.state == AllocationState.CHECKPOINTING and a.preempted_by:
                asked = a.checkpoint_hint_at if a.checkpoint_hint_at is not None else now
                self._preempt(i, a.preempted_by, asked)
        v = m.vclusters.get(vc)
        self.cycle_interval = max(1.0, v.cycle_interval_seconds if v is not None else 5.0)
        self.recheck: float | None = None
        if decision.nothing_free and any(e < INF for e in self.ends.values()):
            self._reserve(decision, now)  # (nothing ever ends: no reservation to make)
        self._start([*decision.proposals, *decision.borrowed], now)
        self._preemptions(decision.preemptions, now)
        self._recheck_after(decision, now)
        self.waiting = {
            i
            for i in sim.pending
            if sim.allocations[i].spec.vcluster == vc
            and (i not in self.estimates or self._reserved(i))
        }
        self.t = now
        self.finished = not self.waiting

    def _preempt(self, victim: str, preemptor: str, asked: float) -> None:
        if victim in self.ends:
            self.ends[victim] = max(
                self.now, min(self.ends[victim], asked + PREEMPTION_RELEASE_SECONDS)
            )
            self.requeue[victim] = preemptor

    def _preemptions(self, preemptions: Iterable[decide.Preemption], t: float) -> None:
        for p in preemptions:
            self._preempt(p.victim, p.preemptor, t)

    def _reserve(self, decision: decide.CycleDecision, now: float) -> None:
        """The reservations of a cycle that found no free node (it skipped the solver)."""
        m, vc = self.m, self.vc
        score = decide.scorer(m, vc, now, **self.budget_kw)
        res = solve(
            decision.queue,
            m.nodes,
            [m.allocations[i] for i in m.holding],
            score=score,
            now=now,
            backfill_depth=decide.backfill_depth(m, vc),
            vcluster=vc,
            tenants=m.tenants,
            topology=self.topology,
        )
        for r in res.reservations:
            e = _estimate(r.start_time, ESTIMATE_RESERVATION, r.node_ids)
            self.estimates.setdefault(r.allocation_id, e)

    def _reserved(self, aid: str) -> bool:
        return self.estimates[aid].estimate_basis == ESTIMATE_RESERVATION

    @property
    def done(self) -> bool:
        return self.finished

    def _start(self, proposals: Iterable[Proposal], t: float) -> None:
        m = self.m
        for p in proposals:
            a = m.allocations.get(p.allocation_id)
            if a is None or a.state != AllocationState.PENDING:
                continue
            m.allocations[a.id] = b = msgspec.structs.replace(
                a, state=AllocationState.RUNNING, started_at=t, assigned_nodes=list(p.node_ids)
            )
            m.pending.pop(a.id, None)
            m.holding[a.id] = None
            for nid in p.node_ids:
                n = m.nodes[nid]
                n.owner, n.owner_tenant, n.owner_vcluster = a.id, a.spec.tenant, self.vc
            self.ends[a.id] = expected_end(b, t)

    def _end_until(self, t: float) -> None:
        m = self.m
        for aid in [i for i, e in self.ends.items() if e <= t]:
            del self.ends[aid]
            a = m.allocations[aid]
            preemptor = self.requeue.pop(aid, "")
            if preemptor:  # back to the queue, held until its preemptor has started
                m.allocations[aid] = msgspec.structs.replace(
                    a,
                    state=AllocationState.PENDING,
                    preempted_by=preemptor,
                    assigned_nodes=[],
                    started_at=None,
                )
                m.pending[aid] = None
            else:
                m.allocations[aid] = msgspec.structs.replace(
                    a, state=AllocationState.COMPLETED, finished_at=t
                )
            m.holding.pop(aid, None)
            for nid in a.assigned_nodes:
                n = m.nodes.get(nid)
                if n is not None and n.owner == aid:
                    n.owner, n.owner_tenant, n.owner_vcluster = "", "", ""

    def step(self) -> None:
        """Advance to the next decision time (an expected end, or the cycle after a
        decision that changed something), free what ends then and decide once."""
        if self.finished:
            return
        nxt = min(self.ends.values(), default=INF)
        if self.recheck is not None and self.recheck < nxt:
            nxt = self.recheck
        self.recheck = None
        if nxt == INF or nxt > self.limit:
            self.finished = True
            return
        self.t = nxt
        self._end_until(nxt)
        d = decide.decide_vcluster(
            self.m,
            self.vc,
            nxt,
            topology=self.topology,
            home_pools=self.home_pools,
            **self.budget_kw,
        )
        started = [*d.proposals, *d.borrowed]
        for p in started:
            aid = p.allocation_id
            if aid in self.waiting:
                self.waiting.discard(aid)
                known = self.estimates.get(aid)
                # a reservation stays as reserved, unless preemption lets it in earlier
                if known is None or (known.estimated_start or INF) > round(nxt):
                    self.estimates[aid] = _estimate(nxt, ESTIMATE_SIMULATION, p.node_ids)
        self._start(started, nxt)
        self._preemptions(d.preemptions, nxt)
        self._recheck_after(d, nxt)
        if not self.waiting:
            self.finished = True

    def _recheck_after(self, d: decide.CycleDecision, t: float) -> None:
        """A decision that started or preempted something changes what the next cycle
        may do (a just-started allocation can be a preemption victim): the live loop
        decides again one cycle interval later, and so does the simulation."""
        if d.proposals or d.borrowed or d.preemptions:
            self.recheck = t + self.cycle_interval

    def run(self, keep_going: Callable[[], bool] = lambda: True) -> dict[str, StartEstimate]:
        """Step until done or until ``keep_going()`` says stop; the estimates so far."""
        while not self.finished and keep_going():
            self.step()
        return self.estimates

    def unreachable(self) -> list[str]:
        """Once done: pending allocations that would not start within the horizon."""
        if not self.finished:
            return []
        return sorted(a for a in self.waiting if a not in self.estimates)


def estimate_starts(
    m: StateMirror,
    vc: str,
    now: float,
    decision: decide.CycleDecision,
    *,
    keep_going: Callable[[], bool] = lambda: True,
    horizon_seconds: float = DEFAULT_HORIZON_SECONDS,
) -> dict[str, StartEstimate]:
    """Every estimate the decision and a simulation within ``keep_going`` give."""
    return Simulation(m, vc, now, decision, horizon_seconds=horizon_seconds).run(keep_going)


def changed(
    estimates: Mapping[str, StartEstimate], allocations: Mapping[str, Allocation]
) -> dict[str, StartEstimate]:
    """The estimates that differ from what the allocations carry."""
    out = {}
    for aid, e in estimates.items():
        a = allocations.get(aid)
        if a is None or a.state != AllocationState.PENDING:
            continue
        if (a.estimated_start, a.estimate_basis) != (e.estimated_start, e.estimate_basis):
            out[aid] = e
    return out


__all__ = [
    "DEFAULT_HORIZON_SECONDS",
    "PREEMPTION_RELEASE_SECONDS",
    "Simulation",
    "changed",
    "estimate_starts",
    "expected_end",
    "from_decision",
]
