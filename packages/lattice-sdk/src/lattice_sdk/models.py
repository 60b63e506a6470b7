"""Plain dataclasses for what the REST API sends and receives.

Each record has ``from_dict`` that ignores keys it does not know (so a newer server never
breaks an older SDK) and keeps the server's dict on ``.raw`` (so nothing is lost, and the
CLI can print the exact JSON). Field names follow the specification and the JSON contract.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

TERMINAL_STATES = frozenset({"Completed", "Failed", "Cancelled"})


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = cls._field_names  # type: ignore[attr-defined]
    return {k: v for k, v in data.items() if k in names and k != "raw"}


class _Record:
    """Shared helpers; subclasses are dataclasses with a ``raw`` field."""

    _field_names: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None):
        """Build from a JSON object, ignoring unknown keys and keeping it on ``.raw``."""
        data = dict(data or {})
        if "_field_names" not in cls.__dict__:  # computed once per class
            cls._field_names = frozenset(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        obj = cls(**_known(cls, data))
        obj.raw = data  # type: ignore[attr-defined]
        return obj

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name == "raw":
                continue
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, _Record) else value
        return out


@dataclass
class AllocationSpec(_Record):
    """What to run and what it needs. ``walltime`` is a human duration ("24h", "1:30:00");
    the server parses it and reports it back as ``walltime_seconds``.

    ``request_id`` is the idempotency key: :meth:`LatticeClient.submit` fills it with a
    random uuid4 hex when empty, and keeps it on the object, so resubmitting the same
    spec after a timeout does not create a second allocation.
    """

    entrypoint: str = ""
    nodes: int = 1
    walltime: str | None = None
    tenant: str = ""
    vcluster: str = ""
    name: str = ""
    project: str = ""
    preemption_class: int = 5
    lifecycle: str = "bounded"
    constraints: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    submit_dir: str = ""
    uenv: str = ""
    view: str = ""  # a view of the uenv to activate (its environment variables)
    image: str = ""  # OCI image registry/name:tag to run in
    requeue_policy: str | None = None
    max_requeue: int | None = None
    tags: dict[str, str] = field(default_factory=dict)
    request_id: str = ""
    user: str = ""
    walltime_seconds: int | None = None
    min_nodes: int | None = None  # node range {min_nodes, nodes} (services)
    # accept even if the vCluster cannot offer the nodes/constraints yet, and wait
    wait_for_capacity: bool = False
    # run after other allocations: [{"ref": ID, "condition": "success"|"failure"|"any"}]
    depends_on: list[dict[str, str]] = field(default_factory=list)
    # services: {"probe_type": "http"|"tcp", "port", "path", "period_secs",
    # "initial_delay_secs", "failure_threshold", "timeout_secs"}
    liveness_probe: dict[str, Any] | None = None
    # named ports registered in the service registry while it runs: [{"name", "port"}]
    expose: list[dict[str, Any]] = field(default_factory=list)
    # lifecycle "reactive": {"metric", "target", "evaluation_interval", "scale_up_window",
    # "scale_down_window", "scale_down_threshold", "cooldown"}; bounds are min_nodes..nodes
    scaling: dict[str, Any] | None = None
    # checkpoints: "auto" | "manual" | "none" ("" = the server's default: none, or auto
    # with a protocol) and how the agent asks: "signal" | "shmem" | "grpc"
    checkpoint: str = ""
    checkpoint_protocol: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A server may send null for an empty map; keep the attributes usable.
        self.constraints = dict(self.constraints or {})
        self.env = dict(self.env or {})
        self.tags = dict(self.tags or {})

    def to_dict(self) -> dict[str, Any]:
        """The POST body: always entrypoint, nodes, preemption_class and lifecycle; other
        fields only when set, so the server applies its own defaults."""
        body: dict[str, Any] = {
            "entrypoint": self.entrypoint,
            "nodes": self.nodes,
            "preemption_class": self.preemption_class,
            "lifecycle": self.lifecycle,
        }
        optional = {
            "walltime": self.walltime,
            "tenant": self.tenant,
            "vcluster": self.vcluster,
            "name": self.name,
            "project": self.project,
            "constraints": {k: v for k, v in self.constraints.items() if v not in (None, "", [])},
            "env": self.env,
            "submit_dir": self.submit_dir,
            "uenv": self.uenv,
            "view": self.view,
            "image": self.image,
            "requeue_policy": self.requeue_policy,
            "max_requeue": self.max_requeue,
            "tags": self.tags,
            "request_id": self.request_id,
            "user": self.user,
            "min_nodes": self.min_nodes,
            "wait_for_capacity": self.wait_for_capacity or None,
            "depends_on": [dict(d) for d in self.depends_on or []],
            "liveness_probe": dict(self.liveness_probe) if self.liveness_probe else None,
            "expose": [dict(e) for e in self.expose or []],
            "scaling": dict(self.scaling) if self.scaling else None,
            "checkpoint": self.checkpoint,
            "checkpoint_protocol": self.checkpoint_protocol,
        }
        if not self.walltime and self.walltime_seconds:
            optional["walltime_seconds"] = self.walltime_seconds
        for key, value in optional.items():
            if value is None or value == "" or value == {} or value == []:
                continue
            body[key] = value
        return body


@dataclass
class Allocation(_Record):
    """An allocation as the quorum knows it. ``state`` is one of Pending, Staging, Running,
    Checkpointing, Suspended, Completed, Failed, Cancelled."""

    id: str = ""
    spec: AllocationSpec = field(default_factory=AllocationSpec)
    state: str = "Pending"
    assigned_nodes: list[str] = field(default_factory=list)
    submitted_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    reason: str = ""
    requeue_count: int = 0
    preempted_count: int = 0
    pending_reason: str = ""  # why it is still Pending, with numbers
    estimated_start: float | None = None  # the scheduler's estimate (Pending only)
    estimate_basis: str = ""  # now | reservation | simulation
    revision: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.spec, dict):
            self.spec = AllocationSpec.from_dict(self.spec)
        elif self.spec is None:
            self.spec = AllocationSpec()
        if self.assigned_nodes is None:
            self.assigned_nodes = []

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def terminal(self) -> bool:
        """True once the allocation is Completed, Failed or Cancelled."""
        return self.state in TERMINAL_STATES


@dataclass
class StartEstimate(_Record):
    """When and where an allocation would start (a test-only submission's answer).
    ``estimated_start`` None: not within the estimate's horizon."""

    estimated_start: float | None = None
    estimate_basis: str = ""  # now | reservation | simulation
    nodes: int = 0
    node_ids: list[str] = field(default_factory=list)
    position: int = 0  # place in the vCluster's queue, 1 = first
    pending_reason: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class QueueEntry(_Record):
    """One pending allocation of a vCluster's queue, in the order the scheduler
    considers them: its score and weighted factors, why it waits, its reservation and
    its estimated start."""

    position: int = 0
    allocation: Allocation = field(default_factory=Allocation)
    score: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    pending_reason: str = ""
    reserved_start: float | None = None
    reserved_nodes: list[str] = field(default_factory=list)
    estimated_start: float | None = None
    estimate_basis: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.allocation, dict):
            self.allocation = Allocation.from_dict(self.allocation)


