"""The vocabulary of Lattice as plain data.

Every process (quorum, API, scheduler, agent, CLI) speaks in these records. They are
msgspec Structs so that they are cheap to copy, encode (JSON/msgpack) and pickle into
the Raft journal. Field names are the specification's and match the proto messages in
``proto/lattice/v1`` so a record converts to its wire message through a plain dict.
"""

from __future__ import annotations

import enum

import msgspec


class AllocationState(enum.StrEnum):
    PENDING = "Pending"
    STAGING = "Staging"
    RUNNING = "Running"
    CHECKPOINTING = "Checkpointing"
    SUSPENDED = "Suspended"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    @classmethod
    def parse(cls, text: str) -> AllocationState:
        """Case-insensitive lookup (`running`, `Running`, `RUNNING`)."""
        for s in cls:
            if s.value.lower() == text.strip().lower():
                return s
        raise ValueError(text)


TERMINAL_STATES = frozenset(
    {AllocationState.COMPLETED, AllocationState.FAILED, AllocationState.CANCELLED}
)
# States in which an allocation holds nodes.
HOLDING_STATES = frozenset(
    {AllocationState.STAGING, AllocationState.RUNNING, AllocationState.CHECKPOINTING}
)


class LifecycleType(enum.StrEnum):
    BOUNDED = "bounded"
    UNBOUNDED = "unbounded"
    REACTIVE = "reactive"


class RequeuePolicy(enum.StrEnum):
    NEVER = "never"
    ON_NODE_FAILURE = "on_node_failure"
    ALWAYS = "always"


class NodeState(enum.StrEnum):
    UNKNOWN = "Unknown"
    BOOTING = "Booting"
    READY = "Ready"
    DEGRADED = "Degraded"
    DOWN = "Down"
    DRAINING = "Draining"
    DRAINED = "Drained"
    FAILED = "Failed"

    @classmethod
    def parse(cls, text: str) -> NodeState:
        for s in cls:
            if s.value.lower() == text.strip().lower():
                return s
        raise ValueError(text)


class SchedulerType(enum.StrEnum):
    HPC_BACKFILL = "hpc-backfill"
    SERVICE_BINPACK = "service-binpack"
    SENSITIVE_RESERVATION = "sensitive-reservation"
    INTERACTIVE_FIFO = "interactive-fifo"


class CostWeights(msgspec.Struct, kw_only=True):
    """w1..w9 of Score(j) = sum w_i * f_i(j). Default is the specification's balanced HPC baseline."""

    priority: float = 0.20
    wait_time: float = 0.20
    fair_share: float = 0.20
    topology: float = 0.15
    data_readiness: float = 0.10
    backlog: float = 0.05
    energy: float = 0.00
    checkpoint_efficiency: float = 0.00
    conformance: float = 0.10


WEIGHT_ALIASES: dict[str, str] = {
    "checkpoint": "checkpoint_efficiency",  # the Performance Tuning Guide's YAML
    "data_ready": "data_readiness",  # the Weight Profiles table's w5
}
"""Other spellings of CostWeights field names that readers accept (weight files,
profiles); writers always emit the field names themselves."""


class Constraints(msgspec.Struct, kw_only=True):
    gpu_type: str = ""
    gpu_count: int = 0
    features: list[str] = msgspec.field(default_factory=list)
    memory_gb: int = 0
    topology: str = ""  # "tight" | "any" | ""


NEVER_PREEMPTED_CLASS = 10
"""Preemption class of sensitive and critical work: never a preemption victim."""


class Dependency(msgspec.Struct, frozen=True):
    """One incoming dependency edge (proto ``Dependency``): run after ``ref`` ends in a way
    ``condition`` accepts (success | failure | any | corresponding | mutex; see
    lattice_common.dag). Inside a DAG ``ref`` is a member's DAG-local id; for ``mutex``
    it is the mutex name."""

    ref: str
    condition: str = "success"


class DagEdge(msgspec.Struct, frozen=True):
    """One edge of a stored DAG (proto ``DagEdge``), between DAG-local ids."""

    upstream: str
    downstream: str
    condition: str


