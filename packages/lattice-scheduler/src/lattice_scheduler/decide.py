"""One vCluster's scheduling decision, as a plain function on a StateMirror.

``decide_vcluster`` is the whole of a cycle for one vCluster minus the I/O: the live
loop (``loop.Scheduler.cycle``) proposes what it returns to the quorum, RM-Replay
applies it to its simulated state. One implementation, so a replay shows what the
scheduler would do.

Steps, by the vCluster's scheduler type:

* queue: its Pending allocations, minus those held back (preempted ones waiting for
  their preemptor to start, ``exclude``), within their task-group limits;
* order: Score(j) = sum w_i f_i(j) with the vCluster's current weights
  (``cost.build_context`` with the budget window ``scheduling.budget_period_days``,
  as the API's usage, + ``cost.score``); arrival order for ``interactive-fifo``;
* solve: ``solver.solve`` (GreedyTopologyAwareBackfill) with the vCluster's backfill
  depth (``hpc-backfill``), none for ``interactive-fifo``, ``service-binpack`` (services
  have no walltime to reserve around: the solver's tightest-fitting-group choice packs
  them densely) and ``sensitive-reservation``;
* node ranges: allocations with {min_nodes, nodes} take what is free, down to min;
  reactive allocations start with exactly min_nodes (the autoscaler grows them);
* elastic borrowing (not for sensitive work, not of sensitive pools): still-blocked
  preemptible work goes to idle nodes of other vClusters' pools;
* preemption: victims for the top blocked allocations.

A hand-over cycle (``shortlist``) considers only the allocations it is given: the head
of the last full cycle's order and those that arrived since (``loop.Scheduler``). It
decides proposals and reservations (which busy node runs what next) and nothing else:
no borrowing, no preemption, no pending reasons. On a full cluster a node hand-over
happens once per ending job; a full cycle scores and solves the whole queue, so the
hand-overs of many short jobs cost O(pending) each without it.

``sensitive-reservation``: nodes are claimed by a user (the quorum records the claim
when a sensitive allocation is assigned) and serve only that user's sensitive work.
Each user's allocations go first to that user's idle claimed nodes, then to unclaimed
nodes; nodes whose conformance fingerprint drifted are excluded; no backfill, no
borrowing; the allocations are class 10 (never preempted) and may preempt lower
classes (reason ``sensitive``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping

import msgspec
from lattice_common import ledger
from lattice_common.types import (
    NEVER_PREEMPTED_CLASS,
    Allocation,
    AllocationState,
    CostWeights,
    LifecycleType,
    Node,
    SchedulerType,
    claimant,
)
from lattice_common.watch import StateMirror

from lattice_scheduler import autoscale, cost, intranode, reasons
from lattice_scheduler.placement import (
    eligible,
    limit_mutexes,
    limit_task_groups,
    order_pending,
    plan_cycle,
)
from lattice_scheduler.preemption import PreemptionPolicy, non_preemptible, select_victims
from lattice_scheduler.solver import (
    REASON_OCCUPIED,
    Pending,
    Proposal,
    Reservation,
    queue_key,
    solve,
)
from lattice_scheduler.topology import TopologyModel

OCCUPIED = REASON_OCCUPIED
PREEMPTION_CANDIDATES_PER_CYCLE = 3  # blocked allocations considered for preemption per cycle
DEFAULT_BACKFILL_DEPTH = 10


class Preemption(msgspec.Struct, frozen=True):
    """Preempt ``victim`` for ``preemptor``; ``reason`` is the metric label
    (priority / reclaim / sensitive)."""

    victim: str
    preemptor: str
    reason: str


class CycleDecision(msgspec.Struct, kw_only=True):
    """What one vCluster's cycle decided. ``proposals`` go to its own or the shared
    pool, ``borrowed`` to other vClusters' idle pools. ``queue``/``scores``/
    ``backfill_depth``: what the solver saw (RM-Replay uses them to skip cycles that
    cannot decide anything new). ``cost_seconds``: time spent building the scoring
    context."""

    proposals: list[Proposal] = msgspec.field(default_factory=list)
    borrowed: list[Proposal] = msgspec.field(default_factory=list)
    preemptions: list[Preemption] = msgspec.field(default_factory=list)
    waiting: list[Pending] = msgspec.field(default_factory=list)
    reservations: list[Reservation] = msgspec.field(default_factory=list)
    queue: list[Allocation] = msgspec.field(default_factory=list)
    scores: dict[str, float] = msgspec.field(default_factory=dict)
    backfill_depth: int = 0
    nothing_free: bool = False
    cost_seconds: float = 0.0
    #: a hand-over cycle on a shortlist: ``queue`` is the shortlist's part of the queue,
    #: ``waiting`` is empty (the reasons stay as the last full cycle published them)
    shortlisted: bool = False
    #: the scoring context the solver used (hand-over cycles reuse a full cycle's)
    context: cost.ScoringContext | None = None
    #: the solver's order of the queue (empty for sensitive-reservation)
    order: list[str] = msgspec.field(default_factory=list)


def scheduler_type(m: StateMirror, vc: str) -> SchedulerType:
    v = m.vclusters.get(vc)
    return v.scheduler_type if v is not None else SchedulerType.HPC_BACKFILL


def backfill_depth(m: StateMirror, vc: str) -> int:
    v = m.vclusters.get(vc)
    if scheduler_type(m, vc) != SchedulerType.HPC_BACKFILL:
        return 0
    return v.backfill_depth if v is not None else DEFAULT_BACKFILL_DEPTH


def scorer(
    m: StateMirror,
    vc: str,
    now: float,
    ctx: cost.ScoringContext | None = None,
    *,
    budget_period_days: float = ledger.DEFAULT_BUDGET_PERIOD_DAYS,
) -> Callable[[Allocation], float]:
    """This cycle's ordering for a vCluster: Score(j) = sum w_i f_i(j) with the
    vCluster's current weights (re-read every cycle, so set-weights needs no restart),
    or arrival order for interactive-fifo. ``ctx``: the cycle's scoring context when
    the caller has built it."""
    v = m.vclusters.get(vc)
    if v is not None and v.scheduler_type == SchedulerType.INTERACTIVE_FIFO:
        return lambda a: -a.submitted_at
    if ctx is None:
        ctx = cost.build_context(m, now, vcluster=vc, budget_period_days=budget_period_days)
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


def queue(
    m: StateMirror, vc: str, exclude: Collection[str]
) -> tuple[list[Allocation], list[Allocation], list[Pending]]:
    """The vCluster's Pending allocations (minus ``exclude`` and those waiting for their
    dependencies) within their task-group limits, the allocations holding nodes, and the
    reasons of those held by a limit."""
    allocs = m.allocations
    pending = [
        a
        for i in m.pending
        if (a := allocs[i]).spec.vcluster == vc and not a.held and i not in exclude
    ]
    holding = [allocs[i] for i in m.holding]
    if not pending:
        return [], holding, []
    pending = [starting_size(a) for a in pending]
    limited: list[Pending] = []
    if any(a.task_group_concurrency and a.task_group_id for a in pending):
        # (its order does not matter: limit_mutexes orders by submission, ids unique)
        pending, limited = limit_task_groups(pending, holding)
    pending, waiting = limit_mutexes(pending, holding)
    return pending, holding, [*limited, *waiting]


def starting_size(a: Allocation) -> Allocation:
    """A reactive allocation starts with ``min_nodes`` (spec: Autoscaling, Scaling Loop)
    and the autoscaler grows it; the cycle considers it as asking for exactly that."""
    if a.spec.lifecycle != LifecycleType.REACTIVE or not a.spec.min_nodes:
        return a
    return msgspec.structs.replace(
        a, spec=msgspec.structs.replace(a.spec, nodes=a.spec.min_nodes, min_nodes=0)
    )


def solver_order(pending: Iterable[Allocation], scores: Mapping[str, float]) -> tuple[str, ...]:
    """Step 1 of ``solver.solve`` (``solver.queue_key``)."""
    return tuple(a.id for a in sorted(pending, key=lambda a: queue_key(a, scores[a.id])))


def queue_order(
    m: StateMirror,
    vc: str,
    now: float,
    *,
    budget_period_days: float = ledger.DEFAULT_BUDGET_PERIOD_DAYS,
) -> tuple[str, ...]:
    """The order the solver would consider this vCluster's queue in at ``now``."""
    pending, _, _ = queue(m, vc, held_back_ids(m))
    if not pending:
        return ()
    score = scorer(m, vc, now, budget_period_days=budget_period_days)
    return solver_order(pending, {a.id: float(score(a)) for a in pending})


