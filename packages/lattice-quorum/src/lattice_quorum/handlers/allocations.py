"""Command handlers for an allocation's own lifecycle: submission (single and task
groups, idempotent on ``request_id``), state updates reported by agents, pending
reasons, cancel and requeue.

Handlers that hand nodes to allocations or take them away (assign, scale, preempt,
claims) are in ``handlers.assignment``.
"""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.assignment import is_sensitive
from lattice_common.errors import (
    FailedPrecondition,
    InvalidTransition,
    PermissionDenied,
    StaleRevision,
    ValidationError,
)
from lattice_common.state_machine import check_transition
from lattice_common.types import (
    HOLDING_STATES,
    Allocation,
    AllocationState,
    RequeuePolicy,
)

from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers.common import (
    admitted,
    bump,
    check_names,
    find_alloc,
    finish,
    next_id,
    release_nodes,
    requeue,
    reused_request,
    task_spec,
    touch_alloc,
)
from lattice_quorum.handlers.dags import check_dependencies, hold
from lattice_quorum.handlers.handoff import hand_off


def submit_allocation(state: GlobalState, cmd: c.SubmitAllocation, ch: Changes) -> c.CommandResult:
    spec = cmd.spec
    if spec.request_id and spec.request_id in state.request_ids:
        known = state.request_ids[spec.request_id]
        if known in state.task_groups:
            raise reused_request(spec.request_id, "task group", known)
        return c.CommandResult(revision=state.revision, allocation=state.allocations[known])
    check_names(state, spec.tenant, spec.vcluster)
    spec = admitted(state, spec)
    waits = check_dependencies(state, spec)  # may refuse: nothing is stored yet
    bump(state)
    a = Allocation(
        id=next_id(state, cmd.now), spec=spec, submitted_at=cmd.now, uenv_sha256=cmd.uenv_sha256
    )
    if waits:
        hold(state, a)
    state.allocations[a.id] = a
    if spec.request_id:
        state.request_ids[spec.request_id] = a.id
    touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


MAX_TASKS_PER_GROUP = 10_000


def submit_task_group(state: GlobalState, cmd: c.SubmitTaskGroup, ch: Changes) -> c.CommandResult:
    spec = cmd.spec
    if spec.request_id and spec.request_id in state.request_ids:
        gid = state.request_ids[spec.request_id]
        if gid not in state.task_groups:
            raise reused_request(spec.request_id, "allocation", gid)
        members = [state.allocations[i] for i in state.task_groups[gid]]
        return c.CommandResult(revision=state.revision, task_group_id=gid, allocations=members)
    check_names(state, spec.tenant, spec.vcluster)
    spec = admitted(state, spec)
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
    bump(state)
    gid = next_id(state, cmd.now)
    members: list[Allocation] = []
    for i in indexes:
        a = Allocation(
            id=next_id(state, cmd.now),
            spec=task_spec(spec, gid, i),
            submitted_at=cmd.now,
            task_group_id=gid,
            task_index=i,
            task_group_concurrency=cmd.concurrency,
            uenv_sha256=cmd.uenv_sha256,
        )
        state.allocations[a.id] = a
        members.append(a)
        touch_alloc(state, a, ch)
    state.task_groups[gid] = [a.id for a in members]
    if spec.request_id:
        state.request_ids[spec.request_id] = gid
    return c.CommandResult(revision=state.revision, task_group_id=gid, allocations=members)


