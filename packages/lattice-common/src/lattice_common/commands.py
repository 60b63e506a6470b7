"""Commands: the only way GlobalState changes.

A command is a small tagged record. Proposers (API, schedulers, the leader's node
monitor) build one, the quorum replicates its encoded bytes through Raft, and every
member applies it with the same pure function. Timestamps travel inside the command
(``now``) because apply may never read a clock.
"""

from __future__ import annotations

from typing import Any

import msgspec

from lattice_common.audit import AuditEntry
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    CheckpointHint,
    CheckpointRecord,
    CostWeights,
    Dag,
    Node,
    NodeCapabilities,
    NodeState,
    ScalingStatus,
    SchedulerType,
    Session,
    StartEstimate,
    Tenant,
    VCluster,
)


class Command(msgspec.Struct, tag_field="kind", kw_only=True):
    now: float = 0.0


class RegisterNode(Command, tag="register_node"):
    node_id: str
    hostname: str = ""
    capabilities: NodeCapabilities = msgspec.field(default_factory=NodeCapabilities)
    group: int = 0
    conformance_group: str = ""
    agent_address: str = ""
    home_vcluster: str = ""


class ReportConformance(Command, tag="report_conformance"):
    """An agent's conformance fingerprint changed (spec: Node Conformance). It becomes
    the node's conformance_group; one that differs from the node's baseline
    (expected_conformance) marks the node drifted, one that matches clears the drift.
    Running work is never touched."""

    node_id: str
    fingerprint: str


class SubmitAllocation(Command, tag="submit_allocation"):
    spec: AllocationSpec
    uenv_sha256: str = ""  # the image spec.uenv resolved to at submit (the API)


class SubmitTaskGroup(Command, tag="submit_task_group"):
    """A task group (job array): one allocation per index in range(start, end + 1, step),
    each with LATTICE_TASK_INDEX set and ``${INDEX}`` in the entrypoint replaced."""

    spec: AllocationSpec
    start: int
    end: int
    step: int = 1
    concurrency: int = 0
    uenv_sha256: str = ""  # the image spec.uenv resolved to at submit (the API)


class DagMemberSubmission(msgspec.Struct, kw_only=True):
    """One member of a DAG submission: its DAG-local id and its allocation (whose
    ``depends_on`` names other members' refs)."""

    ref: str
    spec: AllocationSpec
    task_group: str = ""  # START-END[:STEP][%N]: a job array, one allocation per index
    uenv_sha256: str = ""  # the image spec.uenv resolved to at submit (the API)


class SubmitDag(Command, tag="submit_dag"):
    """A workflow as one unit: every member becomes an allocation tagged with the DAG;
    members with dependencies are held until the quorum releases them (or cancels them)
    as their predecessors end. Rejected as a whole when the graph is invalid."""

    name: str
    members: list[DagMemberSubmission]
    request_id: str = ""
    max_size: int = 1000


class CancelDag(Command, tag="cancel_dag"):
    """Cancel every member of a DAG that has not ended."""

    dag_id: str
    reason: str = "DAG cancelled"


class CreateSession(Command, tag="create_session"):
    """An interactive session: its allocation is submitted with it (one command)."""

    spec: AllocationSpec
    uenv_sha256: str = ""  # the image spec.uenv resolved to at submit (the API)


class DeleteSession(Command, tag="delete_session"):
    """End a session: its allocation is cancelled if it has not ended."""

    session_id: str
    reason: str = "session ended"


class AssignNodes(Command, tag="assign_nodes"):
    """Give ``node_ids`` exclusively to a pending allocation.

    ``expected_revision`` is the GlobalState revision the scheduler decided on: the
    command is rejected if the allocation or any chosen node changed after it.
    """

    allocation_id: str
    node_ids: list[str]
    expected_revision: int = 0
    vcluster: str = ""


