"""gRPC adapter of NodeService: proto messages in, NodeOps, proto out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from lattice_common.errors import ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationReport, Node
from lattice_common.wire import from_message, to_message

from lattice_api.grpc.context import who
from lattice_api.ops.nodes import NodeOps


class NodeService(v1.NodeServiceBase):
    def __init__(self, ops: NodeOps) -> None:
        self.ops = ops

    async def list_nodes(self, message: v1.ListNodesRequest) -> v1.ListNodesResponse:
        nodes = self.ops.list(who(), state=message.state or None)
        return v1.ListNodesResponse(nodes=[to_message(n, v1.Node) for n in nodes])

    async def get_node(self, message: v1.GetNodeRequest) -> v1.Node:
        return to_message(self.ops.get(who(), message.id), v1.Node)

    async def drain_node(self, message: v1.NodeActionRequest) -> v1.Node:
        return to_message(await self.ops.drain(who(), message.id, message.reason), v1.Node)

    async def undrain_node(self, message: v1.NodeActionRequest) -> v1.Node:
        return to_message(await self.ops.undrain(who(), message.id, message.reason), v1.Node)

    async def disable_node(self, message: v1.NodeActionRequest) -> v1.Node:
        return to_message(await self.ops.disable(who(), message.id, message.reason), v1.Node)

    async def enable_node(self, message: v1.NodeActionRequest) -> v1.Node:
        return to_message(await self.ops.enable(who(), message.id, message.reason), v1.Node)

    async def release_node_claim(self, message: v1.NodeActionRequest) -> v1.Node:
        return to_message(await self.ops.release(who(), message.id, message.reason), v1.Node)

    async def register_node(self, message: v1.RegisterNodeRequest) -> v1.RegisterNodeResponse:
        if message.node is None:
            raise ValidationError("RegisterNode needs a node")
        n = from_message(message.node, Node)
        node = await self.ops.register(
            who(),
            {
                "node_id": n.id,
                "hostname": n.hostname,
                "capabilities": msgspec.to_builtins(n.capabilities),
                "group": n.group,
                "conformance_group": n.conformance_group,
                "agent_address": n.agent_address,
                "home_vcluster": n.home_vcluster,
            },
        )
        return v1.RegisterNodeResponse(node=to_message(node, v1.Node))

    async def heartbeat(self, message: v1.HeartbeatRequest) -> v1.HeartbeatResponse:
        hint = self.ops.leader_hint()
        if hint is not None:  # agents follow the hint to the leader
            return v1.HeartbeatResponse(leader_hint=hint)
        reports = [from_message(r, AllocationReport) for r in message.allocations]
        fingerprint = message.health.conformance_fingerprint if message.health else ""
        out = await self.ops.heartbeat(
            who(), message.node_id, message.sequence, reports, fingerprint
        )
        gen, _ = self.ops.desired_for(message.node_id)
        return v1.HeartbeatResponse(generation=gen, reregister=bool(out.get("reregister")))

    async def watch_desired_state(
        self, message: v1.WatchDesiredStateRequest
    ) -> AsyncIterator[v1.DesiredState]:
        async for gen, allocs in self.ops.desired_state(who(), message.node_id):
            yield v1.DesiredState(
                node_id=message.node_id,
                generation=gen,
                allocations=[to_message(a, v1.Allocation) for a in allocs],
            )


__all__ = ["NodeService"]
