"""Estimated start times for a vCluster's pending allocations.

Three sources, best first:

* ``now``: the cycle is starting it (a proposal of the cycle's decision);
* ``reservation``: the backfill reservation the solver made for it this cycle (the top
  of the queue, exactly as reserved);
* ``simulation``: a forward simulation of the rest of the queue with the decision
  function itself (:func:`lattice_scheduler.decide.decide_vcluster`, the one RM-Replay
  replays), in which every allocation holding nodes ends at the end of its walltime
  (never, without one) and nothing new arrives. It steps from one expected end to the
  next and stops at a horizon or when the caller's budget runs out.

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
from lattice_scheduler.solver import Proposal
from lattice_scheduler.topology import TopologyModel

DEFAULT_HORIZON_SECONDS = 14 * 86_400.0
"""How far the simulation looks ahead; allocations that would start later get none."""

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
    mirror is never touched). :meth:`step` advances to the next expected end and runs
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
        sim.allocations = dict(m.allocations)
        sim.tenants, sim.vclusters = m.tenants, m.vclusters
        sim.pending, sim.holding = dict(m.pending), dict(m.holding)
        self.m = sim
        self.topology = TopologyModel.from_nodes(sim.nodes)  # owners are read live
        self.home_pools = {n.home_vcluster for n in sim.nodes.values()}
        self.ends: dict[str, float] = {i: expected_end(m.allocations[i], now) for i in m.holding}
        self._start([*decision.proposals, *decision.borrowed], now)
        self.waiting = {
            i
            for i in sim.pending
            if sim.allocations[i].spec.vcluster == vc
            and (i not in self.estimates or self._reserved(i))
        }
        self.t = now
        self.finished = not self.waiting

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
            m.allocations[aid] = msgspec.structs.replace(
                a, state=AllocationState.COMPLETED, finished_at=t
            )
            m.holding.pop(aid, None)
            for nid in a.assigned_nodes:
                n = m.nodes.get(nid)
                if n is not None and n.owner == aid:
                    n.owner, n.owner_tenant, n.owner_vcluster = "", "", ""

    def step(self) -> None:
        """Advance to the next expected end, free what ends then and decide once."""
        if self.finished:
            return
        nxt = min(self.ends.values(), default=INF)
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
            exclude=(),
            home_pools=self.home_pools,
            **self.budget_kw,
        )
        started = [*d.proposals, *d.borrowed]
        for p in started:
            aid = p.allocation_id
            if aid in self.waiting:
                self.waiting.discard(aid)
                if aid not in self.estimates:  # a reservation stays as reserved
                    self.estimates[aid] = _estimate(nxt, ESTIMATE_SIMULATION, p.node_ids)
        self._start(started, nxt)
        if not self.waiting:
            self.finished = True

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
    "Simulation",
    "changed",
    "estimate_starts",
    "expected_end",
    "from_decision",
]
