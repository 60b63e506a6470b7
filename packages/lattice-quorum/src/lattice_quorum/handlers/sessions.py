"""Command handlers of interactive sessions: create (the session and its allocation in one
command) and delete (its allocation cancelled).

A session is an allocation its user works in through a terminal (``lattice attach``);
the record lets the API find a user's sessions and enforces, across API members and
restarts, that a user holds at most one live session in a sensitive vCluster (spec:
Interactive Sessions, "one session at a time" for sensitive work).
"""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.errors import InvalidTransition, NotFound, QuotaExceeded
from lattice_common.types import Allocation, AllocationState, SchedulerType, Session

from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers.common import (
    admitted,
    bump,
    check_names,
    finish,
    next_id,
    touch_alloc,
)

__all__ = ["create_session", "delete_session"]


def _sensitive(state: GlobalState, vcluster: str) -> bool:
    v = state.vclusters.get(vcluster)
    return v is not None and v.scheduler_type == SchedulerType.SENSITIVE_RESERVATION


def _live(state: GlobalState, s: Session) -> bool:
    a = state.allocations.get(s.allocation_id)
    return s.ended_at is None and a is not None and not a.terminal


def create_session(state: GlobalState, cmd: c.CreateSession, ch: Changes) -> c.CommandResult:
    spec = cmd.spec
    check_names(state, spec.tenant, spec.vcluster)
    if _sensitive(state, spec.vcluster):
        other = next(
            (
                s
                for s in state.sessions.values()
                if s.user == spec.user
                and _live(state, s)
                and _sensitive(state, state.allocations[s.allocation_id].spec.vcluster)
            ),
            None,
        )
        if other is not None:
            raise QuotaExceeded(
                f"user {spec.user} already has sensitive session {other.id} "
                f"(allocation {other.allocation_id})",
                details={"session": other.id},
                hint="Sensitive work allows one session at a time: end it with "
                f"`lattice session delete {other.id}`, or attach to it.",
            )
    spec = admitted(state, spec)
    bump(state)
    a = Allocation(
        id=next_id(state, cmd.now), spec=spec, submitted_at=cmd.now, uenv_sha256=cmd.uenv_sha256
    )
    state.allocations[a.id] = a
    touch_alloc(state, a, ch)
    s = Session(
        id=next_id(state, cmd.now),
        allocation_id=a.id,
        tenant=spec.tenant,
        user=spec.user,
        created_at=cmd.now,
        revision=state.revision,
    )
    state.sessions[s.id] = s
    return c.CommandResult(revision=state.revision, session=s, allocation=a)


def delete_session(state: GlobalState, cmd: c.DeleteSession, ch: Changes) -> c.CommandResult:
    s = state.sessions.get(cmd.session_id)
    if s is None:
        raise NotFound(
            f"session {cmd.session_id} not found",
            hint="List your sessions with `lattice status` (sessions are allocations).",
        )
    if s.ended_at is not None:
        raise InvalidTransition(f"session {s.id} already ended", hint="Nothing to end.")
    a = state.allocations.get(s.allocation_id)
    if a is not None and not a.terminal:
        finish(state, a, AllocationState.CANCELLED, cmd.now, cmd.reason, None, ch)
    else:
        bump(state)
    s.ended_at = cmd.now
    s.revision = state.revision
    return c.CommandResult(revision=state.revision, session=s, allocation=a)
