"""Primitives every handler domain shares: revision bumps, change tracking, lookups
that fail with the user-facing NotFound, and the allocation lifecycle steps (finish,
requeue, freeing nodes) that node failures and allocation commands both take, and what
every kind of submission (single, task group, DAG) shares: names checked, ids, admission.

Only ``state.apply``'s handlers call these, always under its rule: validate first,
then mutate, so a rejected command changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from lattice_common import audit as audit_log
from lattice_common.assignment import is_sensitive
from lattice_common.errors import AlreadyExists, NotFound, PermissionDenied
from lattice_common.state_machine import check_transition
from lattice_common.types import (
    HOLDING_STATES,
    NEVER_PREEMPTED_CLASS,
    Allocation,
    AllocationSpec,
    AllocationState,
    Node,
    NodeState,
    SchedulerType,
)

from lattice_quorum.global_state import Changes, GlobalState, allocation_id_for
from lattice_quorum.handlers import audit

#: What an allocation's end means for the allocations that depend on it: set by
#: ``handlers.dags`` when it is imported (it builds on ``finish``, so ``finish`` cannot
#: import it); ``state`` imports every handler module, so apply always has it.
on_ended: Callable[[GlobalState, Allocation, float, Changes], None] | None = None
#: What every change of an allocation means for the service registry: set by
#: ``handlers.services`` when it is imported (same reason as ``on_ended``).
on_touched: Callable[[GlobalState, Allocation], None] | None = None


def bump(state: GlobalState) -> int:
    state.revision += 1
    return state.revision


def touch_alloc(state: GlobalState, a: Allocation, ch: Changes) -> None:
    a.revision = state.revision
    ch.allocations.add(a.id)
    if a.state in HOLDING_STATES:
        state.active[a.id] = None
    else:
        state.active.pop(a.id, None)
    if on_touched is not None and a.spec.expose:
        on_touched(state, a)


def touch_node(state: GlobalState, n: Node, ch: Changes) -> None:
    n.revision = state.revision
    ch.nodes.add(n.id)


def find_node(state: GlobalState, node_id: str) -> Node:
    n = state.nodes.get(node_id)
    if n is None:
        raise NotFound(
            f"node {node_id} not found",
            hint="List nodes with `lattice nodes`.",
        )
    return n


def find_alloc(state: GlobalState, alloc_id: str) -> Allocation:
    a = state.allocations.get(alloc_id)
    if a is None:
        raise NotFound(
            f"allocation {alloc_id} not found",
            hint="List your allocations with `lattice status`.",
        )
    return a


def free(n: Node) -> None:
    n.owner = ""
    n.owner_tenant = ""
    n.owner_vcluster = ""
    if n.state == NodeState.DRAINING:
        n.state = NodeState.DRAINED


def release_nodes(state: GlobalState, a: Allocation, ch: Changes) -> None:
    for nid in a.assigned_nodes:
        n = state.nodes.get(nid)
        if n is not None and n.owner == a.id:
            free(n)
            touch_node(state, n, ch)


def finish(
    state: GlobalState,
    a: Allocation,
    target: AllocationState,
    now: float,
    reason: str,
    exit_code: int | None,
    ch: Changes,
    finished_at: float | None = None,
    *,
    resolve_dag: bool = True,
    actor: str = "",
) -> None:
    """End ``a``; a DAG member's end is resolved for its successors in the same command
    (``resolve_dag=False`` only where the resolution itself ends members). A sensitive
    allocation's end goes to the audit outbox, by ``actor`` (who asked; "" = lattice)."""
    check_transition(a.id, a.state, target)
    bump(state)
    release_nodes(state, a, ch)
    a.state = target
    a.reason = reason
    a.exit_code = exit_code
    a.estimated_start, a.estimate_basis = None, ""
    a.finished_at = finished_at if finished_at is not None else now
    touch_alloc(state, a, ch)
    if is_sensitive(a, state.vclusters):
        audit.note(
            state,
            now=now,
            actor=actor or "lattice",
            action=audit_log.ALLOCATION_END,
            target=f"allocation:{a.id}",
            tenant=a.spec.tenant,
            details={"state": a.state.value, "reason": reason, "user": a.spec.user},
        )
    if resolve_dag and on_ended is not None and (a.dag_id or a.id in state.dependents):
        on_ended(state, a, now, ch)