def update_allocation_state(
    state: GlobalState, cmd: c.UpdateAllocationState, ch: Changes
) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    if a.state == cmd.state:
        return c.CommandResult(revision=state.revision, allocation=a)
    if cmd.state in (AllocationState.COMPLETED, AllocationState.FAILED, AllocationState.CANCELLED):
        if (
            cmd.state == AllocationState.FAILED
            and a.state in HOLDING_STATES
            and a.spec.requeue_policy == RequeuePolicy.ALWAYS
            and a.requeue_count < a.spec.max_requeue
        ):
            requeue(state, a, cmd.reason or "failed", ch)
        else:
            finish(state, a, cmd.state, cmd.now, cmd.reason, cmd.exit_code, ch, cmd.finished_at)
            if cmd.started_at is not None:  # when the process really started
                a.started_at = cmd.started_at
            if cmd.peak_memory_bytes is not None:
                a.peak_memory_bytes = cmd.peak_memory_bytes
            hand_off(state, a, cmd.now, ch)  # its nodes to their queued next allocations
        return c.CommandResult(revision=state.revision, allocation=a)
    if cmd.state == AllocationState.SUSPENDED:
        # a Suspended allocation always has a checkpoint to resume from
        raise InvalidTransition(
            f"allocation {a.id} can become Suspended only with a recorded checkpoint",
            details={"allocation": a.id, "from": a.state.value, "to": cmd.state.value},
            hint="Its head node's agent reports the checkpoint (RecordCheckpoint).",
        )
    if a.state == AllocationState.PENDING and cmd.state in HOLDING_STATES:
        raise InvalidTransition(
            f"allocation {a.id} is Pending; only a node assignment can start it",
            details={"allocation": a.id, "from": a.state.value, "to": cmd.state.value},
            hint="The scheduler starts pending allocations by assigning nodes.",
        )
    check_transition(a.id, a.state, cmd.state)
    bump(state)
    a.state = cmd.state
    a.reason = cmd.reason
    if cmd.started_at is not None:
        a.started_at = cmd.started_at
    if cmd.state not in HOLDING_STATES:  # Pending (requeue) or Suspended: nodes go back
        release_nodes(state, a, ch)
        a.assigned_nodes = []
    touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def set_pending_reasons(
    state: GlobalState, cmd: c.SetPendingReasons, ch: Changes
) -> c.CommandResult:
    """Reasons (cut to 200 characters) and start estimates of Pending allocations; only
    those that differ change anything."""
    changed: dict[str, Allocation] = {}
    for aid in sorted({*cmd.reasons, *cmd.estimates}):
        a = state.allocations.get(aid)
        if a is None or a.state != AllocationState.PENDING:
            continue
        reason = cmd.reasons.get(aid, a.pending_reason)[:200]
        e = cmd.estimates.get(aid)
        start, basis = (
            (a.estimated_start, a.estimate_basis)
            if e is None
            else (e.estimated_start, e.estimate_basis if e.estimated_start is not None else "")
        )
        if (reason, start, basis) != (a.pending_reason, a.estimated_start, a.estimate_basis):
            changed[aid] = a
            a.pending_reason, a.estimated_start, a.estimate_basis = reason, start, basis
    if not changed:
        return c.CommandResult(revision=state.revision)
    bump(state)
    for a in changed.values():
        touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision)


def cancel_allocation(state: GlobalState, cmd: c.CancelAllocation, ch: Changes) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    if a.terminal:
        raise InvalidTransition(
            f"allocation {a.id} already ended ({a.state.value})",
            details={"allocation": a.id, "state": a.state.value},
            hint="Nothing to cancel.",
        )
    finish(
        state, a, AllocationState.CANCELLED, cmd.now, cmd.reason, None, ch, actor=cmd.requested_by
    )
    return c.CommandResult(revision=state.revision, allocation=a)