def drifted(n: Node) -> bool:
    """The node's conformance fingerprint no longer matches its expected baseline."""
    return n.conformance_drift


def decide_vcluster(
    m: StateMirror,
    vc: str,
    now: float,
    *,
    topology: TopologyModel | None = None,
    preemption_policy: PreemptionPolicy | None = None,
    exclude: Collection[str] | None = None,
    home_pools: Collection[str] | None = None,
    budget_period_days: float = ledger.DEFAULT_BUDGET_PERIOD_DAYS,
    reserve_busy: bool = False,
    shortlist: Collection[str] | None = None,
    context: cost.ScoringContext | None = None,
) -> CycleDecision:
    """One vCluster's part of a scheduling cycle on the mirror ``m`` at ``now`` (see the
    module docstring). Pure: reads ``m``, changes nothing.

    ``reserve_busy``: score and reserve even when no node is free (the cheap path skips
    that), so that busy nodes get their next allocations (``next_allocations``): the
    live loop asks for it after a hand-over used one up.

    ``exclude``: allocations not to consider (default: the held-back preempted ones;
    the live loop adds those whose assignment is still in flight). ``topology``
    defaults to a model built from ``m.nodes``. ``home_pools``: the set of nodes'
    ``home_vcluster`` values when the caller knows it (lets borrowing and reclaiming
    skip a scan of every node when no other pool exists; the outcome is the same).
    ``budget_period_days``: the budget ledger's window (``scheduling.budget_period_days``).
    ``shortlist``: a hand-over cycle on these allocations only (the module docstring),
    scored with ``context`` (the last full cycle's, its ``now`` moved on) when given; a
    full cycle when one of them has a task-group or mutex limit, which depends on the
    whole queue. The held-back preempted allocations are left out of the shortlist here
    (``exclude`` need not list them)."""
    policy = preemption_policy or PreemptionPolicy()
    if exclude is None:
        exclude = held_back_ids(m)
    if shortlist is not None:
        short = _shortlist_queue(m, vc, exclude, shortlist)
        if short is not None:
            return _shortlisted(m, vc, now, *short, topology, context, budget_period_days)
        exclude = {*exclude, *held_back_ids(m)}  # a full cycle after all
    pending, holding, limited = queue(m, vc, exclude)
    if not pending:  # every pending one is held by a limit: say why
        return CycleDecision(waiting=list(limited))
    kind = scheduler_type(m, vc)
    if not reserve_busy and not any(n.schedulable for n in m.nodes.values()):
        # no free node anywhere: nothing can start, borrowed or not; keep the cycle
        # cheap (reasons and preemption only)
        _, waiting = plan_cycle(
            vcluster=vc,
            allocations=m.allocations,
            nodes=m.nodes,
            tenants=m.tenants,
            pending_ids=[a.id for a in pending],
            holding_ids=m.holding,
        )
        waiting = [*waiting, *limited]
        return CycleDecision(
            preemptions=preempt_for(
                m, vc, waiting, [], now, policy, home_pools, budget_period_days=budget_period_days
            ),
            waiting=waiting,
            queue=pending,
            nothing_free=True,
        )
    if topology is None:
        topology = TopologyModel.from_nodes(m.nodes)
    depth = backfill_depth(m, vc)
    t0 = time.perf_counter()
    ctx = cost.build_context(m, now, vcluster=vc, budget_period_days=budget_period_days)
    score = scorer(m, vc, now, ctx)
    cost_seconds = time.perf_counter() - t0
    if kind == SchedulerType.SENSITIVE_RESERVATION:
        proposals, waiting, scores = _sensitive(m, vc, pending, holding, score, now)
        reservations: list[Reservation] = []
        order: list[str] = []
    else:
        result = solve(
            pending,
            m.nodes,
            holding,
            score=score,
            now=now,
            backfill_depth=depth,
            vcluster=vc,
            tenants=m.tenants,
            topology=topology,
        )
        proposals, waiting = list(result.proposals), list(result.pending)
        scores, reservations = dict(result.scores), list(result.reservations)
        order = result.order
    waiting = [*waiting, *limited]
    proposals, waiting = shrink_ranges(m, vc, pending, proposals, waiting, now)
    if kind != SchedulerType.SENSITIVE_RESERVATION:  # claimed nodes are not interchangeable
        proposals = prefer_intra_node(m, vc, proposals, reservations, topology)
    borrowed: list[Proposal] = []
    v = m.vclusters.get(vc)
    other_pools = home_pools is None or any(h not in ("", vc) for h in home_pools)
    may_borrow = kind != SchedulerType.SENSITIVE_RESERVATION and (v is None or v.allow_borrowing)
    if may_borrow and other_pools:
        borrowed, waiting = borrow(m, vc, pending, waiting, proposals, now, score)
    preemptions = preempt_for(m, vc, waiting, [*proposals, *borrowed], now, policy, home_pools, ctx)
    return CycleDecision(
        proposals=proposals,
        borrowed=borrowed,
        preemptions=preemptions,
        waiting=explain_over_share(waiting, m.allocations, cost.over_share_tenants(ctx)),
        reservations=reservations,
        queue=pending,
        scores=scores,
        backfill_depth=depth,
        cost_seconds=cost_seconds,
        context=ctx,
        order=order,
    )