class Dag(msgspec.Struct, kw_only=True, dict=True):
    """A workflow of allocations submitted as one unit. Its members are ordinary
    allocations tagged with ``dag_id``/``dag_ref``; dependency resolution runs in the
    quorum's apply when a member ends (lattice_quorum.handlers.dags)."""

    id: str
    name: str = ""
    tenant: str = ""
    user: str = ""
    # ref -> allocation id; a task-group member has one entry per index, "ref[i]"
    members: dict[str, str] = msgspec.field(default_factory=dict)
    edges: list[DagEdge] = msgspec.field(default_factory=list)
    task_groups: dict[str, str] = msgspec.field(default_factory=dict)  # ref -> its range
    state: str = "Running"  # Running | Completed | Failed | Cancelled
    submitted_at: float = 0.0
    finished_at: float | None = None
    cancel_requested: bool = False
    revision: int = 0


class Session(msgspec.Struct, kw_only=True):
    """An interactive session: an allocation whose user works in it through a terminal
    (``lattice session``, then ``lattice attach``). Raft-committed, so its limits hold
    across API members and restarts (spec: Interactive Sessions)."""

    id: str
    allocation_id: str
    tenant: str = ""
    user: str = ""
    created_at: float = 0.0
    ended_at: float | None = None
    revision: int = 0


PROBE_TYPES = ("tcp", "http")


class LivenessProbeSpec(msgspec.Struct, kw_only=True):
    """A liveness check of a service allocation, run by the agent of its head node (spec:
    API Design, Liveness Probe Schema; Failure Modes, Service Failure Detection).
    ``failure_threshold`` consecutive failures end the allocation Failed with reason
    ``liveness_probe_failed``; it is then requeued per its requeue policy."""

    probe_type: str = "tcp"  # "tcp" (connect) | "http" (GET path; 2xx/3xx is alive)
    port: int = 0  # 1-65535
    path: str = "/"  # HTTP path
    period_secs: int = 30
    initial_delay_secs: int = 10
    failure_threshold: int = 3
    timeout_secs: int = 5


class ExposedPort(msgspec.Struct, kw_only=True):
    """A named port a service allocation exposes (spec: ``connectivity.expose``). While
    the allocation runs, each (name, node, port) is an endpoint in the service
    registry."""

    name: str
    port: int
    protocol: str = ""  # e.g. "http", "grpc"; "" = unspecified


class ServiceEndpoint(msgspec.Struct, kw_only=True):
    """One registered endpoint of a named service (proto ``ServiceEndpoint``)."""

    allocation_id: str
    node_id: str
    address: str = ""  # the node's hostname
    port: int = 0
    tenant: str = ""


CHECKPOINT_MODES = ("auto", "manual", "none")
"""``checkpoint`` of a submission (spec: Checkpointing): auto = the scheduler/broker
decides when, manual = the application manages it (preemption still asks it through
its protocol), none = non-checkpointable (preemption is SIGTERM, grace, SIGKILL)."""
CHECKPOINT_PROTOCOLS = ("signal", "shmem", "grpc")
"""How the node agent asks an application to checkpoint (spec: Application Protocol)."""


class CheckpointRecord(msgspec.Struct, kw_only=True):
    """A completed checkpoint of an allocation: where it is and what it cost. Written by
    the quorum when a Checkpointing allocation becomes Suspended; the next run gets it
    as LATTICE_CHECKPOINT_PATH (with LATTICE_RESUME=1)."""

    id: str
    path: str  # {checkpoint_root}/{tenant}/{project}/{alloc}/checkpoints/{id}/
    size_bytes: int = 0
    duration_seconds: float = 0.0  # from the request to the application's completion
    at: float = 0.0  # when it completed


