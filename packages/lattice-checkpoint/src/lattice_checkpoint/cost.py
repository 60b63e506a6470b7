"""The checkpoint cost model (spec: Checkpoint Broker, Cost Model), a pure function.

    Should_checkpoint(j, t) = Value(j, t) > Cost(j, t)
    Cost  = write_time + compute_waste + storage_cost
    Value = recompute_saved + preemptability + backlog_relief

Every term is in GPU-hours so that they add up: ``write_time`` is the wall time of the
write (one device's worth of hours), ``compute_waste`` the GPU-hours the allocation
loses while it writes, ``storage_cost`` the configured GPU-hour price of the bytes
kept. On the value side the work at risk ``W`` is the GPU-hours computed since the last
checkpoint; ``recompute_saved`` weighs it by the probability that the run fails,
``preemptability`` by the chance that higher-class work takes the nodes, and
``backlog_relief`` by how much the queue needs nodes that a checkpoint makes free to
take. A CPU-only node counts as one device.

What the model promises (property-tested): more backlog or worse node health never
lowers Value; a larger checkpoint or slower storage never lowers Cost; with no write
bandwidth (storage unavailable) Cost is infinite and nothing is checkpointed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = float(1 << 30)

DEFAULT_NODE_MTBF_HOURS = 1000.0
DEFAULT_STORAGE_COST_GPU_HOURS_PER_GB = 0.0001
DEFAULT_CHECKPOINT_BYTES_PER_NODE = GIB

# how much one health signal of the allocation's worst node raises its failure rate
ECC_ERROR_WEIGHT = 0.5  # per corrected ECC error seen recently
THERMAL_WARNING_WEIGHT = 1.0  # per thermal warning from the BMC
DEGRADED_WEIGHT = 10.0  # the node is Degraded (missed heartbeats, failed checks)

# walltime: the run ends at its walltime; the work since the last checkpoint is lost
# then unless a checkpoint is written in time. Within this many write times of the
# end, the loss is certain.
WALLTIME_MARGIN_WRITES = 3.0
WALLTIME_MIN_HORIZON_SECONDS = 600.0

PREEMPTION_CLASSES = 10  # classes 0..10; 10 (sensitive) is never preempted
BORROWED_PREEMPTION_BONUS = 0.25  # borrowed nodes are reclaimed by their home vCluster


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """The worst health signals over an allocation's nodes (telemetry / BMC)."""

    ecc_errors: int = 0
    thermal_warnings: int = 0
    degraded: bool = False


@dataclass(frozen=True, slots=True)
class JobView:
    """One Running allocation as the model sees it."""

    allocation_id: str
    node_count: int
    gpus_per_node: int = 0
    gpu_memory_bytes_per_node: float = 0.0  # summed over the node's GPUs
    running_seconds: float = 0.0  # since this run started
    seconds_since_checkpoint: float = 0.0  # since its last checkpoint (or the start)
    walltime_remaining_seconds: float | None = None  # None: no walltime
    preemption_class: int = 5
    borrowed: bool = False  # runs on nodes borrowed from another vCluster
    measured_checkpoint_bytes: int | None = None  # its last checkpoint's size
    health: NodeHealth = field(default_factory=NodeHealth)

    @property
    def devices(self) -> int:
        return self.node_count * max(self.gpus_per_node, 1)


@dataclass(frozen=True, slots=True)
class StorageView:
    """The checkpoint destination: its measured write bandwidth (0 = unavailable)."""

    write_bandwidth_bytes_per_s: float
    cost_gpu_hours_per_gb: float = DEFAULT_STORAGE_COST_GPU_HOURS_PER_GB


@dataclass(frozen=True, slots=True)
class QueueView:
    """Global and per-job queue signals. ``backlog_pressure``: queued over queued plus
    running GPU-hours (0..1). ``higher_class_demand``: for this job, the sum over
    waiting allocations of a higher class of their urgency (0..1 each), capped at 1 by
    the model."""

    backlog_pressure: float = 0.0
    higher_class_demand: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelParams:
    node_mtbf_hours: float = DEFAULT_NODE_MTBF_HOURS
    default_checkpoint_bytes_per_node: float = DEFAULT_CHECKPOINT_BYTES_PER_NODE


@dataclass(frozen=True, slots=True)
class CostParts:
    checkpoint_bytes: float
    write_seconds: float
    write_time: float  # GPU-hours (one device)
    compute_waste: float
    storage_cost: float

    @property
    def total(self) -> float:
        return self.write_time + self.compute_waste + self.storage_cost


@dataclass(frozen=True, slots=True)
class ValueParts:
    at_risk: float  # GPU-hours since the last checkpoint
    failure_probability: float
    preemption_probability: float
    recompute_saved: float
    preemptability: float
    backlog_relief: float

    @property
    def total(self) -> float:
        return self.recompute_saved + self.preemptability + self.backlog_relief


@dataclass(frozen=True, slots=True)
class Decision:
    allocation_id: str
    checkpoint: bool
    value: ValueParts
    cost: CostParts
    reason: str  # the largest value term when checkpointing, else why not

    def explain(self) -> str:
        v, c = self.value, self.cost
        return (
            f"value {v.total:.4g} (recompute_saved {v.recompute_saved:.4g}, preemptability "
            f"{v.preemptability:.4g}, backlog_relief {v.backlog_relief:.4g}) "
            f"{'>' if self.checkpoint else '<='} cost {c.total:.4g} (write_time "
            f"{c.write_time:.4g}, compute_waste {c.compute_waste:.4g}, storage_cost "
            f"{c.storage_cost:.4g})"
        )