def _shortlist_queue(
    m: StateMirror, vc: str, exclude: Collection[str], shortlist: Collection[str]
) -> tuple[list[Allocation], list[Allocation]] | None:
    """``queue`` for a hand-over cycle: the shortlisted allocations still eligible and
    the allocations holding nodes; None when a limit needs the whole queue."""
    allocs = m.allocations
    pending: list[Allocation] = []
    for i in shortlist:
        a = allocs.get(i)
        if a is None or i not in m.pending or a.spec.vcluster != vc or a.held or i in exclude:
            continue
        if (p := a.preempted_by) and p in allocs and allocs[p].state == AllocationState.PENDING:
            continue  # held back (held_back_ids)
        if a.spec.depends_on or (a.task_group_id and a.task_group_concurrency):
            return None
        pending.append(starting_size(a))
    return pending, [allocs[i] for i in m.holding]


def _shortlisted(
    m: StateMirror,
    vc: str,
    now: float,
    pending: list[Allocation],
    holding: list[Allocation],
    topology: TopologyModel | None,
    context: cost.ScoringContext | None,
    budget_period_days: float,
) -> CycleDecision:
    """A hand-over cycle: the full cycle's solve step on the shortlisted part of the queue
    (an ``hpc-backfill`` or ``service-binpack`` vCluster; the callers make full cycles
    for the others)."""
    if not pending:
        return CycleDecision(shortlisted=True)
    if topology is None:
        topology = TopologyModel.from_nodes(m.nodes)
    depth = backfill_depth(m, vc)
    if context is None:
        ctx = cost.build_context(m, now, vcluster=vc, budget_period_days=budget_period_days)
    else:
        ctx = msgspec.structs.replace(context, now=now)
    result = solve(
        pending,
        m.nodes,
        holding,
        score=scorer(m, vc, now, ctx),
        now=now,
        backfill_depth=depth,
        vcluster=vc,
        tenants=m.tenants,
        topology=topology,
    )
    proposals, _ = shrink_ranges(m, vc, pending, list(result.proposals), list(result.pending), now)
    reservations = list(result.reservations)
    return CycleDecision(
        proposals=prefer_intra_node(m, vc, proposals, reservations, topology),
        reservations=reservations,
        queue=pending,
        scores=dict(result.scores),
        backfill_depth=depth,
        shortlisted=True,
        context=ctx,
    )