class CheckpointHint(msgspec.Struct, kw_only=True):
    """A checkpoint hint of the checkpoint broker on a Running allocation: "checkpoint
    and continue" (the application keeps running), unlike preemption's
    checkpoint-then-suspend. Recorded through the quorum so a restarted broker sees it:
    outstanding while ``done_at`` is None in the run it was issued in; the head node's
    agent runs the protocol and reports the outcome (``outcome`` "ok" with the
    checkpoint in ``last_checkpoint``, or why it failed). ``epoch`` is the allocation's ``checkpoint_hints`` it was issued as."""

    id: str
    epoch: int
    at: float
    run: int = 0  # the run it was issued in (requeue_count + preempted_count)
    reason: str = ""  # the cost model's deciding term, e.g. recompute_saved
    done_at: float | None = None
    outcome: str = ""  # ok | checkpoint_timeout | checkpoint_failed: ... | stopped


SCALE_UP = "up"
SCALE_DOWN = "down"
SCALE_HOLD = "hold"


class ScalingSpec(msgspec.Struct, kw_only=True):
    """How a reactive allocation scales (spec: Autoscaling, Reactive Lifecycle). Its node
    bounds are the allocation's node range: ``min_nodes`` .. ``nodes`` (= max_nodes). Up
    one node when ``metric`` stays at or above ``target`` for ``scale_up_window``
    seconds; down one when it stays at or below ``target * scale_down_threshold`` for
    ``scale_down_window``; nothing for ``cooldown`` seconds after a scale event. The
    metric is evaluated every ``evaluation_interval`` seconds. Defaults: the
    specification's Configuration Defaults table."""

    metric: str = "cpu_utilization"  # a catalog name or a custom `name{label="v"}`
    target: float = 0.8
    evaluation_interval: float = 60.0
    scale_up_window: float = 120.0
    scale_down_window: float = 300.0
    scale_down_threshold: float = 0.5  # fraction of target
    cooldown: float = 180.0


class ScalingStatus(msgspec.Struct, kw_only=True):
    """What the autoscaler last decided for a reactive allocation (written by the
    scheduler through the quorum). ``last_decision``/``reason``/``at``: the last scale
    event (up/down); ``target``: the node count it is moving to (the current count when
    settled); ``blocked``: why a wanted scale-up does not happen now (tenant quota, no
    free node, backoff, metric unavailable), "" when nothing holds it back."""

    target: int = 0
    last_decision: str = ""  # up | down | "" (never scaled)
    reason: str = ""
    at: float | None = None
    blocked: str = ""
    # a scale-down waiting for the application's checkpoint (spec: Reactive Allocation
    # Checkpointing): the nodes it will release, when the head node's agent was asked
    # to checkpoint, and when the release goes ahead without it
    releasing: list[str] = msgspec.field(default_factory=list)
    release_at: float | None = None
    release_by: float | None = None


class AllocationSpec(msgspec.Struct, kw_only=True):
    """What a user asks for. Validated by the API before anything is stored."""

    entrypoint: str
    tenant: str
    vcluster: str
    nodes: int = 1
    walltime_seconds: int = 0  # 0 = none (only for unbounded/reactive)
    lifecycle: LifecycleType = LifecycleType.BOUNDED
    preemption_class: int = 5
    name: str = ""
    project: str = ""
    user: str = ""
    constraints: Constraints = msgspec.field(default_factory=Constraints)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    submit_dir: str = ""
    uenv: str = ""
    requeue_policy: RequeuePolicy = RequeuePolicy.ON_NODE_FAILURE
    max_requeue: int = 3
    tags: dict[str, str] = msgspec.field(default_factory=dict)
    request_id: str = ""  # client idempotency key
    min_nodes: int = 0  # node range {min_nodes, nodes} (services); 0 = exactly `nodes`
    # accept even when the vCluster cannot offer the nodes or constraints (yet): the
    # allocation waits for capacity instead of being refused at submit
    wait_for_capacity: bool = False
    depends_on: list[Dependency] = msgspec.field(default_factory=list)
    liveness_probe: LivenessProbeSpec | None = None  # services (unbounded/reactive)
    expose: list[ExposedPort] = msgspec.field(default_factory=list)  # connectivity.expose
    view: str = ""  # environment.view: a uenv view (its environment variables)
    image: str = ""  # environment.image: OCI image registry/name:tag
    checkpoint: str = "none"  # auto | manual | none (CHECKPOINT_MODES)
    checkpoint_protocol: str = ""  # signal | shmem | grpc; "" = none (CHECKPOINT_PROTOCOLS)
    scaling: ScalingSpec | None = None  # reactive allocations: metric, target, windows

    @property
    def checkpointable(self) -> bool:
        """The agent can ask it to checkpoint: not ``none`` and a protocol named."""
        return self.checkpoint != "none" and bool(self.checkpoint_protocol)


