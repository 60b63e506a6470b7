"""What the scheduler would do, computed on this member's state: a vCluster's queue
(order, score, factor breakdown, pending reason, reservation, estimated start) and a
test-only submission's estimated start.

Both run the scheduler's own pure functions (``lattice_scheduler.decide``,
``.estimate``, ``.cost``) on a copy of the committed state, so what they show is what a
cycle would decide now; no scheduler process is asked and nothing is proposed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
from lattice_common.errors import NotFound
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    CostWeights,
    SchedulerType,
    StartEstimate,
)
from lattice_common.watch import StateMirror
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum
from lattice_scheduler import cost, decide, estimate

from lattice_api import access
from lattice_api.auth import Identity

TEST_ONLY_ID = "test-only"
SIMULATION_SECONDS = 2.0  # wall time a test-only or queue request may simulate


def _deadline(seconds: float) -> Callable[[], bool]:
    end = time.perf_counter() + seconds
    return lambda: time.perf_counter() < end


class QueueOps:
    def __init__(self, quorum: Quorum, *, budget_period_days: float) -> None:
        self.quorum = quorum
        self.budget_period_days = budget_period_days

    def _view(self) -> StateMirror:
        self.quorum.require_caught_up()
        return self.quorum.read(queries.scheduling_view, history=True)

    def _decide(self, m: StateMirror, vc: str, now: float) -> decide.CycleDecision:
        return decide.decide_vcluster(m, vc, now, budget_period_days=self.budget_period_days)

    def _scores(
        self, m: StateMirror, vc: str, now: float, d: decide.CycleDecision
    ) -> dict[str, float]:
        """The decision's scores; a cycle with no free node skips the solver and does
        not score, so those are worked out here (the order it would consider)."""
        if d.scores:
            return dict(d.scores)
        score = decide.scorer(m, vc, now, budget_period_days=self.budget_period_days)
        return {a.id: float(score(a)) for a in d.queue}

    # --- test-only submission ------------------------------------------------------

    def test_only(self, spec: AllocationSpec) -> StartEstimate:
        """When and where ``spec`` would start if submitted now (nothing is stored)."""
        now = time.time()
        m = self._view()
        a = Allocation(id=TEST_ONLY_ID, spec=spec, state=AllocationState.PENDING, submitted_at=now)
        m.allocations[a.id] = a
        m.pending[a.id] = None
        d = self._decide(m, spec.vcluster, now)
        sim = estimate.Simulation(
            m, spec.vcluster, now, d, budget_period_days=self.budget_period_days
        )
        got = sim.run(_deadline(SIMULATION_SECONDS)).get(a.id)
        order = decide.solver_order(d.queue, self._scores(m, spec.vcluster, now, d))
        reason = next((w.text for w in d.waiting if w.allocation_id == a.id), "")
        base = got or StartEstimate()
        return msgspec.structs.replace(
            base,
            nodes=base.nodes or spec.nodes,
            position=order.index(a.id) + 1 if a.id in order else 0,
            pending_reason="" if base.estimate_basis == "now" else reason,
        )

    # --- the queue view --------------------------------------------------------------

    def queue(self, who: Identity, vcluster: str, *, all_users: bool = False) -> dict[str, Any]:
        """The vCluster's pending allocations in the order the solver considers them,
        the caller's own unless ``all_users`` (the listing rule); positions count
        everyone's."""
        user = access.listing_user(who, None, all_users)
        now = time.time()
        m = self._view()
        v = m.vclusters.get(vcluster)
        if v is None and not any(a.spec.vcluster == vcluster for a in m.allocations.values()):
            raise NotFound(
                f'vCluster "{vcluster}" not found',
                hint="List vClusters with `lattice admin vcluster list`.",
            )
        d = self._decide(m, vcluster, now)
        ctx = cost.build_context(
            m, now, vcluster=vcluster, budget_period_days=self.budget_period_days
        )
        weights = v.weights if v is not None else CostWeights()
        fifo = v is not None and v.scheduler_type == SchedulerType.INTERACTIVE_FIFO
        scores = self._scores(m, vcluster, now, d)
        order = decide.solver_order(d.queue, scores)
        in_queue = {a.id: a for a in d.queue}
        # held back (task-group limits, preempted victims): after the solver's queue
        rest = sorted(
            (
                m.allocations[i]
                for i in m.pending
                if i not in in_queue and m.allocations[i].spec.vcluster == vcluster
            ),
            key=lambda a: (a.submitted_at, a.id),
        )
        why = {w.allocation_id: w.text for w in d.waiting}
        reserved = {r.allocation_id: r for r in d.reservations}
        fresh = estimate.from_decision(d, now)
        entries = []
        for pos, a in enumerate([*(in_queue[i] for i in order), *rest], start=1):
            if user is not None and a.spec.user != user:
                continue
            e = fresh.get(a.id)
            start, basis = (
                (e.estimated_start, e.estimate_basis)
                if e is not None
                else (a.estimated_start, a.estimate_basis)
            )
            r = reserved.get(a.id)
            entries.append(
                {
                    "position": pos,
                    "allocation": a,
                    "score": scores.get(a.id, 0.0),
                    "breakdown": {} if fifo else cost.breakdown(a, ctx, weights),
                    "pending_reason": "" if basis == "now" else why.get(a.id, a.pending_reason),
                    "reserved_start": r.start_time if r is not None else None,
                    "reserved_nodes": list(r.node_ids) if r is not None else [],
                    "estimated_start": start,
                    "estimate_basis": basis,
                }
            )
        return {
            "vcluster": vcluster,
            "entries": entries,
            "total": len(order) + len(rest),
            "computed_at": now,
        }


__all__ = ["TEST_ONLY_ID", "QueueOps"]
