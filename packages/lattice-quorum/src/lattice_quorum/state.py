"""GlobalState and the pure function that applies commands to it.

``apply(state, command)`` is deterministic: it reads only the state and the command
(timestamps come in ``command.now``), never a clock, disk or network. Every member of
the quorum runs it on the same log and so reaches the same state. It validates before
it mutates, so a rejected command changes nothing. Exclusive node ownership and hard
quotas (max_nodes, max_concurrent_allocations) are enforced here, by the rules of
``lattice_common.assignment`` (RM-Replay applies the same ones to its decisions).
"""

from __future__ import annotations

import msgspec
from lattice_common import assignment
from lattice_common import commands as c
from lattice_common.errors import (
    AlreadyExists,
    InvalidTransition,
    LatticeError,
    NotFound,
    PermissionDenied,
    StaleRevision,
    ValidationError,
)
from lattice_common.state_machine import check_node_transition, check_transition
from lattice_common.types import (
    HOLDING_STATES,
    NEVER_PREEMPTED_CLASS,
    Allocation,
    AllocationSpec,
    AllocationState,
    CostWeights,
    Node,
    NodeState,
    RequeuePolicy,
    SchedulerType,
    Tenant,
    VCluster,
    claimant,
)


class GlobalState(msgspec.Struct, kw_only=True):
    revision: int = 0
    alloc_seq: int = 0
    id_salt: int = 0  # set from the first submission's timestamp: ids differ per cluster
    nodes: dict[str, Node] = msgspec.field(default_factory=dict)
    allocations: dict[str, Allocation] = msgspec.field(default_factory=dict)
    tenants: dict[str, Tenant] = msgspec.field(default_factory=dict)
    vclusters: dict[str, VCluster] = msgspec.field(default_factory=dict)
    request_ids: dict[str, str] = msgspec.field(
        default_factory=dict
    )  # request_id -> alloc/group id
    task_groups: dict[str, list[str]] = msgspec.field(default_factory=dict)  # group id -> task ids
    # Index of allocations holding nodes (Staging/Running/Checkpointing), for quotas.
    active: dict[str, None] = msgspec.field(default_factory=dict)
    # System-wide hard limit on nodes claimed for sensitive use (None = no limit)
    sensitive_pool_size: int | None = None


class Changes(msgspec.Struct, kw_only=True):
    """Keys touched by one apply; the shell turns them into watch deltas."""

    allocations: set[str] = msgspec.field(default_factory=set)
    nodes: set[str] = msgspec.field(default_factory=set)
    tenants: set[str] = msgspec.field(default_factory=set)
    vclusters: set[str] = msgspec.field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.allocations or self.nodes or self.tenants or self.vclusters)


def allocation_id_for(seq: int, salt: int = 0) -> str:
    """Short, unique, deterministic id: a bijection of (sequence + salt) on 32 bits."""
    return f"{((seq + salt) * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF:08x}"


def apply(state: GlobalState, cmd: c.Command, changes: Changes | None = None) -> c.CommandResult:
    """Apply one command. Returns a CommandResult; never raises for a rejected command."""
    changes = changes if changes is not None else Changes()
    if isinstance(cmd, c.Batch):
        results = [apply(state, sub, changes) for sub in cmd.commands]
        return c.CommandResult(revision=state.revision, results=results)
    handler = _HANDLERS.get(type(cmd))
    if handler is None:
        return _err(state, ValidationError(f"unknown command {type(cmd).__name__}"))
    try:
        return handler(state, cmd, changes)
    except LatticeError as e:
        return _err(state, e)


def _err(state: GlobalState, e: LatticeError) -> c.CommandResult:
    return c.CommandResult(revision=state.revision, error=e.to_dict())


def _bump(state: GlobalState) -> int:
    state.revision += 1
    return state.revision


def _touch_alloc(state: GlobalState, a: Allocation, ch: Changes) -> None:
    a.revision = state.revision
    ch.allocations.add(a.id)
    if a.state in HOLDING_STATES:
        state.active[a.id] = None
    else:
        state.active.pop(a.id, None)


