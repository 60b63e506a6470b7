"""Level-triggered reconcile: desired allocations vs what actually runs here.

A pure function. The agent calls it with the latest desired set from the quorum and
the runtime's reports, and executes the actions it returns. Only the head node
(first assigned node) runs the entrypoint, as a batch script runs on the first node
of a Slurm allocation; the other nodes are held for tasks launched into it. Nothing
starts while the allocation is Staging (its prologues run first).
"""

from __future__ import annotations

import msgspec
from lattice_common.types import Allocation, AllocationReport, AllocationState


class Start(msgspec.Struct, frozen=True):
    allocation: Allocation


class Stop(msgspec.Struct, frozen=True):
    """Terminate (SIGTERM, grace, SIGKILL). ``keep`` keeps the exited record so its end
    is reported to the quorum (preemption); otherwise the record is dropped at once."""

    allocation_id: str
    reason: str
    keep: bool = False


class Forget(msgspec.Struct, frozen=True):
    allocation_id: str


class Checkpoint(msgspec.Struct, frozen=True):
    """Ask the allocation to checkpoint through its protocol (lattice_agent.checkpoint);
    its processes are stopped once that is done or has failed. With ``hint_id`` (a
    checkpoint broker hint) they keep running: checkpoint and continue."""

    allocation: Allocation
    hint_id: str = ""


Action = Start | Stop | Forget | Checkpoint


def attempt(a: Allocation) -> int:
    """Which run of ``a`` this is: every requeue and every preemption or suspend starts
    a new one, so a run that comes back to this node starts afresh."""
    return a.requeue_count + a.preempted_count


def outstanding_hint(a: Allocation) -> str:
    """The id of the checkpoint broker hint ``a`` waits on in its current run, or ""."""
    h = a.checkpoint_hint
    if h is None or h.done_at is not None or h.run != attempt(a):
        return ""
    return h.id


def reconcile(
    node_id: str,
    desired: list[Allocation],
    actual: list[AllocationReport],
    attempts: dict[str, int],
) -> list[Action]:
    """``attempts`` maps allocation id -> :func:`attempt` of the run we know about, so a
    requeued or resumed allocation that comes back to this node starts afresh."""
    want = {a.id: a for a in desired if a.assigned_nodes and a.assigned_nodes[0] == node_id}
    have = {r.allocation_id: r for r in actual}
    actions: list[Action] = []
    for aid, r in have.items():
        a = want.get(aid)
        if a is not None and a.state == AllocationState.CHECKPOINTING and r.phase == "running":
            # preempted or suspended: through its checkpoint protocol when it has one,
            # else checkpoint=none semantics (SIGTERM, grace, SIGKILL)
            actions.append(
                Checkpoint(a) if a.spec.checkpointable else Stop(aid, "preempted", keep=True)
            )
            continue
        if a is None:
            actions.append(Stop(aid, "cancelled") if r.phase == "running" else Forget(aid))
        elif attempts.get(aid, attempt(a)) != attempt(a):
            # a new attempt of an allocation we ran before
            actions.append(Stop(aid, "requeued") if r.phase == "running" else Forget(aid))
            actions.append(Start(a))
        elif (
            a.state == AllocationState.RUNNING
            and r.phase == "running"
            and a.spec.checkpointable
            and (hint := outstanding_hint(a))
        ):
            actions.append(Checkpoint(a, hint_id=hint))  # the broker's: and continue
    for aid, a in want.items():
        # Staging: the nodes' prologues run first (prologue.py); Running starts it
        if aid not in have and a.state != AllocationState.STAGING:
            actions.append(Start(a))
    return actions
