"""Preemption: which running allocations to stop so a higher-class one can start.

Pure functions over plain data (the specification's Preemption Decision Algorithm):

1. candidates: running allocations of a strictly lower preemption class, never class
   10 (sensitive / critical), never one already Checkpointing, and not near completion
   (less than ``near_completion_seconds`` left, or more than ``near_completion_fraction``
   of its walltime used: let it finish);
2. cost of each: checkpoint_time + recompute_if_no_checkpoint + remaining_walltime_value;
   A job of a tenant at or above its fair share does not take a victim from a tenant
   below its share (that capacity is owed to the victim's tenant: its score gave way
   for exactly that), except to reclaim a borrowed node; class 10 is not held back;
3. greedy: burst allocations (of tenants holding at least their fair share target:
   "the first candidates for preemption", Burst Allowance) before the others, cheapest
   first within each, at most ``max_victims``, until the nodes they free plus the nodes
   already free satisfy the pending allocation (count and hard constraints).

Until the checkpoint broker exists every allocation is treated as checkpoint=none: the
victim gets SIGTERM, grace, SIGKILL and is requeued keeping its submit time.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import msgspec
from lattice_common.types import NEVER_PREEMPTED_CLASS, Allocation, AllocationState, Node

from lattice_scheduler.filters import node_satisfies

NON_PREEMPTIBLE_FROM_CLASS = 7
"""checkpoint: None AND class >= 7 is effectively non-preemptible; until the checkpoint
broker exists every allocation is checkpoint: None."""


def non_preemptible(a: Allocation) -> bool:
    """Effectively non-preemptible (Preemption Policy): sensitive / class 10, or high
    class without a checkpoint. Kept off borrowed nodes, which may be reclaimed."""
    return a.spec.preemption_class >= NON_PREEMPTIBLE_FROM_CLASS


class PreemptionPolicy(msgspec.Struct, frozen=True, kw_only=True):
    near_completion_seconds: float = 300.0
    near_completion_fraction: float = 0.9
    max_victims: int = 3
    default_checkpoint_minutes: float = 0.0  # checkpoint=none: nothing to write
    # A job that was just resumed after a preemption has the least work to lose and would
    # be picked again and again; protect it for a while so that it makes progress.
    resume_protection_seconds: float = 600.0


def is_candidate(
    victim: Allocation,
    job: Allocation,
    now: float,
    policy: PreemptionPolicy,
    *,
    reclaim: bool = False,
) -> bool:
    """Strictly lower class (any class when the home vCluster reclaims a borrowed
    node), never sensitive, running (not Checkpointing), not near its end."""
    vc, jc = victim.spec.preemption_class, job.spec.preemption_class
    if victim.state != AllocationState.RUNNING or vc >= NEVER_PREEMPTED_CLASS:
        return False
    if vc >= jc and not reclaim:
        return False
    if (
        victim.preempted_count
        and victim.started_at is not None
        and now - victim.started_at < policy.resume_protection_seconds
    ):
        return False
    wall = victim.spec.walltime_seconds
    if wall and victim.started_at is not None:
        used = max(0.0, now - victim.started_at)
        if (
            wall - used < policy.near_completion_seconds
            or used > policy.near_completion_fraction * wall
        ):
            return False
    return True


def preemption_cost(
    victim: Allocation, now: float, gpus_per_node: int, policy: PreemptionPolicy
) -> float:
    """preemption_cost(c) = checkpoint_time(c) + recompute_if_no_checkpoint(c)
    + remaining_walltime_value(c), in GPU-hours.

    With no checkpoint, recompute is the GPU-hours since start (time_since_last_checkpoint
    x node_count x gpu_per_node); remaining_walltime_value grows with the share of the
    walltime already used (little invested early: cheap; near the end: expensive).
    """
    nodes = max(1, len(victim.assigned_nodes) or victim.spec.nodes)
    gpus = max(1, gpus_per_node)
    ran_h = max(0.0, now - (victim.started_at or now)) / 3600.0
    checkpoint_h = policy.default_checkpoint_minutes / 60.0 * nodes * gpus
    recompute = ran_h * nodes * gpus
    wall = victim.spec.walltime_seconds
    used_share = min(1.0, ran_h * 3600.0 / wall) if wall else 0.5
    remaining_value = used_share * nodes * gpus
    return checkpoint_h + recompute + remaining_value


def select_victims(
    job: Allocation,
    running: Iterable[Allocation],
    nodes: Mapping[str, Node],
    *,
    now: float,
    free_nodes: Iterable[Node] = (),
    policy: PreemptionPolicy | None = None,
    reclaimable: frozenset[str] = frozenset(),
    over_share: Collection[str] = frozenset(),
    below_share: Collection[str] = frozenset(),
) -> list[str] | None:
    """Victim allocation ids whose nodes (with the free ones) let ``job`` start: those of
    ``over_share`` tenants first, cheapest first, none of a ``below_share`` tenant when
    ``job``'s tenant is over its share; None when no valid set of at most
    ``max_victims`` exists."""
    policy = policy or PreemptionPolicy()
    spec = job.spec
    have = sum(1 for n in free_nodes if node_satisfies(n, spec))
    need = job.spec.nodes - have
    if need <= 0:
        return []
    owed: Collection[str] = ()
    if job.spec.tenant in over_share and job.spec.preemption_class < NEVER_PREEMPTED_CLASS:
        owed = below_share
    scored: list[tuple[bool, float, int, str, int]] = []
    for v in running:
        if not is_candidate(v, job, now, policy, reclaim=v.id in reclaimable):
            continue
        if v.spec.tenant in owed and v.id not in reclaimable:
            continue
        usable = [
            nodes[n] for n in v.assigned_nodes if n in nodes and node_satisfies(nodes[n], spec)
        ]
        if not usable:
            continue  # freeing it would not help this job
        gpn = max((n.capabilities.gpu_count for n in usable), default=1)
        scored.append(
            (
                v.spec.tenant not in over_share,
                preemption_cost(v, now, gpn, policy),
                v.spec.preemption_class,
                v.id,
                len(usable),
            )
        )
    # burst allocations first, then cheapest; at equal cost the lower class goes first
    scored.sort()
    victims: list[str] = []
    for _burst, _cost, _cls, vid, freed in scored:
        if len(victims) >= policy.max_victims:
            break
        victims.append(vid)
        need -= freed
        if need <= 0:
            return victims
    return None