def _touch_node(state: GlobalState, n: Node, ch: Changes) -> None:
    n.revision = state.revision
    ch.nodes.add(n.id)


def _node(state: GlobalState, node_id: str) -> Node:
    n = state.nodes.get(node_id)
    if n is None:
        raise NotFound(
            f"node {node_id} not found",
            hint="List nodes with `lattice nodes`.",
        )
    return n


def _alloc(state: GlobalState, alloc_id: str) -> Allocation:
    a = state.allocations.get(alloc_id)
    if a is None:
        raise NotFound(
            f"allocation {alloc_id} not found",
            hint="List your allocations with `lattice status`.",
        )
    return a


# --- nodes -------------------------------------------------------------------------


def _register_node(state: GlobalState, cmd: c.RegisterNode, ch: Changes) -> c.CommandResult:
    _bump(state)
    n = state.nodes.get(cmd.node_id)
    if n is None:
        n = Node(id=cmd.node_id, registered_at=cmd.now, home_vcluster=cmd.home_vcluster)
        state.nodes[n.id] = n
    n.hostname = cmd.hostname
    n.capabilities = cmd.capabilities
    n.group = cmd.group
    if cmd.conformance_group:  # "" = not reported: keep what we know
        n.conformance_group = cmd.conformance_group
    n.agent_address = cmd.agent_address
    if cmd.home_vcluster:
        n.home_vcluster = cmd.home_vcluster
    # A (re-)registering agent is healthy; admin states (drain, disable) are kept.
    if n.state in (NodeState.UNKNOWN, NodeState.BOOTING, NodeState.DEGRADED) or (
        n.state == NodeState.DOWN and not n.disabled
    ):
        # an operator's drain survives the node going down and coming back
        n.state = NodeState.DRAINED if n.drain_requested else NodeState.READY
        n.state_reason = ""
    _check_conformance(n)
    _touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


CONFORMANCE_DRIFT = "conformance_drift"


def _check_conformance(n: Node) -> None:
    """Compare the node's reported fingerprint (conformance_group) with its baseline.

    The first fingerprint a node reports becomes its baseline (expected_conformance).
    A different one later is drift: recorded on the node (conformance_drift and a
    state_reason "conformance_drift: expected=<a>, actual=<b>", unless another reason
    is already there), nothing else changes: running work continues, and the node
    scores lower on f9 because it now sits in a smaller conformance group. A report
    matching the baseline again (remediated) clears it."""
    actual = n.conformance_group
    if not actual:
        return
    if not n.expected_conformance:
        n.expected_conformance = actual
    drifted = actual != n.expected_conformance
    was_reason = n.state_reason.startswith(CONFORMANCE_DRIFT)
    n.conformance_drift = drifted
    if drifted and (not n.state_reason or was_reason):
        n.state_reason = f"{CONFORMANCE_DRIFT}: expected={n.expected_conformance}, actual={actual}"
    elif not drifted and was_reason:
        n.state_reason = ""
    if drifted and n.claimed_by and n.state == NodeState.READY:
        # a sensitive node must not take new claims until remediated and verified; an
        # operator undrains it afterwards (Drained -> Ready)
        n.drain_requested = True
        n.state = NodeState.DRAINING if n.owner else NodeState.DRAINED
        n.state_reason = f"{CONFORMANCE_DRIFT}: expected={n.expected_conformance}, actual={actual}"


