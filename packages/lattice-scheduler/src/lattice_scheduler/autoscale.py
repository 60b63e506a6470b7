"""Autoscaling of reactive allocations: the decision, as plain functions on plain data.

Spec (Autoscaling): simple, metric-driven, one node at a time, within the allocation's
bounds. Every evaluation interval the scheduler reads the allocation's metric (its mean
across the allocation's nodes) and appends a :class:`Sample`; :func:`decide` reads the
samples taken since the allocation's last scale event (or its start) and answers
up / down / hold with a reason that quotes the figures:

* no metric (the newest sample is missing, failed, or older than two evaluation
  intervals): hold. The allocation is never scaled blindly;
* within ``cooldown`` seconds of the last scale event or of the start: hold (the
  specification applies the cooldown after a resume too, and a first start is treated
  the same way);
* after 3 rejected scale proposals in a row: hold for 2 cooldown periods (backoff);
* up: every sample of the last ``scale_up_window`` seconds is at or above ``target``
  (the newest included), unless the allocation is at ``max_nodes``, its tenant holds
  its whole ``max_nodes`` quota (no error: it continues at its size, and resumes by
  itself when the quota grows), or no node is free to add;
* down: every sample of the last ``scale_down_window`` seconds is at or below
  ``target * scale_down_threshold``, unless it is at ``min_nodes``;
* else hold.

Thresholds: the specification scales up when the metric is above target and down
below ``target x scale_down_threshold`` (0.5); the issue's "up at >= 0.8, down at
<= 0.2" is the same rule with ``target: 0.8, scale_down_threshold: 0.25``. Both
comparisons include the boundary (>= and <=). Every setting is per allocation with the
specification's defaults (:class:`lattice_common.types.ScalingSpec`).

Metric values: the agents' ``cpu_utilization`` is percent of one core summed over the
allocation's processes on a node and ``gpu_utilization`` percent per GPU; a target such
as 0.8 is a fraction, so :func:`utilization` turns them into fractions of the node
(CPU: divided by 100 x the node's cores) before the mean across nodes. Any other metric
(queue_depth, request_rate, custom ``name{label="v"}``) is compared as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from lattice_common import promql
from lattice_common.types import SCALE_DOWN, SCALE_HOLD, SCALE_UP, CheckpointHint, ScalingSpec

#: rejected scale proposals in a row before backing off (spec: Scale-Up Proposal Rejected)
MAX_REJECTIONS = 3
#: the backoff after them, in cooldown periods
BACKOFF_COOLDOWNS = 2
#: a sample older than this many evaluation intervals is no metric
STALE_INTERVALS = 2.0
#: ``last_over_time`` looks back at least this far: two of the agents' default 30 s
#: aggregation windows, so one late push does not read as "no metric"
METRIC_LOOKBACK_SECONDS = 60.0

#: the metrics the node agents push per allocation (labels alloc_id, node_id, agg)
AGENT_METRICS = frozenset(
    {
        "cpu_utilization",
        "gpu_utilization",
        "gpu_memory_used",
        "gpu_power_draw",
        "memory_used",
        "network_tx_bytes",
        "network_rx_bytes",
        "io_read_bytes",
        "io_write_bytes",
    }
)
#: of those, the ones in percent that a fractional target compares against
PERCENT_METRICS = frozenset({"cpu_utilization", "gpu_utilization"})

ORDER = {SCALE_DOWN: 0, SCALE_HOLD: 1, SCALE_UP: 2}
"""Decisions ordered by the metric that leads to them (for the monotonicity property)."""


@dataclass(frozen=True)
class Sample:
    """The allocation's metric at ``at``; ``value`` None: there was none (query failed,
    no series)."""

    at: float
    value: float | None


@dataclass(frozen=True)
class ScalingState:
    """What the decision needs to know besides the settings.

    ``last_event_at``: the last scale event or the (re)start, whichever is later;
    ``quota``: (tenant, nodes it holds, its max_nodes) when it has a hard node quota;
    ``free_nodes``: nodes the scheduler could add now."""

    samples: tuple[Sample, ...]
    current: int
    min_nodes: int
    max_nodes: int
    last_event_at: float | None = None
    rejections: int = 0
    last_rejection_at: float | None = None
    quota: tuple[str, int, int] | None = None
    free_nodes: int = 1


@dataclass(frozen=True)
class Decision:
    """``action`` up | down | hold; ``reason`` with the figures (moves as the metric does);
    ``blocked``: why the autoscaler cannot act on what the metric asks for (no metric,
    quota, no free node, backoff, at max_nodes), in words that do not change with every
    sample (the scheduler publishes it only when it changes); ``value``: the newest
    metric value, when there is one."""

    action: str
    reason: str
    blocked: str = ""
    value: float | None = None


def decide(state: ScalingState, spec: ScalingSpec, now: float) -> Decision:
    """Scale up, down or hold (see the module docstring). Pure."""
    name = metric_label(spec.metric)
    since = state.last_event_at if state.last_event_at is not None else -math.inf
    samples = [s for s in state.samples if since < s.at <= now]
    newest = samples[-1] if samples else None
    if (
        newest is None
        or newest.value is None
        or now - newest.at > STALE_INTERVALS * spec.evaluation_interval
    ):
        why = f"no value of {name} for this allocation"
        return Decision(SCALE_HOLD, f"{why}: no scaling without a metric", blocked=why)
    value = newest.value
    if state.last_event_at is not None and now < state.last_event_at + spec.cooldown:
        left = state.last_event_at + spec.cooldown - now
        return Decision(SCALE_HOLD, f"cooldown: {left:.0f} s left", value=value)
    if (
        state.rejections >= MAX_REJECTIONS
        and state.last_rejection_at is not None
        and now < state.last_rejection_at + BACKOFF_COOLDOWNS * spec.cooldown
    ):
        until = state.last_rejection_at + BACKOFF_COOLDOWNS * spec.cooldown
        why = f"{state.rejections} scale proposals rejected in a row; backing off"
        return Decision(SCALE_HOLD, f"{why} for {until - now:.0f} s more", blocked=why, value=value)
    low = spec.target * spec.scale_down_threshold
    up_for = held_for(samples, lambda v: v >= spec.target)
    if up_for is not None and up_for >= spec.scale_up_window:
        evidence = f"{name} {value:.2f} >= {spec.target:.2f} for {up_for:.0f} s"
        if state.current >= state.max_nodes:
            return Decision(
                SCALE_HOLD,
                f"{evidence}, but at max_nodes {state.max_nodes}",
                blocked=f"at max_nodes {state.max_nodes}",
                value=value,
            )
        if state.quota is not None and state.quota[1] >= state.quota[2]:
            tenant, held, limit = state.quota
            why = f"tenant {tenant} holds {held} of max_nodes {limit}"
            return Decision(SCALE_HOLD, f"{evidence}, but {why}", blocked=why, value=value)
        if state.free_nodes < 1:
            why = "no free node to add"
            return Decision(SCALE_HOLD, f"{evidence}, but {why}", blocked=why, value=value)
        return Decision(SCALE_UP, evidence, value=value)
    down_for = held_for(samples, lambda v: v <= low)
    if down_for is not None and down_for >= spec.scale_down_window:
        evidence = (
            f"{name} {value:.2f} <= {low:.2f} ({spec.scale_down_threshold:g} of target "
            f"{spec.target:g}) for {down_for:.0f} s"
        )
        if state.current <= state.min_nodes:
            return Decision(
                SCALE_HOLD, f"{evidence}, but at min_nodes {state.min_nodes}", value=value
            )
        return Decision(SCALE_DOWN, evidence, value=value)
    if up_for is not None:
        text = f"{name} {value:.2f} >= {spec.target:.2f} for {up_for:.0f} of {spec.scale_up_window:.0f} s"
    elif down_for is not None:
        text = (
            f"{name} {value:.2f} <= {low:.2f} for {down_for:.0f} of {spec.scale_down_window:.0f} s"
        )
    else:
        text = f"{name} {value:.2f} between {low:.2f} and {spec.target:.2f}"
    return Decision(SCALE_HOLD, text, value=value)


def held_for(samples: Sequence[Sample], ok: Callable[[float], bool]) -> float | None:
    """Seconds the condition ``ok(value)`` has held: from the oldest of the unbroken run
    of samples meeting it that ends with the newest, to the newest; None when the newest
    does not meet it (a missing value breaks the run)."""
    start = None
    for s in reversed(samples):
        if s.value is None or not ok(s.value):
            break
        start = s.at
    return None if start is None else samples[-1].at - start


def metric_label(metric: str) -> str:
    """The metric's name as the reasons show it (a custom metric's name with its
    matchers; an unparsable one as given)."""
    return (metric or "cpu_utilization").strip()


def utilization(
    metric: str, per_node: Mapping[str, float], cores: Mapping[str, int]
) -> float | None:
    """The allocation's metric from its per-node values: their mean, with the agents'
    percent metrics as fractions of the node (``cpu_utilization`` / (100 x cores),
    ``gpu_utilization`` / 100). None without any value."""
    values = [v for v in per_node.values() if math.isfinite(v)]
    if not values:
        return None
    name = (metric or "cpu_utilization").strip()
    if name == "cpu_utilization":
        values = [
            v / (100.0 * max(1, cores.get(nid, 0) or 1))
            for nid, v in per_node.items()
            if math.isfinite(v)
        ]
    elif name == "gpu_utilization":
        values = [v / 100.0 for v in values]
    return sum(values) / len(values)


def metric_query(
    metric: str, alloc_id: str, nodes: Sequence[str], interval: float
) -> tuple[str, dict[str, str]]:
    """(PromQL, scope) of one evaluation: ``avg by (node_id) (last_over_time(SEL[W]))``
    with W = max(interval, METRIC_LOOKBACK_SECONDS). The agents' metrics are read from
    their ``agg="mean"`` windows and scoped to the allocation by ``alloc_id`` (the
    TSDB's ``extra_label``) and to the nodes it holds now; any other metric, e.g. a
    custom ``name{label="v"}``, by those nodes (``node_id``) alone. Every label value is quoted
    (``lattice_common.promql``); a metric that is not ``name`` or ``name{...}`` is a
    ``ValueError``."""
    name, matchers = promql.parse_metric_ref(metric or "cpu_utilization")
    look = max(interval, METRIC_LOOKBACK_SECONDS)
    # only the nodes it holds now: a released node's last values stay in the TSDB for
    # the look-back and must not count
    on_nodes = {"node_id": list(nodes)}
    if name in AGENT_METRICS:
        sel = promql.metric_selector(name, matchers, labels={"agg": "mean"}, regex=on_nodes)
        scope = {"alloc_id": alloc_id}
    else:
        sel = promql.metric_selector(name, matchers, regex=on_nodes)
        scope = {}
    expr = promql.aggregate("avg", ["node_id"], promql.rollup("last_over_time", sel, look))
    return expr, scope


def check_metric(metric: str) -> str:
    """The metric as stored: ``name`` or ``name{label="v"}`` (ValueError otherwise)."""
    name, matchers = promql.parse_metric_ref(metric)
    promql.metric_selector(name, matchers)
    return metric.strip()


# --- scale-down: checkpoint the nodes being released first ---------------------------
#
# Spec (Checkpoint Broker, Reactive Allocation Checkpointing): "When the scheduler
# decides to scale down a reactive allocation, it triggers a checkpoint on the nodes
# being released before removing them from the allocation." A checkpointable allocation
# is therefore scaled down in two steps: the decision records the nodes it will release
# (``ScalingStatus.releasing``, ``release_at``, ``release_by``) together with a
# checkpoint hint (the broker's "checkpoint and continue", which the head node's agent
# runs through the application's protocol), and the nodes go once the hint's outcome is
# in or at ``release_by``. Both steps live in the quorum, so a restarted scheduler
# carries on where it was.

RELEASE_WAIT = "wait"
RELEASE_HINT = "hint"
RELEASE_GO = "release"


@dataclass(frozen=True)
class ReleaseStep:
    """``action``: wait (a hint is outstanding), hint (ask for one now: none was issued
    for this release, or it was lost to a race), release (with ``why`` in words and
    ``result``: checkpointed, failed (the application could not) or timeout)."""

    action: str
    why: str = ""
    result: str = ""


def release_step(
    releasing: Sequence[str],
    release_at: float | None,
    release_by: float | None,
    hint: CheckpointHint | None,
    hint_outstanding: bool,
    last_checkpoint: str,
    now: float,
    *,
    checkpointable: bool = True,
) -> ReleaseStep | None:
    """What to do next about a scale-down that waits for a checkpoint (None: there is
    none). Any hint that completed at or after ``release_at`` counts (the broker's own
    hint issued a moment earlier checkpoints the same state); ``last_checkpoint``: the
    allocation's last checkpoint id, named in the reason. The deadline wins over an
    outstanding hint: the nodes are released without the checkpoint. Not
    ``checkpointable`` (a borrowed node given back by an allocation without a protocol):
    the application has until the deadline to drain it, no hint."""
    if not releasing:
        return None
    asked = release_at if release_at is not None else -math.inf
    if hint is not None and hint.done_at is not None and hint.done_at >= asked:
        if hint.outcome == "ok":
            why = f"checkpoint {last_checkpoint or hint.id} written first"
            return ReleaseStep(RELEASE_GO, why, "checkpointed")
        return ReleaseStep(RELEASE_GO, f"released without a checkpoint ({hint.outcome})", "failed")
    if release_by is not None and now >= release_by:
        waited = now - asked if release_at is not None else 0.0
        why = f"released without a checkpoint (none after {waited:.0f} s)"
        return ReleaseStep(RELEASE_GO, why, "timeout")
    if hint_outstanding or not checkpointable:
        return ReleaseStep(RELEASE_WAIT)
    return ReleaseStep(RELEASE_HINT)


# --- borrowed nodes ------------------------------------------------------------------
#
# Spec (Autoscaling, Preemption Interaction): borrowed nodes are valid targets for
# reactive scaling beyond min_nodes; when the home vCluster reclaims one the reactive
# allocation scales down gracefully; borrowed nodes get a 30 s grace (Node Lifecycle:
# "Borrowed nodes should be reclaimed quickly"). So the autoscaler, not preemption,
# gives such a node back: released through the same two steps as any scale-down, with
# the borrowed-node grace as the deadline.


def reclaimed_node(
    assigned: Sequence[str],
    homes: Mapping[str, str],
    vcluster: str,
    wanted_by: Collection[str],
) -> str:
    """The node a reactive allocation of ``vcluster`` should give back now: its most
    recently added borrowed node (home vCluster neither its own nor shared) whose home
    vCluster has work waiting (``wanted_by``); never its head node. "" when none."""
    for nid in reversed(assigned[1:]):
        home = homes.get(nid, "")
        if home and home != vcluster and home in wanted_by:
            return nid
    return ""


def gives_back_by_scaling(
    assigned: Sequence[str], homes: Mapping[str, str], vcluster: str, min_nodes: int, lender: str
) -> bool:
    """A reactive allocation of ``vcluster`` returns the nodes it borrowed from
    ``lender`` by scaling down (so preemption leaves it alone): none of them is its head
    node and it keeps at least ``min_nodes`` without them."""
    borrowed = [n for n in assigned if homes.get(n, "") == lender and lender != vcluster]
    return (
        bool(borrowed)
        and assigned[0] not in borrowed
        and len(assigned) - len(borrowed) >= max(1, min_nodes)
    )


# --- metric oscillation ------------------------------------------------------------------
#
# Spec (Autoscaling, Metric Oscillation): the cooldown damps oscillation around the
# target; "if scale events alternate for more than 5 cycles: alert raised suggesting the
# user adjust their target or increase cooldown". No automatic target adjustment.

#: direction changes in a row beyond which the scale events count as oscillating
OSCILLATION_ALTERNATIONS = 5


def alternations(events: Sequence[str]) -> int:
    """Direction changes in the unbroken alternating run of scale events (up/down) that
    ends with the newest: ``up down up`` is 2, ``up up down`` is 1."""
    seq = list(events)
    n = 0
    for before, after in zip(reversed(seq[:-1]), reversed(seq[1:]), strict=True):
        if before == after:
            break
        n += 1
    return n


def oscillating(events: Sequence[str]) -> bool:
    """The scale events alternated for more than :data:`OSCILLATION_ALTERNATIONS`
    cycles."""
    return alternations(events) > OSCILLATION_ALTERNATIONS