class Allocation(msgspec.Struct, kw_only=True):
    id: str
    spec: AllocationSpec
    state: AllocationState = AllocationState.PENDING
    assigned_nodes: list[str] = msgspec.field(default_factory=list)
    submitted_at: float = 0.0  # original submit time, kept across requeues
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    reason: str = ""  # e.g. walltime_exceeded, cancelled, node_failure
    requeue_count: int = 0
    preempted_count: int = 0
    preempted_by: str = ""  # pending allocation this one is being preempted for
    resume_from_checkpoint: bool = False  # set when requeued after preemption
    checkpoint_hint_at: float | None = None  # when preemption asked it to checkpoint
    task_group_id: str = ""  # task group (job array) this is one task of
    task_index: int | None = None
    task_group_concurrency: int = 0  # at most this many tasks of the group run at once
    pending_reason: str = ""  # the scheduler's last word on why it is still Pending
    estimated_start: float | None = None  # the scheduler's estimate (Pending only)
    estimate_basis: str = ""  # now | reservation | simulation ("" = no estimate)
    dag_id: str = ""  # the DAG it belongs to, "" when submitted alone
    dag_ref: str = ""  # its DAG-local id
    held: bool = False  # Pending but waiting for its dependencies (not in any queue)
    staged_nodes: list[str] = msgspec.field(default_factory=list)  # Staging: prologue done
    excluded_nodes: list[str] = msgspec.field(default_factory=list)  # its prologue failed there
    prologue_failures: int = 0
    uenv_sha256: str = ""  # resolved by the API at submit
    image_digest: str = ""  # sha256:... recorded by the prologue
    peak_memory_bytes: int | None = None  # the cgroup's peak on the head node, once ended
    revision: int = 0  # GlobalState revision of the last change
    # the last usable checkpoint (set on Suspended); its next run resumes from it
    last_checkpoint: CheckpointRecord | None = None
    scaling_status: ScalingStatus | None = None  # reactive: the autoscaler's last word
    # the checkpoint broker: its last hint, how many it issued, and its estimate of
    # this allocation's checkpoint time (the scheduler's f8 reads it)
    checkpoint_hint: CheckpointHint | None = None
    checkpoint_hints: int = 0
    checkpoint_minutes: float | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


ESTIMATE_NOW = "now"  # it is being started this cycle
ESTIMATE_RESERVATION = "reservation"  # the backfill reservation made for it
ESTIMATE_SIMULATION = "simulation"  # a forward simulation of the queue


class StartEstimate(msgspec.Struct, kw_only=True):
    """When and where a pending (or test-only) allocation is expected to start.
    ``estimated_start`` None: not within the estimate's horizon."""

    estimated_start: float | None = None
    estimate_basis: str = ""
    nodes: int = 0
    node_ids: list[str] = msgspec.field(default_factory=list)
    position: int = 0
    pending_reason: str = ""


class GpuLinkType(enum.StrEnum):
    """GPU Topology: vendor-neutral GPU-to-GPU link kinds."""

    NVLINK = "NvLink"
    NVSWITCH = "NvSwitch"
    INFINITY_FABRIC = "InfinityFabric"
    XGMI = "Xgmi"
    PCIE = "Pcie"


class MemoryDomainType(enum.StrEnum):
    """Memory Topology: what kind of memory a domain is."""

    DRAM = "Dram"
    HBM = "Hbm"
    CXL_ATTACHED = "CxlAttached"
    UNIFIED = "Unified"


class MemoryLinkType(enum.StrEnum):
    NUMA_LINK = "NumaLink"
    CXL_SWITCH = "CxlSwitch"
    COHERENT_FABRIC = "CoherentFabric"