def node_intra_fit(node: Node, a: Allocation) -> tuple[float, float]:
    """How good ``node`` is for ``a`` inside the node: first the intra-node part of f4
    (GPU Topology / Memory Topology: β · gpu_link_fitness + (1-β) ·
    memory_locality_fitness, which is relative to the node's own best link), then the
    absolute bandwidth of the selected GPUs' weakest link, so that between two nodes
    that are each as good as they can be the one with faster links wins. (-1, 0) when
    the node reports no topology."""
    fit = intranode.intra_node_fit([node], a)
    if fit is None:
        return (-1.0, 0.0)
    f4_intra = cost.intra_node_fitness(fit.gpu_link, fit.memory_locality, fit.beta)
    sel = intranode.select_gpus(node, intranode.requested_gpus(node, a))
    weakest = sel.min_link_bandwidth if sel is not None else None
    return (f4_intra if f4_intra is not None else -1.0, weakest or 0.0)


def prefer_intra_node(
    m: StateMirror,
    vc: str,
    proposals: list[Proposal],
    reservations: list[Reservation],
    topology: TopologyModel,
) -> list[Proposal]:
    """Node selection's intra-node step: the solver fixes how many nodes come from each
    dragonfly group and conformance group; among interchangeable free nodes (same
    group, conformance group and capabilities) take those whose GPUs are linked best
    and whose memory is most local for the allocation. Group span, f9 and every
    reservation stay as the solver decided (reserved nodes are never swapped in).
    "Same capabilities" is the topology model's capability signature."""
    if not proposals:
        return proposals
    reported = [
        n
        for p in proposals
        for nid in p.node_ids
        if (n := m.nodes.get(nid)) is not None
        and (n.capabilities.gpu_links or n.capabilities.memory_domains)
    ]
    if not reported:
        return proposals
    busy = {nid for p in proposals for nid in p.node_ids}
    busy.update(nid for r in reservations for nid in r.node_ids)
    sig = topology.node_signature

    def cell(n: Node) -> tuple[int, str, int]:
        return (n.group, n.conformance_group, sig.get(n.id, -1))

    spare: dict[tuple[int, str, int], list[Node]] = {}
    for nid, n in m.nodes.items():
        if nid not in busy and eligible(n, vc) and not n.disabled:
            spare.setdefault(cell(n), []).append(n)
    if not spare:
        return proposals
    out: list[Proposal] = []
    for p in proposals:
        a = m.allocations.get(p.allocation_id)
        if a is None:
            out.append(p)
            continue
        fits: dict[str, tuple[float, float]] = {}  # per node, for this allocation

        def fit_of(n: Node, a: Allocation = a, fits: dict = fits) -> tuple[float, float]:
            got = fits.get(n.id)
            if got is None:
                got = fits[n.id] = node_intra_fit(n, a)
            return got

        chosen: list[str] = []
        for nid in p.node_ids:
            cur = m.nodes[nid]
            pool = spare.get(cell(cur), [])
            best, best_fit = cur, fit_of(cur)
            for cand in pool:
                fit = fit_of(cand)
                if fit > best_fit:
                    best, best_fit = cand, fit
            if best is not cur:
                pool.remove(best)
                pool.append(cur)  # the node given up is interchangeable for later ones
            chosen.append(best.id)
        out.append(
            p if tuple(chosen) == p.node_ids else msgspec.structs.replace(p, node_ids=tuple(chosen))
        )
    return out


