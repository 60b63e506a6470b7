"""The Staging state (spec: allocation flow 8a-8f, Prologue Failure).

An allocation with something to fetch before it can start (a uenv image, an OCI image)
is assigned into Staging, not Running: every assigned node runs the prologue (pull,
verify, health checks) and reports it. Running only when every node is done; the
processes start then. A failed prologue drains the node *for this allocation* (it is
never assigned there again) and puts it back in the queue for other nodes, with its
original submit time; after ``max_retries`` failures it ends Failed with the cause.
"""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.types import Allocation, AllocationSpec, AllocationState

from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers.common import bump, find_alloc, finish, release_nodes, touch_alloc


def needs_staging(spec: AllocationSpec) -> bool:
    """Whether the nodes have something to fetch before the allocation can run."""
    return bool(spec.uenv or spec.image)


def report_prologue(state: GlobalState, cmd: c.ReportPrologue, ch: Changes) -> c.CommandResult:
    a = find_alloc(state, cmd.allocation_id)
    if (
        a.state != AllocationState.STAGING
        or cmd.node_id not in a.assigned_nodes
        or cmd.attempt != a.prologue_failures
    ):
        # late or repeated: a report about an earlier attempt or placement
        return c.CommandResult(revision=state.revision, allocation=a)
    if cmd.ok:
        if cmd.node_id in a.staged_nodes:
            return c.CommandResult(revision=state.revision, allocation=a)
        bump(state)
        a.staged_nodes.append(cmd.node_id)
        if cmd.image_digest and not a.image_digest:
            a.image_digest = cmd.image_digest
        if set(a.staged_nodes) >= set(a.assigned_nodes):
            a.state = AllocationState.RUNNING
            a.started_at = cmd.now
        touch_alloc(state, a, ch)
        return c.CommandResult(revision=state.revision, allocation=a)
    _failed(state, a, cmd, ch)
    return c.CommandResult(revision=state.revision, allocation=a)


def _failed(state: GlobalState, a: Allocation, cmd: c.ReportPrologue, ch: Changes) -> None:
    cause = cmd.reason or "prologue failed"
    a.prologue_failures += 1
    if cmd.node_id not in a.excluded_nodes:
        a.excluded_nodes.append(cmd.node_id)
    a.staged_nodes = []
    if a.prologue_failures >= max(1, cmd.max_retries):
        finish(
            state,
            a,
            AllocationState.FAILED,
            cmd.now,
            f"prologue_failed: {cause} (on {cmd.node_id}; {a.prologue_failures} tries)",
            None,
            ch,
        )
        return
    bump(state)
    release_nodes(state, a, ch)
    a.state = AllocationState.PENDING
    a.assigned_nodes = []
    a.started_at = None
    a.reason = f"prologue_failed: {cause}"
    a.pending_reason = (
        f"prologue failed on {cmd.node_id}: {cause}; retrying on other nodes "
        f"(try {a.prologue_failures + 1} of {cmd.max_retries})"
    )
    touch_alloc(state, a, ch)