class GpuDevice(msgspec.Struct, kw_only=True):
    """One GPU as its node agent discovered it (spec: GPU Topology, GpuDevice)."""

    index: int
    vendor: str = ""  # "Nvidia" | "Amd"
    model: str = ""  # "H100", "MI300X"
    memory_bytes: int = 0
    compute_capability: str = ""  # CUDA CC ("9.0") or GCN/CDNA arch ("gfx942")
    numa_node: int | None = None  # NUMA node with local access (CPU affinity)
    nic_affinity: str = ""  # the NIC closest to this GPU, "" when unknown


class GpuLink(msgspec.Struct, kw_only=True):
    """The connection between two GPUs of a node; ``bandwidth_gbps`` in GB/s, as the
    spec's tables give it (NVSwitch H100 900, PCIe Gen5 64)."""

    gpu_a: int
    gpu_b: int
    link_type: GpuLinkType = GpuLinkType.PCIE
    bandwidth_gbps: float = 0.0


class MemoryDomain(msgspec.Struct, kw_only=True):
    """A memory domain (spec: Memory Topology). CPUs travel as a Linux cpulist
    ("0-71,144-215") to keep node records small."""

    id: int
    domain_type: MemoryDomainType = MemoryDomainType.DRAM
    capacity_bytes: int = 0
    numa_node: int | None = None  # Linux NUMA node id, if applicable
    cpulist: str = ""  # CPUs with local access, Linux list format
    cpu_count: int = 0
    attached_gpus: list[int] = msgspec.field(default_factory=list)  # local/coherent GPUs


class MemoryInterconnect(msgspec.Struct, kw_only=True):
    """A link between two memory domains. ``distance`` is the firmware's relative NUMA
    distance (10 = local); ``bandwidth_gbps`` 0 when not known."""

    domain_a: int
    domain_b: int
    link_type: MemoryLinkType = MemoryLinkType.NUMA_LINK
    distance: int = 0
    bandwidth_gbps: float = 0.0


def claimant(a: Allocation) -> str:
    """Who a sensitive allocation claims its nodes for: the submitting user."""
    return a.spec.user or a.spec.tenant


class NodeCapabilities(msgspec.Struct, kw_only=True):
    cpu_cores: int = 0
    memory_gb: int = 0
    gpu_type: str = ""
    gpu_count: int = 0
    features: list[str] = msgspec.field(default_factory=list)
    # Intra-node topology reported by the agent (empty: not reported / no GPUs)
    gpus: list[GpuDevice] = msgspec.field(default_factory=list)
    gpu_links: list[GpuLink] = msgspec.field(default_factory=list)
    memory_domains: list[MemoryDomain] = msgspec.field(default_factory=list)
    memory_interconnects: list[MemoryInterconnect] = msgspec.field(default_factory=list)
    unified_memory: bool = False  # a Unified CPU-GPU memory domain (GH200, MI300A)
    cxl_memory_gb: int = 0  # CXL-attached (memory-only, no CPUs) capacity


class Node(msgspec.Struct, kw_only=True):
    id: str
    hostname: str = ""
    state: NodeState = NodeState.UNKNOWN
    capabilities: NodeCapabilities = msgspec.field(default_factory=NodeCapabilities)
    group: int = 0  # dragonfly topology group
    conformance_group: str = ""
    agent_address: str = ""  # host:port of the agent's NodeAgentService
    owner: str = ""  # allocation id holding the node, "" when free
    owner_tenant: str = ""
    owner_vcluster: str = ""
    home_vcluster: str = ""
    disabled: bool = False
    drain_requested: bool = False  # operator drain, kept across Down and re-registration
    # Conformance baseline: the fingerprint the node first registered with (or an
    # operator accepted by undrain); conformance_group is the last reported one.
    expected_conformance: str = ""
    conformance_drift: bool = False  # reported fingerprint differs from the baseline
    claimed_by: str = ""  # user holding a sensitive claim on the node ("" = unclaimed)
    claimed_at: float | None = None
    state_reason: str = ""
    registered_at: float = 0.0
    revision: int = 0
    # How the node's agent authenticated at its last call (spiffe, quorum-ca, bootstrap,
    # token, none), as the API member answering a read saw it: filled on reads from
    # that member's memory, never by a command
    agent_identity: str = ""
    # Telemetry collectors its agent reported at its last heartbeat (ebpf, proc, nvml),
    # filled on reads like agent_identity
    telemetry: str = ""
    # The allocation the scheduler queued to take the node when its owner ends, handed
    # over in the commit that ends it (SetNextAllocations; lattice_quorum.handlers.handoff)
    next_allocation: str = ""

    @property
    def schedulable(self) -> bool:
        return self.state == NodeState.READY and not self.owner

    @property
    def claimed(self) -> bool:
        return bool(self.claimed_by)