def _report_conformance(
    state: GlobalState, cmd: c.ReportConformance, ch: Changes
) -> c.CommandResult:
    n = _node(state, cmd.node_id)
    if not cmd.fingerprint or cmd.fingerprint == n.conformance_group:
        return c.CommandResult(revision=state.revision, node=n)
    _bump(state)
    n.conformance_group = cmd.fingerprint
    _check_conformance(n)
    _touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def _set_node_health(state: GlobalState, cmd: c.SetNodeHealth, ch: Changes) -> c.CommandResult:
    n = _node(state, cmd.node_id)
    if cmd.state not in (NodeState.READY, NodeState.DEGRADED, NodeState.DOWN):
        raise ValidationError(f"health can only set Ready, Degraded or Down, not {cmd.state}")
    if n.state == cmd.state:
        return c.CommandResult(revision=state.revision, node=n)
    if cmd.state == NodeState.READY and n.state != NodeState.DEGRADED:
        # Recovery from Down happens by re-registration, from drains by undrain.
        return c.CommandResult(revision=state.revision, node=n)
    if cmd.state == NodeState.DEGRADED and n.state not in (NodeState.READY,):
        # Admin states (Draining/Drained) keep their meaning; Down stays Down.
        return c.CommandResult(revision=state.revision, node=n)
    check_node_transition(n.id, n.state, cmd.state)
    _bump(state)
    n.state = cmd.state
    n.state_reason = cmd.reason
    _check_conformance(n)  # a drifted node that recovers keeps saying so
    if cmd.state == NodeState.DOWN:
        _fail_node_allocations(state, n, cmd.now, "node_failure", ch)
    _touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def _fail_node_allocations(
    state: GlobalState, n: Node, now: float, reason: str, ch: Changes
) -> None:
    if not n.owner:
        return
    a = state.allocations.get(n.owner)
    if a is None or a.terminal:
        _free(n)
        return
    if (
        a.spec.requeue_policy in (RequeuePolicy.ON_NODE_FAILURE, RequeuePolicy.ALWAYS)
        and a.requeue_count < a.spec.max_requeue
    ):
        _requeue(state, a, reason, ch)
    else:
        _finish(state, a, AllocationState.FAILED, now, reason, None, ch)


def _drain_node(state: GlobalState, cmd: c.DrainNode, ch: Changes) -> c.CommandResult:
    n = _node(state, cmd.node_id)
    if n.state in (NodeState.DRAINING, NodeState.DRAINED):
        return c.CommandResult(revision=state.revision, node=n)
    target = NodeState.DRAINING if n.owner else NodeState.DRAINED
    check_node_transition(n.id, n.state, target)
    _bump(state)
    n.drain_requested = True
    n.state = target
    n.state_reason = cmd.reason
    _touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def _undrain_node(state: GlobalState, cmd: c.UndrainNode, ch: Changes) -> c.CommandResult:
    n = _node(state, cmd.node_id)
    if n.state != NodeState.DRAINED:
        raise InvalidTransition(
            f"node {n.id} is {n.state.value}; undrain only works from Drained",
            details={"node": n.id, "state": n.state.value},
            hint="Wait for its allocations to finish (or cancel them), then undrain."
            if n.state == NodeState.DRAINING
            else "Only a drained node can be undrained.",
        )
    _bump(state)
    n.drain_requested = False
    n.state = NodeState.READY
    n.state_reason = ""
    if n.conformance_drift:
        # undrain after maintenance is the operator's approval of the node as it is
        # now (spec: rolling upgrades, drift remediation): its fingerprint becomes
        # the baseline
        n.expected_conformance = n.conformance_group
        n.conformance_drift = False
    _touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def _disable_node(state: GlobalState, cmd: c.DisableNode, ch: Changes) -> c.CommandResult:
    n = _node(state, cmd.node_id)
    _bump(state)
    n.disabled = True
    n.state = NodeState.DOWN
    n.state_reason = cmd.reason or "disabled"
    _fail_node_allocations(state, n, cmd.now, "node_disabled", ch)
    _touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def _enable_node(state: GlobalState, cmd: c.EnableNode, ch: Changes) -> c.CommandResult:
    n = _node(state, cmd.node_id)
    if not n.disabled and n.state != NodeState.DOWN:
        return c.CommandResult(revision=state.revision, node=n)
    _bump(state)
    n.disabled = False
    n.state = NodeState.DRAINED if n.drain_requested else NodeState.READY
    n.state_reason = ""
    _check_conformance(n)
    _touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


# --- allocations -------------------------------------------------------------------