class SetNextAllocations(Command, tag="set_next_allocations"):
    """Queue, per busy node, the pending one-node allocation that takes it when the
    allocation holding it ends: the node is handed over in the commit that ends its
    owner, so a short job's successor starts without a scheduling round trip (node id
    -> allocation id; "" clears). Proposed by schedulers from their reservations; the
    hand-over re-checks everything an assignment checks and skips a stale entry."""

    next: dict[str, str]
    vcluster: str = ""


class ReleaseNodeClaim(Command, tag="release_node_claim"):
    """End a sensitive claim on an idle node. ``user``: who asks (must be the claiming
    user unless ``admin``)."""

    node_id: str
    user: str = ""
    admin: bool = False


class ScaleAllocation(Command, tag="scale_allocation"):
    """Grow (``add_node_ids``) or shrink (``remove_node_ids``) a running allocation
    with a node range {min_nodes, nodes}; the result stays within the range."""

    allocation_id: str
    add_node_ids: list[str] = msgspec.field(default_factory=list)
    remove_node_ids: list[str] = msgspec.field(default_factory=list)
    expected_revision: int = 0
    vcluster: str = ""
    # the autoscaler's decision, recorded with the change (reactive allocations)
    status: ScalingStatus | None = None


class SetScalingStatus(Command, tag="set_scaling_status"):
    """The autoscaler's word on reactive allocations it did not scale (why a wanted
    scale-up is blocked, or that it no longer is); only changes are sent."""

    statuses: dict[str, ScalingStatus] = msgspec.field(default_factory=dict)


class UpdateAllocationState(Command, tag="update_allocation_state"):
    allocation_id: str
    state: AllocationState
    reason: str = ""
    exit_code: int | None = None
    started_at: float | None = None
    finished_at: float | None = None
    peak_memory_bytes: int | None = None  # the head node's cgroup peak, with the end


class SetPendingReasons(Command, tag="set_pending_reasons"):
    """The scheduler's reasons for allocations it could not start and its start
    estimates (only changes are sent; an estimate without ``estimated_start`` clears it)."""

    reasons: dict[str, str] = msgspec.field(default_factory=dict)
    estimates: dict[str, StartEstimate] = msgspec.field(default_factory=dict)


class CancelAllocation(Command, tag="cancel_allocation"):
    allocation_id: str
    reason: str = "cancelled"
    requested_by: str = ""


class RequeueAllocation(Command, tag="requeue_allocation"):
    """Back to Pending, keeping the original submit time. ``preempted`` requeues count
    in preempted_count (and set the resume flag) instead of requeue_count."""

    allocation_id: str
    reason: str
    expected_requeue_count: int | None = None
    preempted: bool = False


class ReportPrologue(Command, tag="report_prologue"):
    """A node's prologue for a Staging allocation is done (``ok``) or failed (``reason``
    says why). Every assigned node done -> Running; a failure excludes the node for
    this allocation and retries it elsewhere, until ``max_retries`` failures -> Failed.
    ``attempt`` is the allocation's prologue_failures the node staged for: a report
    about an earlier attempt changes nothing."""

    allocation_id: str
    node_id: str
    ok: bool
    reason: str = ""
    attempt: int = 0
    image_digest: str = ""
    max_retries: int = 3


class PreemptAllocation(Command, tag="preempt_allocation"):
    """Start preempting a running allocation for a pending one of a higher class:
    Running -> Checkpointing (the hint for the agent / checkpoint broker)."""

    allocation_id: str
    preemptor_id: str
    reason: str = "preempted"


class SuspendAllocation(Command, tag="suspend_allocation"):
    """Its owner asks a Running, checkpointable allocation to checkpoint and stay
    Suspended (``lattice suspend``): Running -> Checkpointing with no preemptor, so it is
    not requeued on its own but waits for ResumeAllocation."""

    allocation_id: str
    requested_by: str = ""


class RecordCheckpoint(Command, tag="record_checkpoint"):
    """The head node's agent reports a completed checkpoint (the processes have
    stopped): Checkpointing -> Suspended with ``checkpoint`` recorded, nodes released.
    A preempted allocation is then requeued by the proposer (RequeueAllocation with
    ``preempted``); a suspended one waits for ResumeAllocation."""

    allocation_id: str
    node_id: str
    checkpoint: CheckpointRecord