def requeue(
    state: GlobalState, a: Allocation, reason: str, ch: Changes, *, preempted: bool = False
) -> None:
    check_transition(a.id, a.state, AllocationState.PENDING)
    bump(state)
    release_nodes(state, a, ch)
    a.state = AllocationState.PENDING
    a.assigned_nodes = []
    a.started_at = None
    if preempted:  # preempted_by stays until it is placed again
        a.preempted_count += 1
        a.resume_from_checkpoint = True
    else:
        a.requeue_count += 1
    a.reason = reason
    touch_alloc(state, a, ch)  # submitted_at is kept: no queue-jumping penalty


def resume_from_hint_checkpoint(a: Allocation) -> None:
    """A run lost with its node resumes from the checkpoint a broker hint wrote
    ("checkpoint and continue"; spec: Checkpoint Broker): its next run gets
    LATTICE_RESUME=1 and LATTICE_CHECKPOINT_PATH of ``last_checkpoint``, as after a
    suspend. Without one it starts over."""
    h = a.checkpoint_hint
    if h is not None and h.outcome == "ok" and a.last_checkpoint is not None:
        a.resume_from_checkpoint = True


# --- submission: the names, ids and rules every kind of submission shares ----------


def reused_request(request_id: str, kind: str, known: str) -> AlreadyExists:
    return AlreadyExists(
        f'request_id "{request_id}" was already used to submit {kind} {known}',
        hint="Use a new request_id for a new submission; resend the same request only to retry it.",
    )


def admitted(state: GlobalState, spec: AllocationSpec) -> AllocationSpec:
    """Sensitive work runs at the highest class, whatever was asked ("Priority is fixed
    at the highest level"): it is never preempted. Other work may not ask for a class
    above its tenant's ``max_preemption_class`` (the class is the tenant's contract, not
    the user's choice): refused, never silently lowered."""
    v = state.vclusters.get(spec.vcluster)
    if v is not None and v.scheduler_type == SchedulerType.SENSITIVE_RESERVATION:
        return msgspec.structs.replace(spec, preemption_class=NEVER_PREEMPTED_CLASS)
    t = state.tenants.get(spec.tenant)
    cap = t.max_preemption_class if t is not None else None
    if cap is not None and spec.preemption_class > cap:
        raise PermissionDenied(
            f"preemption class {spec.preemption_class} is above tenant {spec.tenant}'s "
            f"maximum of {cap}",
            details={"tenant": spec.tenant, "max_preemption_class": str(cap)},
            hint=f"Submit with --preemption-class {cap} or lower, or ask your tenant "
            "administrator for a higher class.",
        )
    return spec


def next_id(state: GlobalState, now: float) -> str:
    if state.alloc_seq == 0 and not state.id_salt:
        state.id_salt = int(now * 1_000_003) & 0xFFFFFFFF
    state.alloc_seq += 1
    alloc_id = allocation_id_for(state.alloc_seq, state.id_salt)
    while (
        alloc_id in state.allocations
        or alloc_id in state.task_groups
        or alloc_id in state.dags
        or alloc_id in state.sessions
    ):
        state.alloc_seq += 1
        alloc_id = allocation_id_for(state.alloc_seq, state.id_salt)
    return alloc_id


def check_names(state: GlobalState, tenant: str, vcluster: str) -> None:
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


def task_spec(spec: AllocationSpec, group_id: str, index: int) -> AllocationSpec:
    """Task ``index`` of a task group (job array): ``${INDEX}`` in the entrypoint,
    LATTICE_TASK_INDEX and the SLURM_ARRAY_* twins, ``name[index]``."""
    base_name = spec.name or spec.entrypoint.split()[0].rsplit("/", 1)[-1]
    return msgspec.structs.replace(
        spec,
        entrypoint=spec.entrypoint.replace("${INDEX}", str(index)),
        env={
            **spec.env,
            "LATTICE_TASK_INDEX": str(index),
            "LATTICE_TASK_GROUP_ID": group_id,
            "SLURM_ARRAY_TASK_ID": str(index),
            "SLURM_ARRAY_JOB_ID": group_id,
        },
        name=f"{base_name}[{index}]",
        request_id="",
    )