def _submit(state: GlobalState, cmd: c.SubmitAllocation, ch: Changes) -> c.CommandResult:
    spec = cmd.spec
    if spec.request_id and spec.request_id in state.request_ids:
        existing = state.allocations[state.request_ids[spec.request_id]]
        return c.CommandResult(revision=state.revision, allocation=existing)
    _check_names(state, spec.tenant, spec.vcluster)
    spec = _admitted(state, spec)
    _bump(state)
    a = Allocation(id=_next_id(state, cmd.now), spec=spec, submitted_at=cmd.now)
    state.allocations[a.id] = a
    if spec.request_id:
        state.request_ids[spec.request_id] = a.id
    _touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def _admitted(state: GlobalState, spec: AllocationSpec) -> AllocationSpec:
    """Sensitive work runs at the highest class, whatever was asked ("Priority is fixed
    at the highest level"): it is never preempted."""
    v = state.vclusters.get(spec.vcluster)
    if v is not None and v.scheduler_type == SchedulerType.SENSITIVE_RESERVATION:
        return msgspec.structs.replace(spec, preemption_class=NEVER_PREEMPTED_CLASS)
    return spec


MAX_TASKS_PER_GROUP = 10_000


def _next_id(state: GlobalState, now: float) -> str:
    if state.alloc_seq == 0 and not state.id_salt:
        state.id_salt = int(now * 1_000_003) & 0xFFFFFFFF
    state.alloc_seq += 1
    alloc_id = allocation_id_for(state.alloc_seq, state.id_salt)
    while alloc_id in state.allocations or alloc_id in state.task_groups:
        state.alloc_seq += 1
        alloc_id = allocation_id_for(state.alloc_seq, state.id_salt)
    return alloc_id


def _submit_task_group(state: GlobalState, cmd: c.SubmitTaskGroup, ch: Changes) -> c.CommandResult:
    spec = cmd.spec
    if spec.request_id and spec.request_id in state.request_ids:
        gid = state.request_ids[spec.request_id]
        members = [state.allocations[i] for i in state.task_groups.get(gid, [])]
        return c.CommandResult(revision=state.revision, task_group_id=gid, allocations=members)
    _check_names(state, spec.tenant, spec.vcluster)
    spec = _admitted(state, spec)
    step = cmd.step or 1
    indexes = range(cmd.start, cmd.end + 1, step)
    if (
        cmd.start < 0
        or step < 1
        or not 1 <= len(indexes) <= MAX_TASKS_PER_GROUP
        or cmd.concurrency < 0
    ):
        raise ValidationError(
            f"invalid task group range {cmd.start}-{cmd.end} (step {step}, concurrency {cmd.concurrency})",
            hint=f"Use START-END[%CONCURRENCY] with 0 <= START <= END and at most {MAX_TASKS_PER_GROUP} tasks.",
        )
    _bump(state)
    gid = _next_id(state, cmd.now)
    members: list[Allocation] = []
    base_name = spec.name or spec.entrypoint.split()[0].rsplit("/", 1)[-1]
    for i in indexes:
        task_spec = msgspec.structs.replace(
            spec,
            entrypoint=spec.entrypoint.replace("${INDEX}", str(i)),
            env={
                **spec.env,
                "LATTICE_TASK_INDEX": str(i),
                "LATTICE_TASK_GROUP_ID": gid,
                "SLURM_ARRAY_TASK_ID": str(i),
                "SLURM_ARRAY_JOB_ID": gid,
            },
            name=f"{base_name}[{i}]",
            request_id="",
        )
        a = Allocation(
            id=_next_id(state, cmd.now),
            spec=task_spec,
            submitted_at=cmd.now,
            task_group_id=gid,
            task_index=i,
            task_group_concurrency=cmd.concurrency,
        )
        state.allocations[a.id] = a
        members.append(a)
        _touch_alloc(state, a, ch)
    state.task_groups[gid] = [a.id for a in members]
    if spec.request_id:
        state.request_ids[spec.request_id] = gid
    return c.CommandResult(revision=state.revision, task_group_id=gid, allocations=members)


def _check_names(state: GlobalState, tenant: str, vcluster: str) -> None:
    if tenant not in state.tenants:
        raise NotFound(
            f'unknown tenant "{tenant}"',
            details={"available": ", ".join(sorted(state.tenants)) or "(none)"},
            hint="Pick one of the available tenants with --tenant.",
        )
    if vcluster not in state.vclusters:
        raise NotFound(
            f'unknown vCluster "{vcluster}"',
            details={"available": ", ".join(sorted(state.vclusters)) or "(none)"},
            hint="Pick one of the available vClusters with --vcluster.",
        )