def checkpoint_bytes(job: JobView, params: ModelParams) -> float:
    """checkpoint_size(j): what its last checkpoint measured, else GPU memory x node
    count, else the configured default per node."""
    if job.measured_checkpoint_bytes is not None and job.measured_checkpoint_bytes > 0:
        return float(job.measured_checkpoint_bytes)
    per_node = job.gpu_memory_bytes_per_node or params.default_checkpoint_bytes_per_node
    nodes = job.node_count
    return per_node * nodes if per_node > 0 and nodes > 0 else 0.0


def write_seconds(size_bytes: float, bandwidth: float) -> float:
    return math.inf if bandwidth <= 0 else size_bytes / bandwidth


def cost(job: JobView, storage: StorageView, params: ModelParams) -> CostParts:
    size = checkpoint_bytes(job, params)
    secs = write_seconds(size, storage.write_bandwidth_bytes_per_s)
    hours = secs / 3600.0
    return CostParts(
        checkpoint_bytes=size,
        write_seconds=secs,
        write_time=hours,
        compute_waste=hours * job.devices,
        storage_cost=size / 1e9 * storage.cost_gpu_hours_per_gb,
    )


def failure_probability(job: JobView, params: ModelParams, write_secs: float) -> float:
    """Chance the run loses its work since the last checkpoint: hardware failure over
    its duration so far on its nodes (exponential, the node MTBF shortened by the worst
    node's health signals), or its walltime ending before another checkpoint."""
    h = job.health
    signals = 1.0
    if h.ecc_errors > 0:
        signals += ECC_ERROR_WEIGHT * h.ecc_errors
    if h.thermal_warnings > 0:
        signals += THERMAL_WARNING_WEIGHT * h.thermal_warnings
    if h.degraded:
        signals += DEGRADED_WEIGHT
    nodes = job.node_count if job.node_count > 1 else 1
    hazard = nodes / params.node_mtbf_hours * signals
    running = job.running_seconds if job.running_seconds > 0 else 0.0
    p_fail = 1.0 - math.exp(-hazard * running / 3600.0)
    p_wall = 0.0
    if job.walltime_remaining_seconds is not None and math.isfinite(write_secs):
        horizon = max(WALLTIME_MIN_HORIZON_SECONDS, WALLTIME_MARGIN_WRITES * write_secs)
        p_wall = min(1.0, max(0.0, 1.0 - job.walltime_remaining_seconds / horizon))
    return max(p_fail, p_wall)


def preemption_probability(job: JobView) -> float:
    """How reclaimable the job is: lower classes more, borrowed nodes more; class 10
    (sensitive) never."""
    if job.preemption_class >= PREEMPTION_CLASSES:
        return 0.0
    cls = job.preemption_class if job.preemption_class > 0 else 0
    p = (PREEMPTION_CLASSES - cls) / PREEMPTION_CLASSES
    if job.borrowed:
        p += BORROWED_PREEMPTION_BONUS
    return min(1.0, p)


def value(job: JobView, queue: QueueView, params: ModelParams, write_secs: float) -> ValueParts:
    since = job.seconds_since_checkpoint
    at_risk = (since if since > 0 else 0.0) / 3600.0 * job.devices
    p_fail = failure_probability(job, params, write_secs)
    p_preempt = preemption_probability(job)
    demand = _unit(queue.higher_class_demand)
    pressure = _unit(queue.backlog_pressure)
    return ValueParts(
        at_risk=at_risk,
        failure_probability=p_fail,
        preemption_probability=p_preempt,
        recompute_saved=at_risk * p_fail,
        preemptability=at_risk * demand * p_preempt,
        backlog_relief=at_risk * pressure * p_preempt,
    )


def _unit(x: float) -> float:
    return 0.0 if x <= 0 else (1.0 if x >= 1 else x)


def should_checkpoint(
    job: JobView, storage: StorageView, queue: QueueView, params: ModelParams | None = None
) -> Decision:
    """Should_checkpoint(j, t) = Value(j, t) > Cost(j, t), with its components."""
    params = params or ModelParams()
    c = cost(job, storage, params)
    v = value(job, queue, params, c.write_seconds)
    if not math.isfinite(c.total):
        return Decision(job.allocation_id, False, v, c, "storage_unavailable")
    ok = v.total > c.total
    if not ok:
        reason = "cost_exceeds_value"
    else:
        terms = {
            "recompute_saved": v.recompute_saved,
            "preemptability": v.preemptability,
            "backlog_relief": v.backlog_relief,
        }
        reason = max(terms, key=lambda k: terms[k])
    return Decision(job.allocation_id, ok, v, c, reason)


def estimated_checkpoint_minutes(
    job: JobView, storage: StorageView, params: ModelParams, measured_seconds: float | None
) -> float | None:
    """The scheduler's f8 input: the last checkpoint's measured duration when there is
    one, else the write time from the size estimate and the measured bandwidth (None
    while storage is unavailable)."""
    if measured_seconds is not None and measured_seconds >= 0:
        return measured_seconds / 60.0
    secs = write_seconds(checkpoint_bytes(job, params), storage.write_bandwidth_bytes_per_s)
    return secs / 60.0 if math.isfinite(secs) else None
