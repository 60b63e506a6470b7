"""RM-Replay's plain data: trace events, the node inventory, and the simulation result.

Everything here is a msgspec Struct, so a result encodes to JSON deterministically
(:func:`dump_result`: sorted dict keys, no wall-clock figures) and decodes back
(:func:`load_result`) for reports and A/B comparisons. The engine
(:mod:`rm_replay.engine`) produces a :class:`SimulationResult`; the metrics, report
and comparison modules only read it.

Times are seconds. Trace times are absolute (seconds since the Unix epoch, UTC) so
that time-of-day factors (f7 energy) see the real hour; an SWF trace without a
``UnixStartTime`` header starts at 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from lattice_common.error_text import render_error
from lattice_common.types import ScalingSpec

__all__ = [
    "JOB_STATES",
    "CancelEvent",
    "CompleteEvent",
    "CycleStat",
    "Inventory",
    "InventoryError",
    "JobRecord",
    "NodeClass",
    "ReplayInputError",
    "SimulationResult",
    "SubmitEvent",
    "SwfError",
    "TenantSpec",
    "TraceError",
    "TraceEvent",
    "UtilizationSample",
    "VClusterSpec",
    "WeightsError",
    "dump_result",
    "dump_timing",
    "load_result",
]


# --------------------------------------------------------------------------- errors


class ReplayInputError(ValueError):
    """Bad input (trace, SWF, inventory, weights): what is wrong, where, and a hint.

    ``str(e)`` is the one-line message with the location (``path:line: ...``);
    :meth:`render` adds the ``Hint:`` line, the way the CLI prints it. Without a
    specific hint, ``hint`` is the subclass's ``default_hint`` (the input's format)."""

    default_hint = "See the input formats in tools/rm-replay/README.md."

    def __init__(
        self, message: str, *, hint: str = "", path: str | None = None, line: int | None = None
    ) -> None:
        self.message = message
        self.hint = hint or self.default_hint
        self.path = path
        self.line = line
        super().__init__(self._located())

    def _located(self) -> str:
        where = ""
        if self.path and self.line:
            where = f"{self.path}:{self.line}: "
        elif self.path:
            where = f"{self.path}: "
        elif self.line:
            where = f"line {self.line}: "
        return where + self.message

    def at(self, *, path: str | None = None, line: int | None = None) -> ReplayInputError:
        """The same error with a location filled in (keeps any already set)."""
        if path is not None and self.path is None:
            self.path = path
        if line is not None and self.line is None:
            self.line = line
        self.args = (self._located(),)
        return self

    def render(self) -> str:
        return render_error(self._located(), hint=self.hint)


class TraceError(ReplayInputError):
    """A malformed JSON-lines trace line or an inconsistent trace."""

    default_hint = (
        'Each trace line is one JSON object: {"ts": ..., "type": "submit", "alloc": {"id": ..., '
        '"tenant": ..., "nodes": N, "walltime": "2h", ...}} or {"ts": ..., "type": "complete", '
        '"alloc_id": ..., "duration": "1h", "exit": 0} or {"ts": ..., "type": "cancel", '
        '"alloc_id": ...} (see tools/rm-replay/README.md).'
    )


class SwfError(TraceError):
    """A malformed Standard Workload Format line."""

    default_hint = (
        "An SWF job line has 18 whitespace-separated numbers (-1 for unknown); "
        "comment lines start with ';'."
    )


class InventoryError(ReplayInputError):
    """A malformed node inventory YAML."""

    default_hint = (
        "See the inventory format in tools/rm-replay/README.md (node_classes: a list of "
        "classes with count, gpu_type, gpus, groups, conformance)."
    )


class WeightsError(ReplayInputError):
    """A malformed weight profile YAML."""

    default_hint = (
        "A weights file maps vCluster names to the Tuning Guide's weights, e.g. "
        "'hpc-batch: {priority: 0.2, wait_time: 0.25, ...}' (or w1..w9)."
    )


# --------------------------------------------------------------------------- trace


class SubmitEvent(msgspec.Struct, kw_only=True, frozen=True, tag="submit", tag_field="type"):
    """An allocation submission.

    ``t``: submit time. ``nodes``: whole nodes requested (with ``min_nodes`` > 0, a
    range: the scheduler may start it on fewer, down to ``min_nodes``). ``walltime``: requested
    limit in seconds, 0 = none. ``gpu_type`` / ``gpus_per_node`` / ``memory_gb`` /
    ``features`` / ``topology``: hard constraints as in ``lattice_common.types.Constraints``
    (``features`` may carry the solver's flags, e.g. ``require_conformance``).
    ``preemption_class``: 0..10 (the trace's ``priority``); ``sensitive`` jobs run as
    class 10. ``runtime`` / ``exit``: what really happened (from the matching complete
    event or inline); ``runtime`` None = unknown (the engine then assumes the job runs
    for its whole walltime). ``vcluster`` "" = the simulation's default vCluster.

    ``checkpoint``: how the application checkpoints (``none``, ``auto``/``manual`` or a
    protocol ``signal``/``shmem``/``grpc``); "" = not said, replayed as checkpointable
    (the replay's behaviour before the field existed). ``reactive``: an autoscaled
    service (``"lifecycle": "reactive"``, needs a node range): it starts at
    ``min_nodes`` and the real ``lattice_scheduler.autoscale.decide`` grows and shrinks
    it from ``load``, ((seconds after its submission, metric value), ...) a step
    function, with ``scaling`` (the submission's scaling settings; None = defaults)."""

    t: float
    id: str
    tenant: str
    nodes: int = 1
    min_nodes: int = 0
    walltime: float = 0.0
    gpu_type: str = ""
    gpus_per_node: int = 0
    memory_gb: int = 0
    features: tuple[str, ...] = ()
    topology: str = ""
    user: str = ""
    vcluster: str = ""
    preemption_class: int = 5
    sensitive: bool = False
    runtime: float | None = None
    exit: int = 0
    name: str = ""
    checkpoint: str = ""
    reactive: bool = False
    load: tuple[tuple[float, float], ...] = ()
    scaling: ScalingSpec | None = None


class CompleteEvent(msgspec.Struct, kw_only=True, frozen=True, tag="complete", tag_field="type"):
    """An allocation's completion in the captured system: its actual run time
    (``duration``, seconds) and exit status. The replay recomputes when it ends
    (start + duration, or start + walltime when the duration exceeds it); ``t`` is
    kept for reference only."""

    t: float
    id: str
    duration: float
    exit: int = 0


class CancelEvent(msgspec.Struct, kw_only=True, frozen=True, tag="cancel", tag_field="type"):
    """The user cancelled the allocation at ``t`` in the captured system, before it ever
    started there (an allocation cancelled while running has a :class:`CompleteEvent`).

    The replay applies it at ``t``, which must not be before the submission: still
    Pending then (also when requeued after a preemption), the allocation leaves the
    queue without running; already running or checkpointing in the replay (whose
    schedule differs from the live one), it is ended at ``t`` like a user's cancel of a
    running job, its nodes freed; already ended, nothing happens. Its final state is
    ``cancelled`` unless it had ended (see :mod:`rm_replay.engine`)."""

    t: float
    id: str


TraceEvent = SubmitEvent | CompleteEvent | CancelEvent


# --------------------------------------------------------------------------- inventory


class NodeClass(msgspec.Struct, kw_only=True, frozen=True):
    """``count`` identical nodes. ``groups``: the dragonfly group ids they are spread
    over (contiguously, in id order). ``conformance``: (fingerprint, share) pairs;
    nodes get fingerprints in those proportions, interleaved; empty = one fingerprint
    named after the class. ``vcluster``: home pool ("" = shared by every vCluster)."""

    name: str
    count: int
    gpu_type: str = ""
    gpus: int = 0
    cpu_cores: int = 0
    memory_gb: int = 0
    features: tuple[str, ...] = ()
    groups: tuple[int, ...] = (0,)
    conformance: tuple[tuple[str, float], ...] = ()
    vcluster: str = ""
    state: str = "Ready"
    prefix: str = ""


class TenantSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A tenant's contract. ``fair_share_target`` None = an equal part of what the
    named tenants leave over."""

    name: str
    fair_share_target: float | None = None
    burst_allowance: float = 0.0
    max_nodes: int | None = None
    max_concurrent_allocations: int | None = None
    gpu_hours_budget: float | None = None
    node_hours_budget: float | None = None


class VClusterSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A vCluster's scheduler settings (its weights come from the weights file).
    ``backfill_depth`` None = the simulation's ``backfill_depth``."""

    name: str
    scheduler_type: str = "hpc-backfill"
    backfill_depth: int | None = None
    allow_borrowing: bool = True


class Inventory(msgspec.Struct, kw_only=True, frozen=True):
    """The simulated cluster: node classes, and optionally tenants and vClusters."""

    name: str = ""
    node_classes: tuple[NodeClass, ...] = ()
    tenants: tuple[TenantSpec, ...] = ()
    vclusters: tuple[VClusterSpec, ...] = ()


# --------------------------------------------------------------------------- result

JOB_STATES = ("completed", "walltime_exceeded", "failed", "cancelled", "unfinished")


class JobRecord(msgspec.Struct, kw_only=True):
    """One allocation's replayed life.

    ``submit``: original submit time (kept across preemptions). ``start``: first time
    it got nodes (None = never). ``end``: when it finally released them (None = still
    pending or running when the replay stopped; for an allocation the trace's cancel
    event removed from the queue before it ever started: the cancel time).
    ``runtime``: the actual run time from the trace (an allocation with a cancel event
    but no complete event, inline runtime or walltime: from its submission to the
    cancel; it runs until cancelled). ``walltime``: the request (0 = none). ``state``:
    ``completed`` (exit 0), ``failed`` (non-zero exit), ``walltime_exceeded`` (killed
    at start + walltime), ``cancelled`` (by the trace's cancel event: while it held
    nodes, ``end`` = the cancel time; while Pending, ``start`` None unless a run before
    a preemption, whose release is then ``end``), ``unfinished``. ``backfilled``: its first start jumped a higher-ranked blocked
    allocation. ``gpus_per_node``: GPUs of the nodes it held (whole-node allocation),
    or of its request when it never ran. ``node_seconds`` / ``gpu_seconds``: resources
    held over all its runs (checkpointing included). ``last_start``: start of its last
    run (differs from ``start`` after a preemption)."""

    id: str
    tenant: str
    user: str
    vcluster: str
    preemption_class: int
    nodes: int
    gpus_per_node: int
    submit: float
    start: float | None
    end: float | None
    walltime: float
    runtime: float
    state: str
    backfilled: bool = False
    preempted_count: int = 0
    checkpoints_attempted: int = 0
    checkpoints_succeeded: int = 0
    sensitive: bool = False
    gpu_type: str = ""
    exit: int = 0
    last_start: float | None = None
    node_seconds: float = 0.0
    gpu_seconds: float = 0.0
    groups_spanned: int = 0
    conformance_fitness: float = 0.0
    # node-seconds of work thrown away: runs stopped by preemption without a usable
    # checkpoint (none declared, no checkpoint broker, or the checkpoint failed)
    lost_node_seconds: float = 0.0
    scale_ups: int = 0  # reactive: nodes added / released by the autoscaler
    scale_downs: int = 0


class UtilizationSample(msgspec.Struct, kw_only=True):
    """The cluster at time ``t`` (after every event at ``t``): nodes and GPUs held by
    allocations, per tenant, and the queue."""

    t: float
    busy_nodes: int
    busy_gpus: int
    total_nodes: int
    total_gpus: int
    per_tenant_busy_nodes: dict[str, int]
    pending: int = 0
    running: int = 0


class CycleStat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One scheduling cycle that ran a decision. ``pending``: queue length when it
    started; ``placed`` / ``backfilled`` / ``preempted``: what it did.
    ``duration_s``: wall time of the decision (``time.perf_counter``); machine
    dependent, so :func:`dump_result` leaves it out of ``result.json`` (it goes to
    ``timing.json``)."""

    t: float
    pending: int
    placed: int = 0
    backfilled: int = 0
    preempted: int = 0
    duration_s: float = 0.0


class SimulationResult(msgspec.Struct, kw_only=True):
    """Everything a replay produced. ``makespan``: last end minus first submit.
    ``start_time`` / ``end_time``: first event and last processed event (simulated).
    ``wall_time_s``: how long the replay took (wall clock; not in ``result.json``)."""

    policy: str
    seed: int
    trace_name: str
    inventory_summary: dict[str, Any]
    jobs: list[JobRecord]
    samples: list[UtilizationSample]
    cycles: list[CycleStat]
    makespan: float
    fair_share_targets: dict[str, float]
    sim_config: dict[str, Any]
    start_time: float = 0.0
    end_time: float = 0.0
    wall_time_s: float = 0.0


# --------------------------------------------------------------------------- files

RESULT_FILE = "result.json"
TIMING_FILE = "timing.json"

_json_encoder = msgspec.json.Encoder(order="deterministic")


def dump_result(result: SimulationResult) -> bytes:
    """``result.json``: the deterministic part of a result (no ``duration_s``, no
    ``wall_time_s``). Same trace + inventory + weights + seed -> the same bytes."""
    clean = msgspec.structs.replace(
        result,
        wall_time_s=0.0,
        cycles=[msgspec.structs.replace(c, duration_s=0.0) for c in result.cycles],
    )
    data = msgspec.to_builtins(clean, order="deterministic")
    data.pop("wall_time_s", None)
    return _json_encoder.encode(data) + b"\n"


def dump_timing(result: SimulationResult) -> bytes:
    """``timing.json``: the wall-clock figures (replay time, per-cycle decision time)."""
    durations = [c.duration_s for c in result.cycles]
    return (
        _json_encoder.encode(
            {
                "wall_time_s": result.wall_time_s,
                "cycles": len(durations),
                "cycle_duration_s": durations,
                "cycle_time_total_s": sum(durations),
            }
        )
        + b"\n"
    )


def load_result(path: str | Path) -> SimulationResult:
    """A result from ``result.json`` or from a result directory; the wall-clock figures
    come back from ``timing.json`` beside it when present."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULT_FILE
    result = msgspec.json.decode(p.read_bytes(), type=SimulationResult)
    timing = p.with_name(TIMING_FILE)
    if timing.is_file():
        t = msgspec.json.decode(timing.read_bytes())
        durations = t.get("cycle_duration_s") or []
        result.wall_time_s = float(t.get("wall_time_s") or 0.0)
        if len(durations) == len(result.cycles):
            for c, d in zip(result.cycles, durations, strict=True):
                c.duration_s = float(d)
    return result