def _tenant_usage(state: GlobalState, tenant: str) -> tuple[int, int]:
    nodes = allocs = 0
    for aid in state.active:
        a = state.allocations[aid]
        if a.spec.tenant == tenant:
            allocs += 1
            nodes += len(a.assigned_nodes)
    return nodes, allocs


def _assign(state: GlobalState, cmd: c.AssignNodes, ch: Changes) -> c.CommandResult:
    a = _alloc(state, cmd.allocation_id)
    nodes = assignment.check_assignment(
        a,
        cmd.node_ids,
        lambda nid: _node(state, nid),
        sensitive=assignment.is_sensitive(a, state.vclusters),
        tenant=state.tenants.get(a.spec.tenant),
        tenant_usage=lambda: _tenant_usage(state, a.spec.tenant),
        expected_revision=cmd.expected_revision,
        sensitive_pool_size=state.sensitive_pool_size,
        claimed_nodes=lambda: _claimed_nodes(state),
    )
    _bump(state)
    for n in nodes:
        _take(state, n, a, cmd.vcluster, cmd.now)
        _touch_node(state, n, ch)
    a.assigned_nodes = list(cmd.node_ids)
    a.pending_reason = ""
    a.preempted_by = ""
    a.state = AllocationState.RUNNING
    a.started_at = cmd.now
    a.reason = ""
    _touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def _claimed_nodes(state: GlobalState) -> int:
    return sum(1 for n in state.nodes.values() if n.claimed_by)


def _take(state: GlobalState, n: Node, a: Allocation, vcluster: str, now: float) -> None:
    n.owner = a.id
    n.owner_tenant = a.spec.tenant
    n.owner_vcluster = vcluster or a.spec.vcluster
    if assignment.is_sensitive(a, state.vclusters) and not n.claimed_by:
        # the claim outlives the allocation: idle claimed nodes stay with their user
        n.claimed_by = claimant(a)
        n.claimed_at = now


def _release_claim(state: GlobalState, cmd: c.ReleaseNodeClaim, ch: Changes) -> c.CommandResult:
    n = _node(state, cmd.node_id)
    if not n.claimed_by:
        raise ValidationError(
            f"node {n.id} is not claimed",
            hint="`lattice nodes -o wide` shows which nodes are claimed and by whom.",
        )
    if not cmd.admin and cmd.user != n.claimed_by:
        raise PermissionDenied(
            f"node {n.id} is claimed by {n.claimed_by}; only that user or an administrator "
            "can release it",
            details={"node": n.id, "claimed_by": n.claimed_by},
        )
    if n.owner:
        raise InvalidTransition(
            f"node {n.id} still runs allocation {n.owner}",
            details={"node": n.id, "owner": n.owner},
            hint=f"Wait for it to finish or cancel it (lattice cancel {n.owner}).",
        )
    _bump(state)
    n.claimed_by = ""
    n.claimed_at = None
    _touch_node(state, n, ch)
    return c.CommandResult(revision=state.revision, node=n)


