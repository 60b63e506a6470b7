"""The composite cost function: Score(j) = sum w_i * f_i(j), then the soft-quota penalty.

Specification, Scheduling Algorithm chapter: "Score(j) = Σ wᵢ · fᵢ(j)". Each factor
f1..f9 is one small pure function here, with its formula quoted in the docstring, in
the spirit of a Kubernetes score plugin: plain numbers in, a normalised number out.
Every factor is in [0, 1] except f2, which is the spec's unbounded logarithm (see
``f2_wait_time``). Weights are a ``CostWeights`` (w1..w9) from the vCluster config;
the named profiles live in :mod:`lattice_scheduler.profiles`.

Nothing here reads the clock or does I/O: ``now`` and every measurement travel in a
:class:`ScoringContext`, built once per scheduling cycle by :func:`build_context`. The
per-allocation functions (``score``, ``f1``..``f9``) do a handful of arithmetic
operations and dict lookups each, so a cycle can score thousands of allocations.

Soft quotas (Quota Enforcement chapter) are applied on top of the sum as multipliers,
:func:`budget_penalty` and :func:`share_penalty` (combined by :func:`soft_quota_multiplier`):
never a hard reject, only a lower score.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Protocol

import msgspec
from lattice_common import ledger
from lattice_common.types import (
    HOLDING_STATES,
    Allocation,
    AllocationState,
    CostWeights,
    Node,
    NodeState,
    Tenant,
)

from lattice_scheduler.profiles import WEIGHT_NAMES, WEIGHT_PROFILES, profile_for_scheduler_type

__all__ = [
    "ALPHA_MULTI_NODE",
    "BETA_CPU_HEAVY",
    "BETA_DEFAULT",
    "BETA_GPU_HEAVY",
    "BUDGET_AT_LIMIT_MULTIPLIER",
    "BUDGET_EXHAUSTED_MULTIPLIER",
    "BUDGET_PENALTY_START",
    "DEFAULT_CHECKPOINT_MINUTES",
    "DEFAULT_REFERENCE_WAIT_SECONDS",
    "FACTOR_NAMES",
    "NEUTRAL",
    "OVER_BURST_MULTIPLIER",
    "OVER_SHARE_MULTIPLIER",
    "WEIGHT_PROFILES",
    "IntraNodeFit",
    "ScoringContext",
    "below_share_tenants",
    "beta_for",
    "breakdown",
    "budget_penalty",
    "build_context",
    "checkpoint_factor",
    "energy_price_at",
    "f1_priority_class",
    "f2_wait_time",
    "f3_fair_share_deficit",
    "f4_topology_fitness",
    "f5_data_readiness",
    "f6_backlog_pressure",
    "f7_energy_cost",
    "f8_checkpoint_efficiency",
    "f9_conformance_fitness",
    "fair_share_deficit",
    "gpu_hours",
    "gpu_link_fitness",
    "intra_node_fitness",
    "memory_locality_fitness",
    "over_share_tenants",
    "profile_for_scheduler_type",
    "raw_score",
    "same_domain_fraction",
    "score",
    "share_penalty",
    "soft_quota_multiplier",
    "wait_time_factor",
]

_INF = math.inf

NEUTRAL = 0.5
"""Value of a factor that cannot be known yet (spec, f5: "defaults to 0.5 (neutral)").
``score`` uses it for f4 and f9 when the solver has not chosen nodes yet: a constant
for every allocation, so it does not change the order, only the absolute level."""

DEFAULT_REFERENCE_WAIT_SECONDS = 3600.0
"""f2: "reference_wait is tunable (default: 1 hour)"."""

DEFAULT_CHECKPOINT_MINUTES = 10.0
"""f8 for an allocation with no estimate: the spec's checkpoint_timeout default
("Timeout: checkpoint_timeout (default: 10 minutes)"), i.e. the longest a checkpoint
is waited for before the broker gives up. Gives f8 = 1/11 ~ 0.09: unknown is treated
as slow, not as fast. A ``math.inf`` estimate (checkpoint: none) gives f8 = 0."""

ALPHA_MULTI_NODE = 0.7
"""GPU Topology: "α = 0.7 for multi-node jobs (inter-node dominates but intra-node still relevant)"."""

BETA_GPU_HEAVY = 0.7
"""Memory Topology: "β = 0.7 for GPU-heavy workloads (GPU interconnect dominates)"."""
BETA_CPU_HEAVY = 0.3
"""Memory Topology: "β = 0.3 for CPU-heavy workloads with GPU offload (memory locality dominates)"."""
BETA_DEFAULT = 0.5
"""Memory Topology: "β = 0.5 default"."""

BUDGET_PENALTY_START = 0.8
"""Quota Enforcement: "0-80% used: no penalty"."""
BUDGET_AT_LIMIT_MULTIPLIER = 0.5
"""Multiplier reached just below 100% used, at the end of the linear 80-100% ramp."""
OVER_SHARE_MULTIPLIER = 0.5
"""Quota Enforcement, Fair Share Target: "Tenants below their share get priority; tenants
above are deprioritized. Not a hard ceiling -- a tenant can use more than their share
when resources are idle." f3 alone cannot do that: it only withholds a bonus of at most
w3, while f2 grows without bound, so under sustained overload the heaviest submitter's
older work keeps winning and tenants end up with their share of the *demand* (RM-Replay's
unfair trace: 51% of the node-hours against a 25% target). Halving the score of a tenant
at or above its share puts its work behind the others' unless it has waited much
longer (hpc-batch profile, against fresh work of the same class: about 3 h when the
other tenant is just below its share, 30 h when it has used nothing), so it mostly
runs on what the others cannot use -- idle capacity, backfill holes -- yet is
deprioritized, not starved. The same factor as a budget at its limit;
an exhausted budget (0.01) is harsher. RM-Replay's unfair trace: 3% deviation."""
BUDGET_EXHAUSTED_MULTIPLIER = 0.01
"""Multiplier at and above 100% used: "very low score (effective starvation for new
allocations, but not hard rejection)". Never zero."""
OVER_BURST_MULTIPLIER = BUDGET_EXHAUSTED_MULTIPLIER
"""Burst Allowance: "allow up to 150% of fair share when resources idle". Beyond its
burst allowance a tenant scores like one with an exhausted budget: effective starvation
while anyone else waits, never a hard block (soft quotas "influence scheduling score
but don't hard-block")."""