@dataclass
class NodeCapabilities(_Record):
    cpu_cores: int = 0
    memory_gb: int = 0
    gpu_type: str = ""
    gpu_count: int = 0
    features: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class Node(_Record):
    """A compute node: identity, capabilities, topology group, owner and admin state."""

    id: str = ""
    hostname: str = ""
    state: str = "Unknown"
    capabilities: NodeCapabilities = field(default_factory=NodeCapabilities)
    group: int = 0
    conformance_group: str = ""
    owner: str = ""
    owner_tenant: str = ""
    owner_vcluster: str = ""
    home_vcluster: str = ""
    state_reason: str = ""
    disabled: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.capabilities, dict):
            self.capabilities = NodeCapabilities.from_dict(self.capabilities)
        elif self.capabilities is None:
            self.capabilities = NodeCapabilities()


@dataclass
class Tenant(_Record):
    """A tenant with its hard quotas (max_nodes, max_concurrent_allocations) and soft
    targets (fair share, burst, budgets)."""

    name: str = ""
    max_nodes: int | None = None
    max_concurrent_allocations: int | None = None
    fair_share_target: float | None = None
    burst_allowance: float | None = None
    gpu_hours_budget: float | None = None
    node_hours_budget: float | None = None
    isolation: str = ""
    max_preemption_class: int | None = None  # highest class its users may submit with
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class VCluster(_Record):
    """A vCluster: a scheduler type, an optional owning tenant and cost-function weights."""

    name: str = ""
    scheduler_type: str = ""
    tenant: str = ""
    weights: dict[str, float] = field(default_factory=dict)
    cycle_interval_seconds: float | None = None
    backfill_depth: int | None = None
    allow_borrowing: bool | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class LogLine(_Record):
    """One line of an allocation's output. ``message`` is the line without its newline,
    ``stream`` is ``stdout`` or ``stderr``. ``timestamp`` is whatever the server sent
    (epoch seconds or an ISO 8601 string)."""

    message: str = ""
    stream: str = "stdout"
    node_id: str = ""
    timestamp: float | str | None = None
    allocation_id: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> LogLine:
        data = dict(data or {})
        message = data.get("line", data.get("message", ""))
        obj = cls(
            message=str(message).rstrip("\r\n") if message is not None else "",
            stream=str(data.get("stream") or "stdout"),
            node_id=str(data.get("node_id") or ""),
            timestamp=data.get("timestamp"),
            allocation_id=str(data.get("allocation_id") or ""),
        )
        obj.raw = data
        return obj


class LogLines(list[LogLine]):
    """What :meth:`LatticeClient.logs` returns: a list of :class:`LogLine`, with
    ``truncated`` true when the request's ``limit`` cut lines off (more follow)."""

    truncated: bool = False


@dataclass
class AllocationEvent(_Record):
    """One change seen by :meth:`LatticeClient.watch`: the allocation after the change and
    the state revision that produced it."""

    state: str = ""
    allocation: Allocation = field(default_factory=Allocation)
    revision: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AllocationEvent:
        data = dict(data or {})
        alloc = Allocation.from_dict(data.get("allocation") or {})
        revision = data.get("revision")
        if revision is None:
            revision = alloc.revision
        obj = cls(state=str(data.get("state") or alloc.state), allocation=alloc, revision=revision)
        obj.raw = data
        return obj