def _scale(state: GlobalState, cmd: c.ScaleAllocation, ch: Changes) -> c.CommandResult:
    """Grow or shrink a running allocation with a node range within {min_nodes, nodes}."""
    a = _alloc(state, cmd.allocation_id)
    if a.state != AllocationState.RUNNING:
        raise InvalidTransition(
            f"allocation {a.id} is {a.state.value}; only running allocations scale",
            details={"allocation": a.id, "state": a.state.value},
        )
    if not a.spec.min_nodes:
        raise ValidationError(
            f"allocation {a.id} has a fixed node count",
            hint="Only allocations submitted with a node range (--nodes MIN-MAX) scale.",
        )
    assignment.check_fresh("allocation", a.id, a.revision, cmd.expected_revision)
    add, remove = list(cmd.add_node_ids), list(cmd.remove_node_ids)
    if not add and not remove:
        raise ValidationError("scale needs nodes to add or remove")
    if len(set(add)) != len(add) or set(add) & set(a.assigned_nodes):
        raise ValidationError("nodes to add must be distinct and not already assigned")
    if not set(remove) <= set(a.assigned_nodes) or (remove and remove[0] == a.assigned_nodes[0]):
        raise ValidationError(
            "only assigned nodes other than the first (where the allocation's launcher "
            "runs) can be removed"
        )
    size = len(a.assigned_nodes) + len(add) - len(remove)
    if not a.spec.min_nodes <= size <= a.spec.nodes:
        raise ValidationError(
            f"allocation {a.id} needs {a.spec.min_nodes}..{a.spec.nodes} nodes, "
            f"scaling would give {size}"
        )
    nodes = [_node(state, nid) for nid in add]
    sensitive = assignment.is_sensitive(a, state.vclusters)
    for n in nodes:
        assignment.check_fresh("node", n.id, n.revision, cmd.expected_revision)
        assignment.check_takeable(n, a, sensitive=sensitive)
    assignment.check_sensitive_pool(
        nodes,
        sensitive=sensitive,
        limit=state.sensitive_pool_size,
        claimed=lambda: _claimed_nodes(state),
    )
    t = state.tenants.get(a.spec.tenant)
    if t is not None and nodes:
        assignment.check_max_nodes(t, _tenant_usage(state, t.name)[0], len(nodes))
    _bump(state)
    for n in nodes:
        _take(state, n, a, cmd.vcluster, cmd.now)
        _touch_node(state, n, ch)
    for nid in remove:
        n = state.nodes.get(nid)
        if n is not None and n.owner == a.id:
            _free(n)
            _touch_node(state, n, ch)
    gone = set(remove)
    a.assigned_nodes = [nid for nid in a.assigned_nodes if nid not in gone] + add
    _touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def _free(n: Node) -> None:
    n.owner = ""
    n.owner_tenant = ""
    n.owner_vcluster = ""
    if n.state == NodeState.DRAINING:
        n.state = NodeState.DRAINED


def _release_nodes(state: GlobalState, a: Allocation, ch: Changes) -> None:
    for nid in a.assigned_nodes:
        n = state.nodes.get(nid)
        if n is not None and n.owner == a.id:
            _free(n)
            _touch_node(state, n, ch)


def _finish(
    state: GlobalState,
    a: Allocation,
    target: AllocationState,
    now: float,
    reason: str,
    exit_code: int | None,
    ch: Changes,
    finished_at: float | None = None,
) -> None:
    check_transition(a.id, a.state, target)
    _bump(state)
    _release_nodes(state, a, ch)
    a.state = target
    a.reason = reason
    a.exit_code = exit_code
    a.finished_at = finished_at if finished_at is not None else now
    _touch_alloc(state, a, ch)


def _requeue(
    state: GlobalState, a: Allocation, reason: str, ch: Changes, *, preempted: bool = False
) -> None:
    check_transition(a.id, a.state, AllocationState.PENDING)
    _bump(state)
    _release_nodes(state, a, ch)
    a.state = AllocationState.PENDING
    a.assigned_nodes = []
    a.started_at = None
    if preempted:  # preempted_by stays until it is placed again
        a.preempted_count += 1
        a.resume_from_checkpoint = True
    else:
        a.requeue_count += 1
    a.reason = reason
    _touch_alloc(state, a, ch)  # submitted_at is kept: no queue-jumping penalty