FACTOR_NAMES: tuple[str, ...] = WEIGHT_NAMES
"""f1..f9 in order: the CostWeights field names w1..w9."""


def _clamp01(x: float) -> float:
    """x clamped to [0, 1]; NaN -> 0."""
    if x >= 1.0:
        return 1.0
    if x > 0.0:
        return x
    return 0.0


class ScoringContext(msgspec.Struct, kw_only=True):
    """Everything the factors need besides the allocation, fixed for one cycle.

    * ``now``: the cycle's wall-clock time (seconds since the epoch, UTC).
    * ``tenant_usage_share`` / ``tenant_target_share``: actual and contracted share of
      the system per tenant, 0..1 (f3). A tenant missing from the usage map has used
      nothing; one missing from the target map has no share (f3 = 0).
    * ``tenant_burst_allowance``: per tenant, how far above its target share it may
      burst before its score drops to the exhausted level (:func:`share_penalty`), as a
      multiple of the target (1.5 = 150%); absent or 0: not set.
    * ``queued_gpu_hours`` / ``running_gpu_hours``: f6's backlog inputs.
    * ``energy_prices``: time-of-use schedule ``(start_hour, end_hour, price)`` with hours
      in [0, 24) of the UTC day; a window with start > end wraps midnight, start == end
      covers the whole day; the first matching window wins. ``energy_price_min`` /
      ``energy_price_max`` normalise the price; left ``None`` they are taken from the
      schedule.
    * ``budget_fraction_used``: per tenant, the worse (higher) of its GPU-hours and
      node-hours budget fractions; a tenant absent here has no budget (no penalty).
    * ``data_readiness``: per allocation id, fraction of input data on the hot tier
      (absent: unknown -> 0.5).
    * ``checkpoint_minutes``: per allocation id, estimated checkpoint minutes (absent:
      ``default_checkpoint_minutes``; ``math.inf`` for checkpoint: none).
    * ``max_groups_available``: dragonfly groups with free nodes for this vCluster (f4).
    """

    now: float
    reference_wait_seconds: float = DEFAULT_REFERENCE_WAIT_SECONDS
    tenant_usage_share: dict[str, float] = msgspec.field(default_factory=dict)
    tenant_target_share: dict[str, float] = msgspec.field(default_factory=dict)
    tenant_burst_allowance: dict[str, float] = msgspec.field(default_factory=dict)
    queued_gpu_hours: float = 0.0
    running_gpu_hours: float = 0.0
    energy_prices: list[tuple[float, float, float]] = msgspec.field(default_factory=list)
    energy_price_min: float | None = None
    energy_price_max: float | None = None
    budget_fraction_used: dict[str, float] = msgspec.field(default_factory=dict)
    data_readiness: dict[str, float] = msgspec.field(default_factory=dict)
    checkpoint_minutes: dict[str, float] = msgspec.field(default_factory=dict)
    default_checkpoint_minutes: float = DEFAULT_CHECKPOINT_MINUTES
    max_groups_available: int = 0

    def __post_init__(self) -> None:
        if self.energy_prices:
            prices = [float(p) for _, _, p in self.energy_prices]
            if self.energy_price_min is None:
                self.energy_price_min = min(prices)
            if self.energy_price_max is None:
                self.energy_price_max = max(prices)


# --------------------------------------------------------------------------- f1


def f1_priority_class(a: Allocation) -> float:
    """f₁: priority_class(j) — "Static priority tier (0-10). Sensitive claims are highest."

    Normalised to [0, 1]: ``preemption_class / 10`` (class 10, sensitive -> 1.0; class
    0, best-effort -> 0.0), clamped for out-of-range classes (the API rejects them)."""
    return _clamp01(a.spec.preemption_class / 10.0)


# --------------------------------------------------------------------------- f2


def wait_time_factor(wait_seconds: float, reference_wait_seconds: float) -> float:
    """f₂ on plain numbers: ``log(1 + wait_seconds / reference_wait)``.

    Negative or NaN waits (clock skew) count as 0; a non-positive reference falls back
    to the 1-hour default. Not normalised, see :func:`f2_wait_time`."""
    if not wait_seconds > 0.0:
        return 0.0
    if not reference_wait_seconds > 0.0:
        reference_wait_seconds = DEFAULT_REFERENCE_WAIT_SECONDS
    return math.log1p(wait_seconds / reference_wait_seconds)