def _sensitive(
    m: StateMirror,
    vc: str,
    pending: list[Allocation],
    holding: list[Allocation],
    score: Callable[[Allocation], float],
    now: float,
) -> tuple[list[Proposal], list[Pending], dict[str, float]]:
    """sensitive-reservation: per claiming user, first that user's idle claimed
    nodes, then unclaimed ones; drifted nodes never; no backfill."""
    by_user: dict[str, list[Allocation]] = {}
    for a in pending:
        by_user.setdefault(claimant(a), []).append(a)
    taken: set[str] = set()
    proposals: list[Proposal] = []
    waiting: list[Pending] = []
    scores: dict[str, float] = {}
    for user in sorted(by_user, key=lambda u: (-max(score(a) for a in by_user[u]), u)):
        # the solver sees only unclaimed nodes: hand it unclaimed copies of the user's
        own = {
            nid: msgspec.structs.replace(n, claimed_by="")
            for nid, n in m.nodes.items()
            if n.claimed_by == user and nid not in taken and not drifted(n)
        }
        todo = by_user[user]
        last: list[Pending] = []
        for pool in (own, {**own, **_fresh(m.nodes, taken)}):
            if not todo or not pool:
                continue
            res = solve(
                todo,
                pool,
                holding,
                score=score,
                now=now,
                backfill_depth=0,
                vcluster=vc,
                tenants=m.tenants,
            )
            scores.update(res.scores)
            proposals.extend(res.proposals)
            taken.update(nid for p in res.proposals for nid in p.node_ids)
            placed = {p.allocation_id for p in res.proposals}
            todo = [a for a in todo if a.id not in placed]
            last = res.pending
        why = {w.allocation_id: w for w in last}
        waiting.extend(why.get(a.id) or Pending(a.id, OCCUPIED) for a in todo)
    return proposals, waiting, scores


def _fresh(nodes: Mapping[str, Node], taken: Collection[str]) -> dict[str, Node]:
    return {
        nid: n
        for nid, n in nodes.items()
        if not n.claimed_by and nid not in taken and not drifted(n)
    }


def shrink_ranges(
    m: StateMirror,
    vc: str,
    pending: list[Allocation],
    proposals: list[Proposal],
    waiting: list[Pending],
    now: float,
) -> tuple[list[Proposal], list[Pending]]:
    """Allocations with a node range {min, max} that could not get ``max`` nodes take as
    many free nodes as there are, down to ``min``."""
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
    """Elastic sharing: still-blocked preemptible work (a borrowed node can be reclaimed
    at any time, so never non-preemptible work) goes to idle nodes of other vClusters'
    home pools whose own vCluster has nothing pending; sensitive pools never lend.
    Returns the borrowed placements and what still waits."""
    blocked = {w.allocation_id for w in waiting if w.reason == OCCUPIED}
    candidates = [a for a in pending if a.id in blocked and not non_preemptible(a)]
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
        and not n.claimed_by
        and scheduler_type(m, n.home_vcluster) != SchedulerType.SENSITIVE_RESERVATION
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