class ResumeAllocation(Command, tag="resume_allocation"):
    """Suspended -> Pending at once, original submit time kept, to resume from its last
    checkpoint (``lattice resume``)."""

    allocation_id: str
    requested_by: str = ""


class IssueCheckpointHint(Command, tag="issue_checkpoint_hint"):
    """The checkpoint broker asks a Running, checkpointable allocation to checkpoint and
    continue. ``epoch`` must equal the allocation's ``checkpoint_hints`` (the broker's
    view is current) and no hint may be outstanding: a restarted broker never hints an
    allocation twice."""

    allocation_id: str
    epoch: int
    reason: str = ""


class CompleteCheckpointHint(Command, tag="complete_checkpoint_hint"):
    """The head node's agent reports a hint's outcome (the processes keep running):
    ``checkpoint`` set -> it becomes ``last_checkpoint``; else ``outcome`` says why not."""

    allocation_id: str
    node_id: str
    hint_id: str
    checkpoint: CheckpointRecord | None = None
    outcome: str = "ok"


class SetCheckpointEstimates(Command, tag="set_checkpoint_estimates"):
    """The checkpoint broker's estimated checkpoint minutes per allocation (the
    scheduler's f8); only changes are sent, None clears one."""

    minutes: dict[str, float | None] = msgspec.field(default_factory=dict)


class SetNodeHealth(Command, tag="set_node_health"):
    """Leader's heartbeat monitor: Ready <-> Degraded -> Down."""

    node_id: str
    state: NodeState
    reason: str = ""


class DrainNode(Command, tag="drain_node"):
    node_id: str
    reason: str = ""


class UndrainNode(Command, tag="undrain_node"):
    node_id: str


class DisableNode(Command, tag="disable_node"):
    node_id: str
    reason: str = ""


class EnableNode(Command, tag="enable_node"):
    node_id: str


class CreateTenant(Command, tag="create_tenant"):
    tenant: Tenant


class UpdateTenant(Command, tag="update_tenant"):
    name: str
    fields: dict[str, Any]


class CreateVCluster(Command, tag="create_vcluster"):
    vcluster: VCluster


class UpdateVCluster(Command, tag="update_vcluster"):
    name: str
    fields: dict[str, Any]


class AppendAudit(Command, tag="append_audit"):
    """Signed audit entries (lattice_common.audit) that continue the audit log: the
    first one's ``seq`` and ``prev_hash`` must follow the log's last entry, or the
    command is rejected (StaleRevision) and the proposer signs again after the new
    tail. ``public_key``: the PEM of the key that signed them (checked, and kept in
    ``audit_keys``). ``outbox_ids``: the quorum's outbox events they record, removed
    with the append (rejected when one is gone: another member recorded it)."""

    entries: list[AuditEntry]
    public_key: str
    outbox_ids: list[int] = msgspec.field(default_factory=list)


class InitCertificateAuthority(Command, tag="init_certificate_authority"):
    """The cluster's internal CA (lattice_common.pki), made by the API that received
    ``lattice admin ca init``: PEM certificate and key. Refused when one exists unless
    ``rotate``; a rotated-out CA stays trusted (``ca_previous``) so the certificates it
    signed keep working until they expire."""

    cert_pem: str
    key_pem: str
    rotate: bool = False


class Batch(Command, tag="batch"):
    """Several commands in one Raft entry; each gets its own result."""

    commands: list[AnyCommand]


class RemoveAllocations(Command, tag="remove_allocations"):
    """Terminal allocations leave the state once their retention has passed
    (lattice_quorum.retention): proposed by the leader's history sweeper after it
    stored their final records in the history store. Each member removes only the
    listed ids that are still removable under ``retention_seconds`` at ``now``, so
    every member removes the same ones; the rest stay for a later sweep."""

    ids: list[str] = msgspec.field(default_factory=list)
    retention_seconds: float = 86400.0
    # tenants with an internal budget keep theirs this long (0: no longer than others;
    # the ledger's totals, Tenant.retired_usage, keep what the budget penalty needs)
    budgeted_retention_seconds: float = 0.0
    # the budget period (scheduling.budget_period_days): retired usage older than this
    # is dropped; 0 = the default 90 days
    budget_period_seconds: float = 0.0