def f2_wait_time(a: Allocation, ctx: ScoringContext) -> float:
    """f₂: wait_time_factor(j) — "Anti-starvation. Increases monotonically with time in queue."

        f₂(j) = log(1 + wait_seconds / reference_wait)

    "reference_wait is tunable (default: 1 hour). Log prevents wait time from
    dominating all other factors." wait_seconds = now - submitted_at (the original
    submit time, kept across requeues and preemptions).

    Deliberately NOT normalised to [0, 1]: it is 0 at no wait, ln 2 ~ 0.69 after one
    reference_wait, 1.0 after (e-1) ~ 1.72 reference waits, ~3.2 after a day and ~5.1
    after a week (reference 1 h). Strictly increasing and unbounded, so a long enough
    wait eventually outweighs any fixed difference in the other (bounded) factors: the
    anti-starvation guarantee. The log keeps that slow. Any bounding map (a cap, or
    x/(1+x)) would either stop increasing or let a low-class job starve for ever."""
    return wait_time_factor(ctx.now - a.submitted_at, ctx.reference_wait_seconds)


# --------------------------------------------------------------------------- f3


def fair_share_deficit(target_share: float, actual_usage: float) -> float:
    """f₃ on plain numbers: ``max(0, target - actual) / target``, always in [0, 1].

    target <= 0, NaN or infinite -> 0 (no contracted share, nothing owed). Negative or
    NaN usage counts as 0 (used nothing -> 1.0)."""
    if not 0.0 < target_share < _INF:
        return 0.0
    if not actual_usage > 0.0:
        return 1.0
    return _clamp01((target_share - actual_usage) / target_share)


def f3_fair_share_deficit(a: Allocation, ctx: ScoringContext) -> float:
    """f₃: fair_share_deficit(j) — "How far the tenant is from their contracted share."

        f₃(j) = max(0, target_share(tenant) - actual_usage(tenant)) / target_share(tenant)

    "Ranges from 0 (tenant at or above share) to 1 (tenant has used nothing). Tenants
    below their share get priority." A tenant with no target share scores 0."""
    tenant = a.spec.tenant
    return fair_share_deficit(
        ctx.tenant_target_share.get(tenant, 0.0), ctx.tenant_usage_share.get(tenant, 0.0)
    )


# --------------------------------------------------------------------------- f4


class IntraNodeFit(msgspec.Struct, kw_only=True, frozen=True):
    """Intra-node quality of a candidate placement, from the node agents' GpuTopology
    and MemoryTopology reports (eventually consistent data, never Raft-committed).

    * ``single_node``: the allocation runs on one node (selects α).
    * ``gpu_link``: :func:`gpu_link_fitness` of the selected GPUs (averaged over the
      selected nodes by the caller); ``None`` when unknown or the job has no GPUs.
    * ``memory_locality``: :func:`memory_locality_fitness` of the placement; ``None``
      when the node reports no memory topology.
    * ``beta``: :data:`BETA_GPU_HEAVY`, :data:`BETA_CPU_HEAVY` or :data:`BETA_DEFAULT`
      (see :func:`beta_for`).
    """

    single_node: bool
    gpu_link: float | None = None
    memory_locality: float | None = None
    beta: float = BETA_DEFAULT


def beta_for(workload: str | None) -> float:
    """β by workload kind: ``"gpu-heavy"`` 0.7, ``"cpu-heavy"`` 0.3, anything else 0.5.
    The spec names the three values but no allocation field that tells the kinds
    apart; the caller classifies."""
    if workload == "gpu-heavy":
        return BETA_GPU_HEAVY
    if workload == "cpu-heavy":
        return BETA_CPU_HEAVY
    return BETA_DEFAULT


def gpu_link_fitness(min_link_bandwidth: float, max_link_bandwidth: float) -> float:
    """GPU Topology: ``intra_node_fitness = min_link_bandwidth(selected_gpus) / max_link_bandwidth(node)``
    (called gpu_link_fitness once memory topology joins it).

    E.g. 4 GPUs on NVSwitch (900 GB/s) of a node whose best link is 900 -> 1.0; a set
    that has to cross PCIe Gen5 (64 GB/s) -> 64/900 ~ 0.07. A node with no GPU links
    (max <= 0: one GPU, or none) has nothing to lose -> 1.0. Clamped to [0, 1]."""
    if not max_link_bandwidth > 0.0:
        return 1.0
    return _clamp01(min_link_bandwidth / max_link_bandwidth)


def same_domain_fraction(domain_counts: Iterable[int]) -> float:
    """On one node: "fraction of allocation's CPUs and GPUs in the same memory domain".

    ``domain_counts[i]`` = how many of the allocation's CPUs plus GPUs on that node sit
    in memory domain i; the fraction is the largest count over the total (all in one
    domain -> 1.0, split evenly over two -> 0.5). Nothing placed -> 1.0."""
    total = 0
    best = 0
    for c in domain_counts:
        if c > 0:
            total += c
            if c > best:
                best = c
    return 1.0 if total == 0 else best / total


def memory_locality_fitness(per_node_fractions: Iterable[float]) -> float:
    """Memory Topology::

        memory_locality_fitness(j, selected_nodes) =
            average over selected nodes of:
                fraction of allocation's CPUs and GPUs in the same memory domain

    (per-node fractions from :func:`same_domain_fraction`). No nodes -> 1.0."""
    n = 0
    total = 0.0
    for f in per_node_fractions:
        total += _clamp01(f)
        n += 1
    return 1.0 if n == 0 else total / n


