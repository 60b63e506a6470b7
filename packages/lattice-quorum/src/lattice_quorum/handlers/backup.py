"""Restoring a backup into a fresh quorum: ``RestoreBackup``.

The command carries the whole backup file through Raft, so the restore is an entry of
the log like any other: every member (and any member that joins later, from the log or
a dump) ends with the same state, and a restart replays it. Each member verifies the
file again (deterministic: checksum, format version, full decoding) and refuses unless
its state is fresh (``backup.is_fresh``: no allocation, tenant, vCluster, DAG, session
or CA), so a restore can never overwrite a live cluster's state.

What the fresh quorum did before the restore was committed (its other members serve as
soon as they have a leader): nodes that registered and that the backup does not know are
kept (the backup's record wins for the others); audit entries of that window are
replaced by the backup's log (their hash chain cannot be spliced into it). The revision
never goes backwards: the larger of the backup's and the fresh state's.
"""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.errors import FailedPrecondition

from lattice_quorum import backup
from lattice_quorum.global_state import Changes, GlobalState


def restore_backup(state: GlobalState, cmd: c.RestoreBackup, ch: Changes) -> c.CommandResult:
    if not backup.is_fresh(state):
        raise FailedPrecondition(
            f"the quorum already holds state ({len(state.tenants)} tenants, "
            f"{len(state.allocations)} allocations, revision {state.revision}); a backup is "
            "restored only into a freshly bootstrapped quorum",
            hint="Stop every member, move their quorum.data_dir aside, start member 1 with "
            "`lattice-server --recover-from FILE --bootstrap` and the others as usual.",
        )
    _report, restored = backup.verify(cmd.data)  # BackupError: nothing changes
    joined = {k: n for k, n in state.nodes.items() if k not in restored.nodes}
    revision = max(state.revision, restored.revision)
    for field in GlobalState.__struct_fields__:
        setattr(state, field, getattr(restored, field))
    state.nodes.update(joined)
    state.revision = revision
    ch.allocations.update(state.allocations)
    ch.nodes.update(state.nodes)
    ch.tenants.update(state.tenants)
    ch.vclusters.update(state.vclusters)
    return c.CommandResult(revision=state.revision)