def _update_state(state: GlobalState, cmd: c.UpdateAllocationState, ch: Changes) -> c.CommandResult:
    a = _alloc(state, cmd.allocation_id)
    if a.state == cmd.state:
        return c.CommandResult(revision=state.revision, allocation=a)
    if cmd.state in (AllocationState.COMPLETED, AllocationState.FAILED, AllocationState.CANCELLED):
        if (
            cmd.state == AllocationState.FAILED
            and a.state in HOLDING_STATES
            and a.spec.requeue_policy == RequeuePolicy.ALWAYS
            and a.requeue_count < a.spec.max_requeue
        ):
            _requeue(state, a, cmd.reason or "failed", ch)
        else:
            _finish(state, a, cmd.state, cmd.now, cmd.reason, cmd.exit_code, ch, cmd.finished_at)
            if cmd.started_at is not None:  # when the process really started
                a.started_at = cmd.started_at
        return c.CommandResult(revision=state.revision, allocation=a)
    if a.state == AllocationState.PENDING and cmd.state in HOLDING_STATES:
        raise InvalidTransition(
            f"allocation {a.id} is Pending; only a node assignment can start it",
            details={"allocation": a.id, "from": a.state.value, "to": cmd.state.value},
            hint="The scheduler starts pending allocations by assigning nodes.",
        )
    check_transition(a.id, a.state, cmd.state)
    _bump(state)
    a.state = cmd.state
    a.reason = cmd.reason
    if cmd.started_at is not None:
        a.started_at = cmd.started_at
    if cmd.state not in HOLDING_STATES:  # Pending (requeue) or Suspended: nodes go back
        _release_nodes(state, a, ch)
        a.assigned_nodes = []
    _touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def _set_pending_reasons(
    state: GlobalState, cmd: c.SetPendingReasons, ch: Changes
) -> c.CommandResult:
    changed = [
        a
        for aid, reason in sorted(cmd.reasons.items())
        if (a := state.allocations.get(aid)) is not None
        and a.state == AllocationState.PENDING
        and a.pending_reason != reason[:200]
    ]
    if not changed:
        return c.CommandResult(revision=state.revision)
    _bump(state)
    for a in changed:
        a.pending_reason = cmd.reasons[a.id][:200]
        _touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision)