def requeue_allocation(
    state: GlobalState, cmd: c.RequeueAllocation, ch: Changes
) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    if cmd.expected_requeue_count is not None and a.requeue_count != cmd.expected_requeue_count:
        raise StaleRevision(
            f"allocation {a.id} was already requeued",
            details={"expected": cmd.expected_requeue_count, "current": a.requeue_count},
        )
    if cmd.preempted:  # preemption is not the job's fault: no requeue limit
        requeue(state, a, cmd.reason, ch, preempted=True)
    elif a.requeue_count >= a.spec.max_requeue:
        finish(state, a, AllocationState.FAILED, cmd.now, cmd.reason, None, ch)
    else:
        requeue(state, a, cmd.reason, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


# --- checkpoint, suspend and resume (spec: Preemption Policy, Checkpoint Broker) -------


def suspend_allocation(
    state: GlobalState, cmd: c.SuspendAllocation, ch: Changes
) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    if a.state != AllocationState.RUNNING:
        raise InvalidTransition(
            f"allocation {a.id} is {a.state.value}; only a Running allocation can be suspended",
            details={"allocation": a.id, "state": a.state.value},
            hint="Check its state with `lattice status ID`.",
        )
    if not a.spec.checkpointable:
        raise FailedPrecondition(
            f"allocation {a.id} cannot be suspended: it declares no checkpoint protocol "
            f"(checkpoint: {a.spec.checkpoint})",
            details={"allocation": a.id, "checkpoint": a.spec.checkpoint},
            hint="Submit with --checkpoint=signal|shmem|grpc to make a job suspendable.",
        )
    if is_sensitive(a, state.vclusters):
        raise FailedPrecondition(
            f"allocation {a.id} is sensitive and is never suspended",
            details={"allocation": a.id},
            hint="Sensitive allocations run until they end or are cancelled.",
        )
    v = state.vclusters.get(a.spec.vcluster)
    if v is not None and not v.allow_user_suspend:
        raise PermissionDenied(
            f"vCluster {v.name} does not allow users to suspend allocations",
            details={"vcluster": v.name},
            hint="Ask an administrator to set allow_user_suspend on the vCluster.",
        )
    bump(state)
    a.state = AllocationState.CHECKPOINTING
    a.preempted_by = ""  # no preemptor: it stays Suspended until resumed
    a.reason = "suspended"
    a.checkpoint_hint_at = cmd.now
    touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def record_checkpoint(state: GlobalState, cmd: c.RecordCheckpoint, ch: Changes) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    if a.state != AllocationState.CHECKPOINTING:
        raise InvalidTransition(
            f"allocation {a.id} is {a.state.value}, not Checkpointing: the checkpoint is not used",
            details={"allocation": a.id, "state": a.state.value},
            hint="Only a checkpoint asked for by preemption or suspend suspends an allocation.",
        )
    if not a.assigned_nodes or a.assigned_nodes[0] != cmd.node_id:
        raise ValidationError(
            f"node {cmd.node_id} is not the head node of allocation {a.id}",
            details={"allocation": a.id, "node": cmd.node_id},
            hint="The head node's agent reports the allocation's checkpoint.",
        )
    ck = cmd.checkpoint
    if not ck.id or not ck.path or ck.size_bytes < 0 or ck.duration_seconds < 0:
        raise ValidationError(
            f"checkpoint of allocation {a.id} is incomplete: id {ck.id!r}, path {ck.path!r}",
            hint="A checkpoint record needs an id, a path and non-negative size and duration.",
        )
    check_transition(a.id, a.state, AllocationState.SUSPENDED)
    bump(state)
    release_nodes(state, a, ch)
    a.assigned_nodes = []
    a.state = AllocationState.SUSPENDED
    a.last_checkpoint = ck
    a.reason = "preempted" if a.preempted_by else "suspended"
    a.estimated_start, a.estimate_basis = None, ""
    touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def resume_allocation(state: GlobalState, cmd: c.ResumeAllocation, ch: Changes) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    if a.state != AllocationState.SUSPENDED:
        raise InvalidTransition(
            f"allocation {a.id} is {a.state.value}; only a Suspended allocation can be resumed",
            details={"allocation": a.id, "state": a.state.value},
            hint="Check its state with `lattice status ID`.",
        )
    # counted like a preemption: every run stopped for a checkpoint is one more
    requeue(state, a, "resumed", ch, preempted=True)
    return c.CommandResult(revision=state.revision, allocation=a)