def intra_node_fitness(
    gpu_link: float | None, memory_locality: float | None, beta: float = BETA_DEFAULT
) -> float | None:
    """Memory Topology: ``intra_node_fitness = β · gpu_link_fitness + (1-β) · memory_locality_fitness``.

    With only one of the two known (a CPU-only job has no GPU links; a node may not
    report memory topology) that one is used alone; with neither, ``None``."""
    if gpu_link is None:
        return None if memory_locality is None else _clamp01(memory_locality)
    if memory_locality is None:
        return _clamp01(gpu_link)
    b = _clamp01(beta)
    return b * _clamp01(gpu_link) + (1.0 - b) * _clamp01(memory_locality)


def f4_topology_fitness(
    groups_needed: int, max_groups_available: int, *, intra_node: IntraNodeFit | None = None
) -> float:
    """f₄: topology_fitness(j) — "How well the job fits available topology."

        f₄(j) = 1.0 - (groups_needed(j) / max_groups_available)

    "Jobs that fit in a single group score highest. Penalty for spanning groups scales
    with group count." Clamped to [0, 1]; no groups available -> 0.

    With ``intra_node`` (GPU Topology and Memory Topology chapters)::

        f₄(j) = α · inter_node_fitness(j) + (1-α) · intra_node_fitness(j)
        inter_node_fitness = 1.0 - (groups_needed / max_groups_available)
        intra_node_fitness = β · gpu_link_fitness + (1-β) · memory_locality_fitness
        α = 0.7 for multi-node jobs

    For single-node jobs the spec writes "α = 1.0 for single-node jobs (intra-node only
    matters)". Taken literally in the formula above, α = 1.0 would drop the intra-node
    term exactly where the spec says it is all that matters; this implements the
    stated intent: a single-node job's f₄ is its intra_node_fitness. Without
    intra-node data f₄ is the inter-node formula alone."""
    if max_groups_available > 0:
        inter = _clamp01(1.0 - groups_needed / max_groups_available)
    else:
        inter = 0.0
    if intra_node is None:
        return inter
    intra = intra_node_fitness(intra_node.gpu_link, intra_node.memory_locality, intra_node.beta)
    if intra is None:
        return inter
    if intra_node.single_node:
        return intra
    return ALPHA_MULTI_NODE * inter + (1.0 - ALPHA_MULTI_NODE) * intra


# --------------------------------------------------------------------------- f5


def f5_data_readiness(a: Allocation, ctx: ScoringContext) -> float:
    """f₅: data_readiness(j) — "Is the job's input data on hot tier?"

        f₅(j) = fraction_of_input_data_on_hot_tier(j)

    "If unknown (user didn't specify data requirements), defaults to 0.5 (neutral)."
    Clamped to [0, 1]; NaN counts as unknown."""
    v = ctx.data_readiness.get(a.id)
    if v is None or v != v:
        return NEUTRAL
    return _clamp01(v)


# --------------------------------------------------------------------------- f6


def f6_backlog_pressure(ctx: ScoringContext) -> float:
    """f₆: backlog_pressure(t) — "Global signal, not per-job. High when queue is deep."

        f₆(t) = min(1.0, queued_gpu_hours / running_gpu_hours)

    "Capped at 1.0. Affects all jobs equally — it's a system-level urgency signal."
    Nothing running: 1.0 if anything is queued, else 0.0."""
    queued = ctx.queued_gpu_hours
    if not queued > 0.0:
        return 0.0
    running = ctx.running_gpu_hours
    if not running > 0.0:
        return 1.0
    return _clamp01(queued / running)


# --------------------------------------------------------------------------- f7


def energy_price_at(prices: Iterable[tuple[float, float, float]], now: float) -> float | None:
    """Price of the time-of-use window containing ``now`` (hour of the UTC day), or
    ``None`` when no window covers it. ``start > end`` wraps midnight (22 -> 6);
    ``start == end`` is the whole day; the first matching window wins."""
    hour = (now % 86400.0) / 3600.0
    for start, end, price in prices:
        if start < end:
            if start <= hour < end:
                return price
        elif start > end:
            if hour >= start or hour < end:
                return price
        else:
            return price
    return None


def f7_energy_cost(ctx: ScoringContext) -> float:
    """f₇: energy_cost(j, t) — "Time-varying electricity price at scheduling time."

        f₇(j, t) = 1.0 - normalized_energy_price(t)

    "Jobs score higher when energy is cheap." normalized = (price(now) - min) / (max -
    min), with min/max from the context (default: the schedule's cheapest and dearest
    windows), clamped to [0, 1]. No schedule, an hour no window covers, a flat price
    (max <= min) or non-finite prices -> 0.5 (neutral: no time is cheaper than another)."""
    if not ctx.energy_prices:
        return NEUTRAL
    price = energy_price_at(ctx.energy_prices, ctx.now)
    lo = ctx.energy_price_min
    hi = ctx.energy_price_max
    if price is None or lo is None or hi is None:
        return NEUTRAL
    span = hi - lo
    if not 0.0 < span < _INF:
        return NEUTRAL
    x = (price - lo) / span
    if x != x:
        return NEUTRAL
    return 1.0 - _clamp01(x)


# --------------------------------------------------------------------------- f8


def checkpoint_factor(minutes: float) -> float:
    """f₈ on plain numbers: ``1 / (1 + minutes)``; negative -> 1.0 (as 0 minutes),
    infinite (cannot checkpoint) or NaN -> 0.0."""
    if minutes > 0.0:
        return 1.0 / (1.0 + minutes)
    return 0.0 if minutes != minutes else 1.0