class RestoreBackup(Command, tag="restore_backup"):
    """Replace a freshly bootstrapped (empty) state with a backup's
    (lattice_quorum.handlers.backup). ``data`` is the whole backup file: every member
    verifies it again (checksum, version, decoding) before it replaces anything."""

    data: bytes = b""


AnyCommand = (
    RegisterNode
    | ReportConformance
    | SubmitAllocation
    | SubmitTaskGroup
    | SubmitDag
    | CancelDag
    | CreateSession
    | DeleteSession
    | AssignNodes
    | SetNextAllocations
    | ReleaseNodeClaim
    | ScaleAllocation
    | SetScalingStatus
    | UpdateAllocationState
    | CancelAllocation
    | SetPendingReasons
    | RequeueAllocation
    | PreemptAllocation
    | SuspendAllocation
    | RecordCheckpoint
    | ResumeAllocation
    | IssueCheckpointHint
    | CompleteCheckpointHint
    | SetCheckpointEstimates
    | ReportPrologue
    | SetNodeHealth
    | DrainNode
    | UndrainNode
    | DisableNode
    | EnableNode
    | CreateTenant
    | UpdateTenant
    | CreateVCluster
    | UpdateVCluster
    | AppendAudit
    | InitCertificateAuthority
    | RestoreBackup
    | RemoveAllocations
    | Batch
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyCommand)


def encode_command(cmd: Command) -> bytes:
    return _encoder.encode(cmd)


def decode_command(raw: bytes) -> Command:
    return _decoder.decode(raw)


class CommandResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Outcome of one command: ``error`` (an errors.LatticeError dict) or a value."""

    revision: int = 0
    error: dict[str, Any] | None = None
    allocation: Allocation | None = None
    node: Node | None = None
    tenant: Tenant | None = None
    vcluster: VCluster | None = None
    results: list[CommandResult] | None = None  # for Batch
    task_group_id: str = ""  # for SubmitTaskGroup
    allocations: list[Allocation] | None = None  # for SubmitTaskGroup, SubmitDag, CancelDag
    dag: Dag | None = None  # for SubmitDag, CancelDag
    session: Session | None = None  # for CreateSession, DeleteSession
    removed_ids: list[str] | None = None  # for RemoveAllocations: the ids it removed


_result_encoder = msgspec.msgpack.Encoder()
_result_decoder = msgspec.msgpack.Decoder(CommandResult)


def encode_result(res: CommandResult) -> bytes:
    return _result_encoder.encode(res)


def decode_result(raw: bytes) -> CommandResult:
    return _result_decoder.decode(raw)


__all__ = [
    "AnyCommand",
    "AppendAudit",
    "AssignNodes",
    "Batch",
    "CancelAllocation",
    "CheckpointHint",
    "Command",
    "CommandResult",
    "CompleteCheckpointHint",
    "CostWeights",
    "CreateTenant",
    "CreateVCluster",
    "DisableNode",
    "DrainNode",
    "EnableNode",
    "InitCertificateAuthority",
    "IssueCheckpointHint",
    "PreemptAllocation",
    "RecordCheckpoint",
    "RegisterNode",
    "ReleaseNodeClaim",
    "RemoveAllocations",
    "ReportConformance",
    "RequeueAllocation",
    "RestoreBackup",
    "ResumeAllocation",
    "ScaleAllocation",
    "SchedulerType",
    "SetCheckpointEstimates",
    "SetNextAllocations",
    "SetNodeHealth",
    "SetPendingReasons",
    "SetScalingStatus",
    "SubmitAllocation",
    "SubmitTaskGroup",
    "SuspendAllocation",
    "UndrainNode",
    "UpdateAllocationState",
    "UpdateTenant",
    "UpdateVCluster",
    "decode_command",
    "decode_result",
    "encode_command",
    "encode_result",
]
