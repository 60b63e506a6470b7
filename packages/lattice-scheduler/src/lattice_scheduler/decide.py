"""Decision steps of a scheduling cycle that come after the solver, as plain functions
on a StateMirror: the live loop and RM-Replay both call these (one implementation)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from lattice_common.types import Allocation
from lattice_common.watch import StateMirror

from lattice_scheduler.preemption import NEVER_PREEMPTED_CLASS
from lattice_scheduler.solver import Pending, Proposal, solve

OCCUPIED = "all suitable nodes occupied"


def shrink_ranges(
    m: StateMirror,
    vc: str,
    pending: list[Allocation],
    proposals: list[Proposal],
    waiting: list[Pending],
    now: float,
) -> tuple[list[Proposal], list[Pending]]:
    """Allocations with a node range {min, max} that could not get ``max`` nodes take as
    many free nodes as there are, down to ``min`` (services scale later)."""
    blocked = {w.allocation_id for w in waiting if w.reason == OCCUPIED}
    ranged = [a for a in pending if a.id in blocked and a.spec.min_nodes]
    if not ranged:
        return proposals, waiting
    taken = {n for p in proposals for n in p.node_ids}
    free = {nid: n for nid, n in m.nodes.items() if nid not in taken}
    placed: list[Proposal] = []
    for a in ranged:
        for k in range(a.spec.nodes - 1, a.spec.min_nodes - 1, -1):
            trial = msgspec.structs.replace(a, spec=msgspec.structs.replace(a.spec, nodes=k))
            res = solve(
                [trial],
                free,
                [],
                score=lambda _a: 0.0,
                now=now,
                backfill_depth=0,
                vcluster=vc,
                tenants=m.tenants,
            )
            if res.proposals:
                placed.append(res.proposals[0])
                for nid in res.proposals[0].node_ids:
                    free.pop(nid, None)
                break
    done = {p.allocation_id for p in placed}
    return [*proposals, *placed], [w for w in waiting if w.allocation_id not in done]


def borrow(
    m: StateMirror,
    vc: str,
    pending: list[Allocation],
    waiting: list[Pending],
    proposals: list[Proposal],
    now: float,
    score: Callable[[Allocation], float],
) -> tuple[list[Proposal], list[Pending]]:
    """Elastic sharing: still-blocked work (never class 10: a borrowed node can be
    reclaimed at any time) goes to idle nodes of other vClusters' home pools whose own
    vCluster has nothing pending. Returns the borrowed placements and what still waits."""
    blocked = {w.allocation_id for w in waiting if w.reason == OCCUPIED}
    candidates = [
        a for a in pending if a.id in blocked and a.spec.preemption_class < NEVER_PREEMPTED_CLASS
    ]
    if not candidates:
        return [], waiting
    busy_homes = {m.allocations[i].spec.vcluster for i in m.pending}
    taken = {n for p in proposals for n in p.node_ids}
    lendable = {
        nid: msgspec.structs.replace(n, home_vcluster="")
        for nid, n in m.nodes.items()
        if n.home_vcluster not in ("", vc)
        and n.home_vcluster not in busy_homes
        and n.schedulable
        and nid not in taken
    }
    if not lendable:
        return [], waiting
    res = solve(
        candidates,
        lendable,
        [],
        score=score,
        now=now,
        backfill_depth=0,
        vcluster=vc,
        tenants=m.tenants,
    )
    placed = {p.allocation_id for p in res.proposals}
    return list(res.proposals), [w for w in waiting if w.allocation_id not in placed]