def f8_checkpoint_efficiency(a: Allocation, ctx: ScoringContext) -> float:
    """f₈: checkpoint_efficiency(j) — "How cheaply can this job be preempted?"

        f₈(j) = 1.0 / (1.0 + estimated_checkpoint_minutes(j))

    "Jobs with fast checkpointing are more attractive to schedule on
    borrowed/preemptible nodes." 0 minutes -> 1.0, 1 -> 0.5, 9 -> 0.1. The estimate:
    ``ctx.checkpoint_minutes``, else the allocation's ``checkpoint_minutes`` (published
    by the checkpoint broker from measured checkpoints and storage bandwidth), else
    ``ctx.default_checkpoint_minutes`` (10, the checkpoint timeout) -> 1/11."""
    m = ctx.checkpoint_minutes.get(a.id)
    if m is None:  # the checkpoint broker's estimate, published on the allocation
        m = a.checkpoint_minutes
    if m is None or m != m:
        m = ctx.default_checkpoint_minutes
    return checkpoint_factor(m)


# --------------------------------------------------------------------------- f9


def f9_conformance_fitness(largest_group_size: int, requested_nodes: int) -> float:
    """f₉: conformance_fitness(j, candidates) — "How well do the candidate nodes match
    each other's configuration?"

        f₉(j, candidates) = largest_conformance_group_size(candidates) / j.requested_nodes

    "Scores 1.0 when all candidate nodes share the same conformance fingerprint, lower
    when the node set is heterogeneous." Capped at 1.0 (a group larger than the request
    is still a perfect fit); a request of <= 0 nodes -> 1.0. "This factor is evaluated
    during node selection (step 2a in the solver), not during scoring"."""
    if requested_nodes <= 0:
        return 1.0
    return _clamp01(largest_group_size / requested_nodes)


# --------------------------------------------------------------------------- budget


def budget_penalty(fraction: float | None) -> float:
    """Soft-quota multiplier on the score from the fraction of budget used (Quota
    Enforcement, GPU-Hours Budget): "The scheduler uses remaining budget as a penalty
    in the cost function. As budget depletes:

    - 0-80% used: no penalty
    - 80-100% used: increasing penalty (lower scheduling priority)
    - 100% used: very low score (effective starvation for new allocations, but not
      hard rejection)"

    The curve::

        fraction < 0.8          -> 1.0
        0.8 <= fraction < 1.0   -> 1.0 - 0.5 · (fraction - 0.8) / 0.2   (linear 1.0 -> 0.5)
        fraction >= 1.0         -> 0.01                                  (exhausted)

    Non-increasing, never 0 (never a hard reject). The drop from ~0.5 to 0.01 at 100%
    separates "lower scheduling priority" from "effective starvation". No budget
    (``None``), negative or NaN -> 1.0."""
    if fraction is None or not fraction >= BUDGET_PENALTY_START:
        return 1.0
    if fraction >= 1.0:
        return BUDGET_EXHAUSTED_MULTIPLIER
    ramp = (fraction - BUDGET_PENALTY_START) / (1.0 - BUDGET_PENALTY_START)
    return 1.0 - (1.0 - BUDGET_AT_LIMIT_MULTIPLIER) * ramp


def share_penalty(target_share: float, actual_usage: float, burst_allowance: float = 0.0) -> float:
    """Soft-quota multiplier for the fair share target and burst allowance::

        actual_usage < target_share                       -> 1.0
        target_share <= actual_usage                      -> OVER_SHARE_MULTIPLIER (0.5)
        actual_usage >= burst_allowance x target_share
          (burst allowance set, > 0)                      -> OVER_BURST_MULTIPLIER (0.01)

    At its target f3 is already 0; above it the tenant is "deprioritized", beyond its
    burst allowance effectively starved until its usage falls back. No target (<= 0,
    NaN, infinite) -> 1.0: no contract, nothing to be above of. A burst allowance
    below 1 leaves no headroom: the exhausted level starts at the target."""
    if not 0.0 < target_share < _INF or not actual_usage >= target_share:
        return 1.0
    if burst_allowance > 0.0 and actual_usage >= burst_allowance * target_share:
        return OVER_BURST_MULTIPLIER
    return OVER_SHARE_MULTIPLIER


def soft_quota_multiplier(
    budget_fraction: float | None,
    target_share: float,
    actual_usage: float,
    burst_allowance: float = 0.0,
) -> float:
    """Both soft quotas on one tenant: ``budget_penalty * share_penalty``."""
    return budget_penalty(budget_fraction) * share_penalty(
        target_share, actual_usage, burst_allowance
    )


def below_share_tenants(ctx: ScoringContext) -> frozenset[str]:
    """Tenants with a target share they do not hold yet (f3 > 0): capacity is owed to
    them, so work of a tenant at or above its share does not preempt theirs."""
    usage = ctx.tenant_usage_share
    return frozenset(
        t
        for t, target in ctx.tenant_target_share.items()
        if 0.0 < target < _INF and not usage.get(t, 0.0) >= target
    )


def over_share_tenants(ctx: ScoringContext) -> frozenset[str]:
    """Tenants holding at least their target share: their running allocations are the
    "burst allocations", "the first candidates for preemption" (Burst Allowance)."""
    targets = ctx.tenant_target_share
    return frozenset(
        t
        for t, usage in ctx.tenant_usage_share.items()
        if share_penalty(targets.get(t, 0.0), usage) < 1.0
    )


