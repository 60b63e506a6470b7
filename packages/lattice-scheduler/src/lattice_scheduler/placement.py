"""The foundation's placement core: order pending allocations and pick free nodes.

Plain functions over plain data (a StateMirror's dicts): no clock, no I/O. The live
cycle orders and places with the cost function and GreedyTopologyAwareBackfill
(``solver.solve``); it still uses ``plan_cycle`` for the pending reasons of a cycle in
which no node is free, ``eligible``, ``order_pending`` and ``limit_task_groups``.
RM-Replay's baselines pack with ``pick_nodes``. Node matching is the one hard filter,
``filters.node_satisfies``; the result types are the solver's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

from lattice_common.types import (
    HOLDING_STATES,
    Allocation,
    AllocationState,
    Node,
    NodeState,
    Tenant,
)

from lattice_scheduler import reasons
from lattice_scheduler.filters import node_satisfies
from lattice_scheduler.solver import (
    REASON_NO_MATCH,
    REASON_OCCUPIED,
    REASON_QUOTA,
    Pending,
    Proposal,
)


def order_pending(
    allocs: Iterable[Allocation], score: Callable[[Allocation], float] | None = None
) -> list[Allocation]:
    """By cost-function score when given (highest first), else higher preemption class
    first; ties by longest waiting (original submit time), then id."""
    if score is None:
        return sorted(allocs, key=lambda a: (-a.spec.preemption_class, a.submitted_at, a.id))
    return sorted(allocs, key=lambda a: (-score(a), a.submitted_at, a.id))


def order_fifo(allocs: Iterable[Allocation]) -> list[Allocation]:
    """interactive-fifo: strict arrival order."""
    return sorted(allocs, key=lambda a: (a.submitted_at, a.id))


def pick_nodes(candidates: list[Node], count: int) -> list[Node] | None:
    """``count`` nodes packed into as few topology groups as possible: the tightest
    single group that fits, else the largest groups first."""
    if len(candidates) < count:
        return None
    by_group: dict[int, list[Node]] = defaultdict(list)
    for n in candidates:
        by_group[n.group].append(n)
    fitting = [g for g, ns in by_group.items() if len(ns) >= count]
    if fitting:
        g = min(fitting, key=lambda g: (len(by_group[g]), g))
        return sorted(by_group[g], key=lambda n: n.id)[:count]
    chosen: list[Node] = []
    for g in sorted(by_group, key=lambda g: (-len(by_group[g]), g)):
        chosen.extend(sorted(by_group[g], key=lambda n: n.id)[: count - len(chosen)])
        if len(chosen) == count:
            break
    return chosen


def eligible(node: Node, vcluster: str) -> bool:
    """Free for ``vcluster``'s ordinary work: Ready, unowned, in its pool or the shared
    one, and not claimed for sensitive use (claimed nodes serve only their user)."""
    return (
        node.state == NodeState.READY
        and not node.owner
        and not node.claimed_by
        and node.home_vcluster in ("", vcluster)
    )


def plan_cycle(
    *,
    vcluster: str,
    allocations: Mapping[str, Allocation],
    nodes: Mapping[str, Node],
    tenants: Mapping[str, Tenant],
    exclude: Iterable[str] = (),
    pending_ids: Iterable[str] | None = None,
    holding_ids: Iterable[str] | None = None,
    score: Callable[[Allocation], float] | None = None,
    fifo: bool = False,
) -> tuple[list[Proposal], list[Pending]]:
    """Decide this cycle's assignments for one vCluster.

    ``pending_ids`` / ``holding_ids`` are optional indexes (a StateMirror keeps them) so
    a cycle need not scan every allocation ever submitted; without them it scans.
    """
    skip = set(exclude)
    candidates = (
        allocations.values() if pending_ids is None else (allocations[i] for i in pending_ids)
    )
    pending_unsorted = [
        a
        for a in candidates
        if a.state == AllocationState.PENDING and a.spec.vcluster == vcluster and a.id not in skip
    ]
    if not pending_unsorted:
        return [], []
    pending = order_fifo(pending_unsorted) if fifo else order_pending(pending_unsorted, score)
    usable_cache: dict[tuple[object, ...], tuple[int, int]] = {}

    def not_now(a: Allocation) -> Pending:
        """Occupied (will run later) or impossible here (too few usable nodes at all),
        counted as the solver does: down, failed and disabled nodes are not usable now
        but are said to exist (they may come back)."""
        c = a.spec.constraints
        key = (c.gpu_type, c.gpu_count, tuple(c.features), c.memory_gb)
        counts = usable_cache.get(key)
        if counts is None:
            usable = unusable = 0
            for n in nodes.values():
                if n.home_vcluster not in ("", vcluster) or not node_satisfies(n, a.spec):
                    continue
                if n.disabled or n.state in (NodeState.DOWN, NodeState.FAILED):
                    unusable += 1
                elif not n.claimed_by:
                    usable += 1
            counts = usable_cache[key] = (usable, unusable)
        usable, unusable = counts
        if usable >= a.spec.nodes:
            return Pending(a.id, REASON_OCCUPIED)
        detail = reasons.too_few_nodes(a.spec.nodes, vcluster, usable, unusable)
        kind = reasons.WAITING_FOR_CAPACITY if a.spec.wait_for_capacity else REASON_NO_MATCH
        return Pending(a.id, kind, detail)

    free = [n for n in nodes.values() if eligible(n, vcluster)]
    if not free:  # nothing can start this cycle
        return [], [not_now(a) for a in pending]
    used_nodes: dict[str, int] = defaultdict(int)
    used_allocs: dict[str, int] = defaultdict(int)
    holding = allocations.values() if holding_ids is None else (allocations[i] for i in holding_ids)
    group_running: dict[str, int] = defaultdict(int)
    for a in holding:
        if a.state in HOLDING_STATES:
            used_nodes[a.spec.tenant] += len(a.assigned_nodes)
            used_allocs[a.spec.tenant] += 1
            if a.task_group_id:
                group_running[a.task_group_id] += 1
    proposals: list[Proposal] = []
    waiting: list[Pending] = []
    taken: set[str] = set()
    for a in pending:
        if a.task_group_concurrency and group_running[a.task_group_id] >= a.task_group_concurrency:
            waiting.append(Pending(a.id, reasons.TASK_GROUP_LIMIT))
            continue
        t = tenants.get(a.spec.tenant)
        quota = reasons.quota(t, used_nodes[t.name], used_allocs[t.name], a.spec.nodes) if t else ""
        if quota:
            waiting.append(Pending(a.id, REASON_QUOTA, quota))
            continue
        matching = [n for n in free if n.id not in taken and node_satisfies(n, a.spec)]
        chosen = pick_nodes(matching, a.spec.nodes)
        if chosen is None:
            waiting.append(not_now(a))
            continue
        taken.update(n.id for n in chosen)
        if a.task_group_id:
            group_running[a.task_group_id] += 1
        used_nodes[a.spec.tenant] += len(chosen)
        used_allocs[a.spec.tenant] += 1
        proposals.append(Proposal(a.id, tuple(n.id for n in chosen)))
    return proposals, waiting


def mutex_keys(a: Allocation) -> tuple[str, ...]:
    """The singleton mutexes ``a`` holds while it runs: per user, as Slurm's singleton."""
    return tuple(
        f"{a.spec.user}/{d.ref}" for d in a.spec.depends_on if d.condition in ("mutex", "singleton")
    )