def _cancel(state: GlobalState, cmd: c.CancelAllocation, ch: Changes) -> c.CommandResult:
    a = _alloc(state, cmd.allocation_id)
    if a.terminal:
        raise InvalidTransition(
            f"allocation {a.id} already ended ({a.state.value})",
            details={"allocation": a.id, "state": a.state.value},
            hint="Nothing to cancel.",
        )
    _finish(state, a, AllocationState.CANCELLED, cmd.now, cmd.reason, None, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def _requeue_cmd(state: GlobalState, cmd: c.RequeueAllocation, ch: Changes) -> c.CommandResult:
    a = _alloc(state, cmd.allocation_id)
    if cmd.expected_requeue_count is not None and a.requeue_count != cmd.expected_requeue_count:
        raise StaleRevision(
            f"allocation {a.id} was already requeued",
            details={"expected": cmd.expected_requeue_count, "current": a.requeue_count},
        )
    if cmd.preempted:  # preemption is not the job's fault: no requeue limit
        _requeue(state, a, cmd.reason, ch, preempted=True)
    elif a.requeue_count >= a.spec.max_requeue:
        _finish(state, a, AllocationState.FAILED, cmd.now, cmd.reason, None, ch)
    else:
        _requeue(state, a, cmd.reason, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def _preempt(state: GlobalState, cmd: c.PreemptAllocation, ch: Changes) -> c.CommandResult:
    a = _alloc(state, cmd.allocation_id)
    p = _alloc(state, cmd.preemptor_id)
    assignment.check_preemption(a, p, state.nodes)
    _bump(state)
    a.state = AllocationState.CHECKPOINTING
    a.preempted_by = p.id
    a.reason = cmd.reason
    a.checkpoint_hint_at = cmd.now  # the broker / agent act on it from here
    _touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


# --- tenants and vClusters ----------------------------------------------------------

_TENANT_FIELDS = {
    "max_nodes",
    "max_concurrent_allocations",
    "fair_share_target",
    "burst_allowance",
    "gpu_hours_budget",
    "node_hours_budget",
    "isolation",
}
_VCLUSTER_FIELDS = {
    "scheduler_type",
    "tenant",
    "weights",
    "cycle_interval_seconds",
    "backfill_depth",
    "allow_borrowing",
}


def _create_tenant(state: GlobalState, cmd: c.CreateTenant, ch: Changes) -> c.CommandResult:
    t = cmd.tenant
    if t.name in state.tenants:
        raise AlreadyExists(
            f'tenant "{t.name}" already exists', hint="Use `lattice admin tenant update`."
        )
    _bump(state)
    t.created_at = cmd.now
    t.revision = state.revision
    state.tenants[t.name] = t
    ch.tenants.add(t.name)
    return c.CommandResult(revision=state.revision, tenant=t)


def _update_tenant(state: GlobalState, cmd: c.UpdateTenant, ch: Changes) -> c.CommandResult:
    t = state.tenants.get(cmd.name)
    if t is None:
        raise NotFound(
            f'tenant "{cmd.name}" not found', hint="List tenants with `lattice admin tenant list`."
        )
    unknown = set(cmd.fields) - _TENANT_FIELDS
    if unknown:
        raise ValidationError(f"unknown tenant fields: {', '.join(sorted(unknown))}")
    try:
        merged = msgspec.convert({**msgspec.to_builtins(t), **cmd.fields}, Tenant)
    except msgspec.ValidationError as e:
        raise ValidationError(f"invalid tenant update: {e}") from None
    _bump(state)
    merged.revision = state.revision
    state.tenants[t.name] = merged
    ch.tenants.add(t.name)
    return c.CommandResult(revision=state.revision, tenant=merged)


def _create_vcluster(state: GlobalState, cmd: c.CreateVCluster, ch: Changes) -> c.CommandResult:
    v = cmd.vcluster
    if v.name in state.vclusters:
        raise AlreadyExists(f'vCluster "{v.name}" already exists')
    if v.tenant and v.tenant not in state.tenants:
        raise NotFound(f'tenant "{v.tenant}" not found')
    _bump(state)
    v.created_at = cmd.now
    v.revision = state.revision
    state.vclusters[v.name] = v
    ch.vclusters.add(v.name)
    return c.CommandResult(revision=state.revision, vcluster=v)


def _update_vcluster(state: GlobalState, cmd: c.UpdateVCluster, ch: Changes) -> c.CommandResult:
    v = state.vclusters.get(cmd.name)
    if v is None:
        raise NotFound(f'vCluster "{cmd.name}" not found')
    unknown = set(cmd.fields) - _VCLUSTER_FIELDS
    if unknown:
        raise ValidationError(f"unknown vCluster fields: {', '.join(sorted(unknown))}")
    data = msgspec.to_builtins(v)
    for k, val in cmd.fields.items():
        if k == "weights" and isinstance(val, dict):
            bad = set(val) - set(CostWeights.__struct_fields__)
            if bad:
                raise ValidationError(
                    f"unknown cost weights: {', '.join(sorted(bad))}",
                    details={"available": ", ".join(CostWeights.__struct_fields__)},
                )
            data["weights"] = {**data["weights"], **val}
        else:
            data[k] = val
    try:
        merged = msgspec.convert(data, VCluster)
    except msgspec.ValidationError as e:
        raise ValidationError(f"invalid vCluster update: {e}") from None
    _bump(state)
    merged.revision = state.revision
    state.vclusters[v.name] = merged
    ch.vclusters.add(v.name)
    return c.CommandResult(revision=state.revision, vcluster=merged)


_HANDLERS = {
    c.RegisterNode: _register_node,
    c.ReportConformance: _report_conformance,
    c.SetNodeHealth: _set_node_health,
    c.DrainNode: _drain_node,
    c.UndrainNode: _undrain_node,
    c.DisableNode: _disable_node,
    c.EnableNode: _enable_node,
    c.SubmitAllocation: _submit,
    c.SubmitTaskGroup: _submit_task_group,
    c.AssignNodes: _assign,
    c.ReleaseNodeClaim: _release_claim,
    c.ScaleAllocation: _scale,
    c.UpdateAllocationState: _update_state,
    c.CancelAllocation: _cancel,
    c.SetPendingReasons: _set_pending_reasons,
    c.RequeueAllocation: _requeue_cmd,
    c.PreemptAllocation: _preempt,
    c.CreateTenant: _create_tenant,
    c.UpdateTenant: _update_tenant,
    c.CreateVCluster: _create_vcluster,
    c.UpdateVCluster: _update_vcluster,
}
