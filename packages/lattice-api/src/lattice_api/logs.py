"""Allocation logs for the API: fetched live from the agent of the allocation's head
node over NodeAgentService.StreamLogs (the agent serves its ring buffer, then its
on-disk log files)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from grpclib.exceptions import GRPCError, StreamTerminatedError
from lattice_common.agents import AgentChannels
from lattice_common.errors import NotFound, Unavailable
from lattice_common.proto.lattice import v1
from lattice_common.types import Allocation, AllocationState
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum


class LogProxy:
    """The LogSource of lattice-server (agent channels shared with task launches)."""

    def __init__(self, quorum: Quorum, agents: AgentChannels) -> None:
        self.quorum = quorum
        self.agents = agents

    def _agent(self, alloc: Allocation) -> tuple[str, v1.NodeAgentServiceStub]:
        if alloc.state == AllocationState.PENDING or not alloc.assigned_nodes:
            raise NotFound(
                f"allocation {alloc.id} has no output yet ({alloc.state.value})",
                hint="Logs appear once the allocation is running; check `lattice status ID`.",
            )
        head = alloc.assigned_nodes[0]
        node = self.quorum.read(queries.node, head)
        if node is None or not node.agent_address:
            raise Unavailable(f"node {head} has no reachable agent")
        try:
            return head, self.agents.stub(node.agent_address)
        except ValueError as e:
            raise Unavailable(f"node {head} has no reachable agent ({e})") from None

    async def follow(
        self,
        alloc: Allocation,
        *,
        tail: int | None = None,
        stream: str = "both",
        follow: bool = True,
    ) -> AsyncIterator[dict[str, Any]]:
        node_id, stub = self._agent(alloc)
        req = v1.LogRequest(
            allocation_id=alloc.id,
            stream="" if stream == "both" else stream,
            tail=tail if tail is not None else -1,
            follow=follow,
        )
        try:
            async for ln in stub.stream_logs(req):
                yield {
                    "allocation_id": alloc.id,
                    "node_id": ln.node_id or node_id,
                    "stream": ln.stream,
                    "line": ln.line,
                    "timestamp": ln.timestamp,
                }
        except (GRPCError, StreamTerminatedError, OSError) as e:
            raise Unavailable(
                f"could not read logs from node {node_id}: {e}",
                hint="The node's agent may be down; try again when it is back.",
            ) from None

    async def fetch(
        self, alloc: Allocation, *, tail: int | None = None, stream: str = "both"
    ) -> list[dict[str, Any]]:
        return [ln async for ln in self.follow(alloc, tail=tail, stream=stream, follow=False)]

    def close(self) -> None:
        self.agents.close()
