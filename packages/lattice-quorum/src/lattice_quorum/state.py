"""The pure function that applies commands to the replicated GlobalState.

``apply(state, command)`` is deterministic: it reads only the state and the command
(timestamps come in ``command.now``), never a clock, disk or network. Every member of
the quorum runs it on the same log and so reaches the same state. It validates before
it mutates, so a rejected command changes nothing. Exclusive node ownership and hard
quotas (max_nodes, max_concurrent_allocations) are enforced here, by the rules of
``lattice_common.assignment`` (RM-Replay applies the same ones to its decisions).

The handlers live in ``lattice_quorum.handlers``, one module per domain. To add a
command: a Struct in ``lattice_common/commands.py``, a handler named after its tag in
``handlers/<domain>.py``, and one entry in ``_HANDLERS`` below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lattice_common import commands as c
from lattice_common.errors import LatticeError, ValidationError

from lattice_quorum.global_state import Changes, GlobalState, allocation_id_for
from lattice_quorum.handlers import (  # services: installs the registry hook
    allocations,
    assignment,
    audit,
    backup,
    checkpoints,
    dags,
    handoff,
    nodes,
    pki,
    retention,
    services,  # noqa: F401
    sessions,
    staging,
    tenancy,
)

__all__ = ["Changes", "GlobalState", "allocation_id_for", "apply"]


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


# Any: each handler takes the one command type its table key names.
Handler = Callable[[GlobalState, Any, Changes], c.CommandResult]

# One entry per command type (Batch is unpacked by apply itself).
_HANDLERS: dict[type[c.Command], Handler] = {
    # nodes
    c.RegisterNode: nodes.register_node,
    c.ReportConformance: nodes.report_conformance,
    c.SetNodeHealth: nodes.set_node_health,
    c.DrainNode: nodes.drain_node,
    c.UndrainNode: nodes.undrain_node,
    c.DisableNode: nodes.disable_node,
    c.EnableNode: nodes.enable_node,
    # allocations
    c.SubmitAllocation: allocations.submit_allocation,
    c.SubmitTaskGroup: allocations.submit_task_group,
    c.UpdateAllocationState: allocations.update_allocation_state,
    c.CancelAllocation: allocations.cancel_allocation,
    c.SetPendingReasons: allocations.set_pending_reasons,
    c.RequeueAllocation: allocations.requeue_allocation,
    c.SuspendAllocation: allocations.suspend_allocation,
    c.RecordCheckpoint: allocations.record_checkpoint,
    c.ResumeAllocation: allocations.resume_allocation,
    # the checkpoint broker's hints and estimates
    c.IssueCheckpointHint: checkpoints.issue_checkpoint_hint,
    c.CompleteCheckpointHint: checkpoints.complete_checkpoint_hint,
    c.SetCheckpointEstimates: checkpoints.set_checkpoint_estimates,
    # DAGs
    c.SubmitDag: dags.submit_dag,
    c.CancelDag: dags.cancel_dag,
    # sessions
    c.CreateSession: sessions.create_session,
    c.DeleteSession: sessions.delete_session,
    # assignment
    c.AssignNodes: assignment.assign_nodes,
    c.SetNextAllocations: handoff.set_next_allocations,
    c.ReleaseNodeClaim: assignment.release_node_claim,
    c.ScaleAllocation: assignment.scale_allocation,
    c.SetScalingStatus: assignment.set_scaling_status,
    c.PreemptAllocation: assignment.preempt_allocation,
    c.ReportPrologue: staging.report_prologue,
    # tenancy
    c.CreateTenant: tenancy.create_tenant,
    c.UpdateTenant: tenancy.update_tenant,
    c.CreateVCluster: tenancy.create_vcluster,
    c.UpdateVCluster: tenancy.update_vcluster,
    # the audit log
    c.AppendAudit: audit.append_audit,
    # the internal CA
    c.InitCertificateAuthority: pki.init_certificate_authority,
    # restoring a backup into a fresh quorum
    c.RestoreBackup: backup.restore_backup,
    # terminal allocations leaving the state after their retention
    c.RemoveAllocations: retention.remove_allocations,
}