def _penalise(raw: float, multiplier: float) -> float:
    # Scores are >= 0 with non-negative weights; for a negative raw score (negative
    # weights) dividing keeps "a penalty never raises the score".
    return raw * multiplier if raw >= 0.0 else raw / multiplier


# --------------------------------------------------------------------------- score


def raw_score(
    a: Allocation,
    ctx: ScoringContext,
    weights: CostWeights,
    *,
    f4: float | None = None,
    f9: float | None = None,
) -> float:
    """Score(j) = Σ wᵢ · fᵢ(j) before the soft-quota penalties. ``f4`` / ``f9`` are the
    solver's topology and conformance fitness for a chosen node set; ``None`` (not yet
    known, e.g. when ordering the queue) uses :data:`NEUTRAL`."""
    w = weights
    return (
        w.priority * f1_priority_class(a)
        + w.wait_time * f2_wait_time(a, ctx)
        + w.fair_share * f3_fair_share_deficit(a, ctx)
        + w.topology * (NEUTRAL if f4 is None else f4)
        + w.data_readiness * f5_data_readiness(a, ctx)
        + w.backlog * f6_backlog_pressure(ctx)
        + w.energy * f7_energy_cost(ctx)
        + w.checkpoint_efficiency * f8_checkpoint_efficiency(a, ctx)
        + w.conformance * (NEUTRAL if f9 is None else f9)
    )


def score(
    a: Allocation,
    ctx: ScoringContext,
    weights: CostWeights,
    *,
    f4: float | None = None,
    f9: float | None = None,
) -> float:
    """The allocation's scheduling score: ``Σ wᵢ · fᵢ(j)`` times the tenant's
    :func:`soft_quota_multiplier` (budget used, usage against its fair share target).
    Higher is scheduled first."""
    # raw_score with f1..f9 written out, and what depends only on the context, the
    # weights or the tenant worked out once per (context, weights) pair (_ScoreMemo):
    # ``score`` runs for every pending allocation in every cycle, millions of times in
    # an RM-Replay run, and the composed version's dozen calls were most of its cost.
    # Same operations in the same order, so the same float bit for bit
    # (test_cost_inline.py checks it against raw_score, edge cases included).
    memo = _score_memo
    if memo is None or memo.ctx is not ctx or memo.weights is not weights:
        memo = _memo_for(ctx, weights)
    spec = a.spec
    tenant = spec.tenant
    per_tenant = memo.tenants.get(tenant)
    if per_tenant is None:
        per_tenant = memo.add_tenant(tenant)
    c3, multiplier = per_tenant
    x = spec.preemption_class / 10.0  # f1
    f1 = 1.0 if x >= 1.0 else x if x > 0.0 else 0.0
    wait = memo.now - a.submitted_at  # f2
    f2 = _log1p(wait / memo.reference_wait) if wait > 0.0 else 0.0
    w = weights
    c5 = memo.c5
    if c5 is None:
        c5 = w.data_readiness * f5_data_readiness(a, ctx)
    c8 = memo.c8
    if c8 is None:
        c8 = w.checkpoint_efficiency * f8_checkpoint_efficiency(a, ctx)
    raw = (
        w.priority * f1
        + w.wait_time * f2
        + c3
        + (memo.c4 if f4 is None else w.topology * f4)
        + c5
        + memo.c6
        + memo.c7
        + c8
        + (memo.c9 if f9 is None else w.conformance * f9)
    )
    if multiplier == 1.0:
        return raw
    return _penalise(raw, multiplier)


class _ScoreMemo:
    """What :func:`score` computes once per (context, weights) pair: the products
    ``wᵢ · fᵢ`` of the factors that do not depend on the allocation (``c5`` / ``c8``
    None when they do: per-allocation data readiness or checkpoint estimates), and per
    tenant ``w3 · f3`` and the soft-quota multiplier. A context is built for one cycle and
    not changed afterwards; the memo relies on that (it is keyed by identity)."""

    __slots__ = (
        "c4",
        "c5",
        "c6",
        "c7",
        "c8",
        "c9",
        "ctx",
        "now",
        "reference_wait",
        "tenants",
        "weights",
    )

    def __init__(self, ctx: ScoringContext, w: CostWeights) -> None:
        self.ctx = ctx
        self.weights = w
        self.now = ctx.now
        ref = ctx.reference_wait_seconds  # as wait_time_factor falls back
        self.reference_wait = ref if ref > 0.0 else DEFAULT_REFERENCE_WAIT_SECONDS
        self.c4 = w.topology * NEUTRAL
        self.c5 = None if ctx.data_readiness else w.data_readiness * NEUTRAL
        self.c6 = w.backlog * f6_backlog_pressure(ctx)
        self.c7 = w.energy * f7_energy_cost(ctx)
        self.c8 = (
            None
            if ctx.checkpoint_minutes
            else w.checkpoint_efficiency * checkpoint_factor(ctx.default_checkpoint_minutes)
        )
        self.c9 = w.conformance * NEUTRAL
        self.tenants: dict[str, tuple[float, float]] = {}

    def add_tenant(self, tenant: str) -> tuple[float, float]:
        ctx = self.ctx
        target = ctx.tenant_target_share.get(tenant, 0.0)
        usage = ctx.tenant_usage_share.get(tenant, 0.0)
        got = self.tenants[tenant] = (
            self.weights.fair_share * fair_share_deficit(target, usage),
            soft_quota_multiplier(
                ctx.budget_fraction_used.get(tenant),
                target,
                usage,
                ctx.tenant_burst_allowance.get(tenant, 0.0),
            ),
        )
        return got


