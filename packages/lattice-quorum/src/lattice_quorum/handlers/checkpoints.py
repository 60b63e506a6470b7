"""Command handlers of the checkpoint broker: hints (checkpoint and continue), their
outcomes reported by the head node's agent, and the broker's checkpoint time estimates
(the scheduler's f8).

A hint is recorded on the allocation so that it survives a broker restart: a second
hint is refused while one is outstanding in the same run, and ``epoch`` (the count of
hints so far) must match, so a broker acting on a stale view never hints twice.
"""

from __future__ import annotations

import math

from lattice_common import commands as c
from lattice_common.errors import (
    FailedPrecondition,
    InvalidTransition,
    StaleRevision,
    ValidationError,
)
from lattice_common.types import Allocation, AllocationState, CheckpointHint

from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers.common import bump, find_alloc, touch_alloc


def run_of(a: Allocation) -> int:
    """Which run of the allocation this is (every requeue, preemption or suspend starts
    a new one; the agent counts the same way)."""
    return a.requeue_count + a.preempted_count


def hint_outstanding(a: Allocation) -> bool:
    h = a.checkpoint_hint
    return h is not None and h.done_at is None and h.run == run_of(a)


def issue_checkpoint_hint(
    state: GlobalState, cmd: c.IssueCheckpointHint, ch: Changes
) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    if a.state != AllocationState.RUNNING:
        raise InvalidTransition(
            f"allocation {a.id} is {a.state.value}; only a Running allocation gets checkpoint hints",
            details={"allocation": a.id, "state": a.state.value},
            hint="The broker re-evaluates it when it runs again.",
        )
    if not a.spec.checkpointable:
        raise FailedPrecondition(
            f"allocation {a.id} declares no checkpoint protocol (checkpoint: {a.spec.checkpoint})",
            details={"allocation": a.id, "checkpoint": a.spec.checkpoint},
            hint="Only allocations submitted with --checkpoint=signal|shmem|grpc are hinted.",
        )
    if hint_outstanding(a):
        assert a.checkpoint_hint is not None
        raise FailedPrecondition(
            f"allocation {a.id} already has checkpoint hint {a.checkpoint_hint.id} outstanding",
            details={"allocation": a.id, "hint": a.checkpoint_hint.id},
            hint="Wait for the agent to report the outstanding hint's outcome.",
        )
    if cmd.epoch != a.checkpoint_hints:
        raise StaleRevision(
            f"allocation {a.id} has had {a.checkpoint_hints} checkpoint hints, not {cmd.epoch}",
            details={"allocation": a.id, "epoch": cmd.epoch, "current": a.checkpoint_hints},
            hint="Re-read the allocation and decide again.",
        )
    bump(state)
    a.checkpoint_hints += 1
    a.checkpoint_hint = CheckpointHint(
        id=f"hint-{a.checkpoint_hints}",
        epoch=a.checkpoint_hints,
        at=cmd.now,
        run=run_of(a),
        reason=cmd.reason[:200],
    )
    touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def complete_checkpoint_hint(
    state: GlobalState, cmd: c.CompleteCheckpointHint, ch: Changes
) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    h = a.checkpoint_hint
    if h is None or h.id != cmd.hint_id or not hint_outstanding(a):
        raise FailedPrecondition(
            f"allocation {a.id} has no outstanding checkpoint hint {cmd.hint_id}",
            details={"allocation": a.id, "hint": cmd.hint_id},
            hint="The outcome was recorded already, or the allocation was requeued since.",
        )
    if not a.assigned_nodes or a.assigned_nodes[0] != cmd.node_id:
        raise ValidationError(
            f"node {cmd.node_id} is not the head node of allocation {a.id}",
            details={"allocation": a.id, "node": cmd.node_id},
            hint="The head node's agent reports the allocation's checkpoint.",
        )
    ck = cmd.checkpoint
    if ck is not None and (
        not ck.id or not ck.path or ck.size_bytes < 0 or ck.duration_seconds < 0
    ):
        raise ValidationError(
            f"checkpoint of allocation {a.id} is incomplete: id {ck.id!r}, path {ck.path!r}",
            hint="A checkpoint record needs an id, a path and non-negative size and duration.",
        )
    bump(state)
    h.done_at = cmd.now
    h.outcome = "ok" if ck is not None else (cmd.outcome or "checkpoint_failed")[:200]
    if ck is not None:
        a.last_checkpoint = ck
    touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def set_checkpoint_estimates(
    state: GlobalState, cmd: c.SetCheckpointEstimates, ch: Changes
) -> c.CommandResult:
    """Only allocations that still exist and whose estimate differs change anything."""
    for aid, m in cmd.minutes.items():
        if m is not None and (not math.isfinite(m) or m < 0):
            raise ValidationError(
                f"checkpoint estimate of allocation {aid} is {m}",
                hint="Estimates are finite, non-negative minutes (None clears one).",
            )
    changed: list[Allocation] = []
    for aid in sorted(cmd.minutes):
        a = state.allocations.get(aid)
        m = cmd.minutes[aid]
        if a is None or a.terminal or a.checkpoint_minutes == m:
            continue
        a.checkpoint_minutes = m
        changed.append(a)
    if not changed:
        return c.CommandResult(revision=state.revision)
    bump(state)
    for a in changed:
        touch_alloc(state, a, ch)
    return c.CommandResult(revision=state.revision)