def limit_mutexes(
    pending: Iterable[Allocation], holding: Iterable[Allocation]
) -> tuple[list[Allocation], list[Pending]]:
    """At most one allocation per singleton mutex runs: one that waits while another
    holds its mutex, or behind an earlier submission of the same mutex this cycle."""
    order = sorted(pending, key=lambda a: (a.submitted_at, a.id))
    if not any(a.spec.depends_on for a in order):  # no mutex asked for (most queues)
        return order, []
    taken = {k for a in holding if a.state in HOLDING_STATES for k in mutex_keys(a)}
    free_to_start: list[Allocation] = []
    held: list[Pending] = []
    for a in order:
        keys = mutex_keys(a)
        if keys and any(k in taken for k in keys):
            name = next(k for k in keys if k in taken).split("/", 1)[1]
            held.append(Pending(a.id, reasons.MUTEX, f"another job named {name!r} runs"))
            continue
        taken.update(keys)
        free_to_start.append(a)
    return free_to_start, held


def limit_task_groups(
    pending: Iterable[Allocation], holding: Iterable[Allocation]
) -> tuple[list[Allocation], list[Pending]]:
    """Hold back tasks beyond their group's concurrency (running + may start <= limit);
    lower task indexes go first."""
    order = sorted(pending, key=lambda a: (a.task_group_id, a.task_index or 0, a.id))
    running: dict[str, int] = defaultdict(int)
    for a in holding:
        if a.task_group_id and a.state in HOLDING_STATES:
            running[a.task_group_id] += 1
    free_to_start: list[Allocation] = []
    held: list[Pending] = []
    for a in order:
        if a.task_group_id and a.task_group_concurrency:
            if running[a.task_group_id] >= a.task_group_concurrency:
                held.append(Pending(a.id, reasons.TASK_GROUP_LIMIT))
                continue
            running[a.task_group_id] += 1
        free_to_start.append(a)
    return free_to_start, held