_score_memo: _ScoreMemo | None = None  # the last pair scored with (one cycle's)
_log1p = math.log1p


def _memo_for(ctx: ScoringContext, weights: CostWeights) -> _ScoreMemo:
    global _score_memo
    memo = _score_memo = _ScoreMemo(ctx, weights)
    return memo


def breakdown(
    a: Allocation,
    ctx: ScoringContext,
    weights: CostWeights,
    *,
    f4: float | None = None,
    f9: float | None = None,
) -> dict[str, float]:
    """Every factor, weight and product, for ``lattice status --verbose`` and debugging.

    Keys: ``f1_priority`` .. ``f9_conformance`` (factor values), ``w1_priority`` ..
    (weights), ``c1_priority`` .. (contributions w·f), ``raw_score`` (their sum, the
    score before the penalties), ``budget_fraction`` (-1.0 when the tenant has no
    budget), ``budget_penalty``, ``share_penalty`` (usage against the fair share
    target) and ``score``."""
    values = (
        f1_priority_class(a),
        f2_wait_time(a, ctx),
        f3_fair_share_deficit(a, ctx),
        NEUTRAL if f4 is None else f4,
        f5_data_readiness(a, ctx),
        f6_backlog_pressure(ctx),
        f7_energy_cost(ctx),
        f8_checkpoint_efficiency(a, ctx),
        NEUTRAL if f9 is None else f9,
    )
    out: dict[str, float] = {}
    raw = 0.0
    for i, (name, value) in enumerate(zip(FACTOR_NAMES, values, strict=True), start=1):
        weight = float(getattr(weights, name))
        out[f"f{i}_{name}"] = value
        out[f"w{i}_{name}"] = weight
        out[f"c{i}_{name}"] = weight * value
        raw += weight * value
    tenant = a.spec.tenant
    fraction = ctx.budget_fraction_used.get(tenant)
    over = share_penalty(
        ctx.tenant_target_share.get(tenant, 0.0),
        ctx.tenant_usage_share.get(tenant, 0.0),
        ctx.tenant_burst_allowance.get(tenant, 0.0),
    )
    multiplier = budget_penalty(fraction) * over
    out["raw_score"] = raw
    out["budget_fraction"] = -1.0 if fraction is None else float(fraction)
    out["budget_penalty"] = budget_penalty(fraction)
    out["share_penalty"] = over
    out["score"] = raw if multiplier == 1.0 else _penalise(raw, multiplier)
    return out


# --------------------------------------------------------------------------- context


def gpu_hours(a: Allocation, nodes: Mapping[str, Node] | None = None) -> float:
    """GPU-hours an allocation asks for: nodes × GPUs per node × walltime hours.

    GPUs per node: with ``nodes`` and assigned nodes, each assigned node's GPU count
    from the inventory (full-node scheduling: the allocation holds all of them);
    otherwise the requested ``constraints.gpu_count``. A count of 0 or an unknown node
    counts 1 GPU, as the budget ledger does ("unknown nodes default to 1 GPU"), so
    CPU-only work still registers. Unbounded allocations (walltime 0) count 0 hours."""
    hours = a.spec.walltime_seconds / 3600.0
    if not hours > 0.0:
        return 0.0
    if nodes is not None and a.assigned_nodes:
        gpus = 0
        for nid in a.assigned_nodes:
            n = nodes.get(nid)
            gpus += max(1, n.capabilities.gpu_count) if n is not None else 1
        return gpus * hours
    return max(0, a.spec.nodes) * max(1, a.spec.constraints.gpu_count) * hours


class StateView(Protocol):
    """What :func:`build_context` reads: a ``StateMirror`` or anything shaped like it."""

    allocations: Mapping[str, Allocation]
    nodes: Mapping[str, Node]
    tenants: Mapping[str, Tenant]


class ScoringIndex(Protocol):
    """Running totals a view may keep as ``scoring_index`` (RM-Replay's engine keeps one
    as it queues, assigns and releases), so that :func:`build_context` need not scan
    every allocation and node in every cycle. Whoever offers one must keep it exact:
    the context built with it must equal the one built by scanning, float for float
    (sums added in the same order)."""

    def queued_gpu_hours(self) -> float:
        """``gpu_hours(a)`` summed over the Pending allocations, in ``pending`` order."""
        ...

    def running_gpu_hours(self) -> float:
        """``gpu_hours(a, nodes)`` summed over the allocations holding nodes, in
        ``holding`` order."""
        ...

    def held_nodes(self) -> Mapping[str, int]:
        """Per tenant, the nodes its allocations hold (tenants holding none absent)."""
        ...

    def free_groups(self, vcluster: str | None) -> int:
        """How many dragonfly groups hold a free (Ready, unowned, enabled) node whose
        home is "" or ``vcluster`` (any home when None)."""
        ...