class LedgerDay(msgspec.Struct, kw_only=True):
    """One UTC day of a tenant's retired usage (``Tenant.retired_usage``): what its
    allocations that left the state (lattice_quorum.handlers.retention) ran that day."""

    node_seconds: float = 0.0
    gpu_seconds: float = 0.0
    allocations: int = 0  # retired allocations that ended that day


class Tenant(msgspec.Struct, kw_only=True):
    name: str
    max_nodes: int | None = None  # hard
    max_concurrent_allocations: int | None = None  # hard
    fair_share_target: float = 0.0  # soft
    burst_allowance: float = 0.0  # soft
    gpu_hours_budget: float | None = None  # soft
    node_hours_budget: float | None = None  # soft
    isolation: str = "standard"  # standard | strict (sensitive)
    # the highest preemption class its users may ask for (the tenant's contract); None = any
    max_preemption_class: int | None = None
    created_at: float = 0.0
    revision: int = 0
    # The internal budget ledger's share of allocations that left the state, by UTC day
    # number (lattice_common.ledger.retire): the budget penalty reads these totals
    # instead of keeping the allocations for the whole budget period
    retired_usage: dict[int, LedgerDay] = msgspec.field(default_factory=dict)


class VCluster(msgspec.Struct, kw_only=True):
    name: str
    scheduler_type: SchedulerType = SchedulerType.HPC_BACKFILL
    tenant: str = ""  # "" = shared by all tenants
    weights: CostWeights = msgspec.field(default_factory=CostWeights)
    cycle_interval_seconds: float = 5.0
    backfill_depth: int = 10
    allow_borrowing: bool = True
    # owners may suspend their own checkpointable allocations (lattice suspend)
    allow_user_suspend: bool = True
    created_at: float = 0.0
    revision: int = 0


PHASE_STAGED = "staged"  # the node's prologue for a Staging allocation is done
PHASE_PROLOGUE_FAILED = "prologue_failed"  # ... failed; ``reason`` says why
PHASE_CHECKPOINTING = "checkpointing"  # the agent is running the checkpoint protocol
PHASE_CHECKPOINTED = "checkpointed"  # done and the processes stopped: checkpoint_* fields
PHASE_CHECKPOINT_FAILED = "checkpoint_failed"  # ... failed (``reason``); processes stopped


class AllocationReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What an agent reports about one allocation it runs (actual state)."""

    allocation_id: str
    phase: str  # "running" | "exited" | "staged" | "prologue_failed" (PHASE_*)
    pid: int = 0
    exit_code: int | None = None
    reason: str = ""
    started_at: float | None = None
    finished_at: float | None = None
    peak_memory_bytes: int | None = None  # the allocation cgroup's peak, once exited
    attempt: int = 0  # staged/prologue_failed: the allocation's prologue_failures it ran for
    image_digest: str = ""  # staged: the OCI image's digest pulled by the prologue
    checkpoint_id: str = ""  # checkpointed: the checkpoint's id, path, size and duration
    checkpoint_path: str = ""
    checkpoint_size_bytes: int = 0
    checkpoint_duration_seconds: float = 0.0
    # running with a broker hint's checkpoint done or failed (checkpoint_* or reason);
    # the processes keep running
    hint_id: str = ""
