"""gRPC adapter of the internal QuorumService (Propose, WatchState): schedulers and the
checkpoint broker talk to the quorum here."""

from __future__ import annotations

from collections.abc import AsyncIterator

from lattice_common.proto.lattice import v1

from lattice_api.grpc.context import who
from lattice_api.ops.quorum import QuorumOps


class QuorumService(v1.QuorumServiceBase):
    def __init__(self, ops: QuorumOps) -> None:
        self.ops = ops

    async def propose(self, message: v1.ProposeRequest) -> v1.ProposeResponse:
        result, revision = await self.ops.propose(who(), message.command)
        return v1.ProposeResponse(result=result, revision=revision)

    async def watch_state(self, message: v1.WatchStateRequest) -> AsyncIterator[v1.StateEvent]:
        async for payload, snapshot, revision in self.ops.watch_state(who()):
            if snapshot:
                yield v1.StateEvent(revision=revision, snapshot=True, payload=payload)
            else:
                yield v1.StateEvent(payload=payload)


__all__ = ["QuorumService"]