def _scan_allocations(
    pending: Iterable[Allocation], holding: Iterable[Allocation], nodes: Mapping[str, Node]
) -> tuple[float, float, dict[str, int]]:
    """(queued GPU-hours, running GPU-hours, nodes held per tenant) by scanning."""
    queued = 0.0
    is_pending = AllocationState.PENDING
    for a in pending:
        if a.state == is_pending:
            spec = a.spec
            hours = spec.walltime_seconds / 3600.0
            if hours > 0.0:  # gpu_hours(a): requested nodes x GPUs per node x hours
                queued += max(0, spec.nodes) * max(1, spec.constraints.gpu_count) * hours
    running = 0.0
    held_nodes: dict[str, int] = {}
    for a in holding:
        if a.state not in HOLDING_STATES:
            continue
        running += gpu_hours(a, nodes)
        t = a.spec.tenant
        held_nodes[t] = held_nodes.get(t, 0) + len(a.assigned_nodes)
    return queued, running, held_nodes


def build_context(
    state: StateView,
    now: float,
    *,
    vcluster: str | None = None,
    reference_wait_seconds: float = DEFAULT_REFERENCE_WAIT_SECONDS,
    energy_prices: Iterable[tuple[float, float, float]] = (),
    energy_price_min: float | None = None,
    energy_price_max: float | None = None,
    data_readiness: Mapping[str, float] | None = None,
    checkpoint_minutes: Mapping[str, float] | None = None,
    default_checkpoint_minutes: float = DEFAULT_CHECKPOINT_MINUTES,
    budget_fraction_used: Mapping[str, float] | None = None,
    budget_period_days: float = ledger.DEFAULT_BUDGET_PERIOD_DAYS,
) -> ScoringContext:
    """One cycle's :class:`ScoringContext` from a StateMirror-like view and ``now``.

    * f6: queued GPU-hours = Σ :func:`gpu_hours` of Pending allocations; running =
      Σ over Staging/Running/Checkpointing ones (whole cluster: "Global signal").
      Uses the view's ``pending`` / ``holding`` indexes when it has them.
    * f3: actual usage = nodes held by the tenant's running allocations / nodes in the
      inventory, i.e. an instantaneous window (the share of system capacity at ``now``;
      the spec's target is "~15% of system capacity"). A time-decayed window over the
      budget ledger is the natural refinement. Targets are ``fair_share_target``.
    * Budgets: ``budget_fraction_used`` per tenant as given (e.g. from Waldur's
      remaining budget, which takes precedence); without it the internal ledger,
      :func:`lattice_common.ledger.budget_utilization`, over every allocation in the
      view (O(all allocations); skipped when no tenant has a budget).
    * f4: ``max_groups_available`` = distinct dragonfly groups holding a free Ready node
      usable by ``vcluster`` (all vClusters when ``None``).
    * A view with a ``scoring_index`` (:class:`ScoringIndex`) supplies the f6 sums, the
      nodes held per tenant and the f4 count instead of scanning for them.
    """
    allocations = state.allocations
    nodes = state.nodes
    tenants = state.tenants
    pending_ids = getattr(state, "pending", None)
    holding_ids = getattr(state, "holding", None)
    pending = (
        (a for a in allocations.values() if a.state == AllocationState.PENDING)
        if pending_ids is None
        else (allocations[i] for i in pending_ids if i in allocations)
    )
    holding = (
        (a for a in allocations.values() if a.state in HOLDING_STATES)
        if holding_ids is None
        else (allocations[i] for i in holding_ids if i in allocations)
    )
    # Built for every vCluster in every cycle, tens of thousands of times in a replay:
    # a view that keeps a ScoringIndex spares the scans of allocations and nodes, and
    # the loops are gpu_hours written out (the same terms added in the same order).
    index: ScoringIndex | None = getattr(state, "scoring_index", None)
    if index is not None:
        queued = index.queued_gpu_hours()
        running = index.running_gpu_hours()
        held_nodes: Mapping[str, int] = index.held_nodes()
    else:
        queued, running, held_nodes = _scan_allocations(pending, holding, nodes)
    capacity = len(nodes)
    usage = {t: (n / capacity if capacity else 0.0) for t, n in held_nodes.items()}
    targets = {name: t.fair_share_target for name, t in tenants.items()}
    bursts = {name: t.burst_allowance for name, t in tenants.items() if t.burst_allowance > 0}

    if budget_fraction_used is not None:
        fractions = dict(budget_fraction_used)
    elif any(
        t.gpu_hours_budget is not None or t.node_hours_budget is not None for t in tenants.values()
    ):
        fractions = ledger.budget_utilization(
            allocations.values(),
            tenants.values(),
            now=now,
            period_days=budget_period_days,
            node_gpus=ledger.node_gpu_counts(nodes.values()),
        )
    else:
        fractions = {}

    if index is not None:
        max_groups = index.free_groups(vcluster)
    else:
        max_groups = len(
            {
                n.group
                for n in nodes.values()
                if n.state == NodeState.READY
                and not n.owner
                and not n.disabled
                and (vcluster is None or n.home_vcluster in ("", vcluster))
            }
        )
    return ScoringContext(
        now=now,
        reference_wait_seconds=reference_wait_seconds,
        tenant_usage_share=usage,
        tenant_target_share=targets,
        tenant_burst_allowance=bursts,
        queued_gpu_hours=queued,
        running_gpu_hours=running,
        energy_prices=[(float(s), float(e), float(p)) for s, e, p in energy_prices],
        energy_price_min=energy_price_min,
        energy_price_max=energy_price_max,
        budget_fraction_used=fractions,
        data_readiness=dict(data_readiness or {}),
        checkpoint_minutes=dict(checkpoint_minutes or {}),
        default_checkpoint_minutes=default_checkpoint_minutes,
        max_groups_available=max_groups,
    )