def preempt_for(
    m: StateMirror,
    vc: str,
    waiting: list[Pending],
    proposals: list[Proposal],
    now: float,
    policy: PreemptionPolicy,
    home_pools: Collection[str] | None = None,
    ctx: cost.ScoringContext | None = None,
    *,
    budget_period_days: float = ledger.DEFAULT_BUDGET_PERIOD_DAYS,
) -> list[Preemption]:
    """Victims for the highest blocked allocations (at most
    ``PREEMPTION_CANDIDATES_PER_CYCLE`` of them), burst allocations first (tenants at
    or above their fair share in ``ctx``, the cycle's scoring context, built here when
    not given). Returns early, before scanning the nodes, when no running allocation
    could be a victim."""
    occupied = [w.allocation_id for w in waiting if w.reason == OCCUPIED]
    if not occupied:
        return []
    allocs = m.allocations
    running = [allocs[i] for i in m.holding if allocs[i].state == AllocationState.RUNNING]
    nodes = m.nodes
    reclaimable: frozenset[str] = frozenset()
    if home_pools is None or vc in home_pools:  # else no node has vc as its home
        # borrowers on this vCluster's home pool: reclaimable whatever their class
        reclaimable = frozenset(
            a.id
            for a in running
            if a.spec.vcluster != vc
            and any(n in nodes and nodes[n].home_vcluster == vc for n in a.assigned_nodes)
        )
        # reactive borrowers give the borrowed nodes back by scaling down, within the
        # borrowed-node grace (lattice_scheduler.autoscaler): not preempted for them
        homes = {nid: n.home_vcluster for nid, n in nodes.items()} if reclaimable else {}
        giving_back = {
            a.id
            for a in running
            if a.id in reclaimable
            and a.spec.lifecycle == LifecycleType.REACTIVE
            and autoscale.gives_back_by_scaling(
                a.assigned_nodes, homes, a.spec.vcluster, a.spec.min_nodes, vc
            )
        }
        if giving_back:
            running = [a for a in running if a.id not in giving_back]
            reclaimable = reclaimable - giving_back
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
    ctx = ctx or cost.build_context(m, now, vcluster=vc, budget_period_days=budget_period_days)
    over_share, below_share = cost.over_share_tenants(ctx), cost.below_share_tenants(ctx)
    chosen: set[str] = set()
    out: list[Preemption] = []
    for job in jobs[:PREEMPTION_CANDIDATES_PER_CYCLE]:
        if job.id in releasing_for or (job.spec.preemption_class == 0 and not reclaimable):
            continue  # its victims are already on their way out / nothing is below it
        victims = select_victims(
            job,
            [a for a in running if a.id not in chosen],
            nodes,
            now=now,
            free_nodes=free,
            policy=policy,
            reclaimable=reclaimable,
            over_share=over_share,
            below_share=below_share,
        )
        if not victims:
            continue
        chosen.update(victims)
        out.extend(Preemption(v, job.id, _reason(job, v, reclaimable)) for v in victims)
    return out


def explain_over_share(
    waiting: list[Pending], allocations: Mapping[str, Allocation], over_share: Collection[str]
) -> list[Pending]:
    """Say so when an allocation waits for busy nodes while its tenant holds at least its
    fair share target: other tenants' later work may start before it (the share
    penalty), which "all suitable nodes occupied" alone does not explain. The text has
    no figures, so it only changes (and is only re-published) when the situation does."""
    if not over_share:
        return waiting
    out = []
    for w in waiting:
        a = allocations.get(w.allocation_id)
        if w.reason == OCCUPIED and a is not None and a.spec.tenant in over_share:
            note = reasons.over_share(a.spec.tenant)
            w = Pending(w.allocation_id, OCCUPIED, f"{w.detail}; {note}" if w.detail else note)
        out.append(w)
    return out


def _reason(job: Allocation, victim: str, reclaimable: Collection[str]) -> str:
    if victim in reclaimable:
        return "reclaim"
    if job.spec.preemption_class >= NEVER_PREEMPTED_CLASS:
        return "sensitive"
    return "priority"
