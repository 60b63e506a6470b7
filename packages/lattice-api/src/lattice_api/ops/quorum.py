"""QuorumService operations (internal): schedulers, the checkpoint broker and the
accounting service propose encoded commands and watch the state stream (a snapshot,
then one delta per entry).

What may be proposed here is what those services decide (:data:`SERVICE_COMMANDS`):
everything else has its own RPC with its own checks (submissions, node actions,
tenants, the CA). Node agents never propose (their certificates are refused); system
admins may propose anything (break-glass)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from lattice_common import commands as c
from lattice_common.errors import PermissionDenied, ValidationError
from lattice_quorum.quorum import Quorum

from lattice_api.auth import Identity, Role

#: the commands schedulers and the checkpoint broker decide
SERVICE_COMMANDS: tuple[type[c.Command], ...] = (
    c.AssignNodes,
    c.SetNextAllocations,  # a busy node's next allocation (lattice_quorum.handlers.handoff)
    c.PreemptAllocation,
    c.SetPendingReasons,
    c.ScaleAllocation,
    c.SetScalingStatus,
    c.RequeueAllocation,
    # lattice-accounting cancels an allocation whose project ran out of funds (reason
    # funds_exhausted), after its grace period
    c.CancelAllocation,
    # lattice-checkpoint: checkpoint-and-continue hints and f8's checkpoint estimates
    c.IssueCheckpointHint,
    c.SetCheckpointEstimates,
)


def check_proposer(who: Identity, cmd: c.Command) -> None:
    if who.role == Role.SYSTEM_ADMIN:
        return
    if who.cert is not None and who.cert.node_id:
        raise PermissionDenied(
            f"{who.user} may not propose commands",
            hint="Node agents report through Heartbeat; commands come from schedulers.",
        )
    inner = cmd.commands if isinstance(cmd, c.Batch) else [cmd]
    for one in inner:
        if isinstance(one, c.Batch) or not isinstance(one, SERVICE_COMMANDS):
            raise PermissionDenied(
                f"{who.user} ({who.role.value}) may not propose {type(one).__name__}",
                hint="Internal services propose scheduling decisions only; other changes "
                "have their own API calls.",
            )


class QuorumOps:
    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum

    async def propose(self, who: Identity, raw: bytes) -> tuple[bytes, int]:
        """An encoded command in; its encoded result and the revision out."""
        try:
            cmd = c.decode_command(raw)
        except msgspec.DecodeError as e:
            raise ValidationError(f"undecodable command: {e}") from None
        check_proposer(who, cmd)
        res = await self.quorum.propose(cmd)
        return c.encode_result(res), res.revision

    async def watch_state(self, who: Identity) -> AsyncIterator[tuple[bytes, bool, int]]:
        """(payload, snapshot, revision): the first snapshot and the deltas come as the
        quorum encoded them (snapshot False, revision 0: the payload carries both); a
        replaced state restarts with a fresh snapshot."""
        q = self.quorum.subscribe()
        try:
            while True:
                raw = await q.get()
                if raw is None:  # state replaced under us: start over with a snapshot
                    yield self.quorum.snapshot_delta(), True, self.quorum.revision
                    continue
                yield raw, False, 0
        finally:
            self.quorum.unsubscribe(q)


__all__ = ["SERVICE_COMMANDS", "QuorumOps", "check_proposer"]
