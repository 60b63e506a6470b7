"""gRPC adapter of NodeService: proto messages in, NodeOps (and CacheOps for the
nodes' uenv caches), proto out."""

from __future__ import annotations

import typing
from collections.abc import AsyncIterator
from typing import Any

import grpclib.const
import msgspec
from lattice_common.errors import ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import AllocationReport, Node
from lattice_common.wire import from_message, to_message

from lattice_api.grpc import heartbeat_wire
from lattice_api.grpc.context import who
from lattice_api.ops.cache import CacheOps
from lattice_api.ops.fileaudit import FileAccessOps
from lattice_api.ops.nodes import Beat, NodeOps
from lattice_api.ops.pki import CertificateOps


def _error(d: dict[str, Any] | None) -> v1.ErrorDetail | None:
    if not d:
        return None
    return v1.ErrorDetail(
        code=d.get("code", ""),
        message=d.get("message", ""),
        details={k: str(v) for k, v in (d.get("details") or {}).items()},
        hint=d.get("hint", ""),
    )


def _image(d: dict[str, Any] | None) -> v1.CachedImage | None:
    return v1.CachedImage(**d) if d else None


def _results(out: dict[str, Any]) -> v1.CacheActionResponse:
    return v1.CacheActionResponse(
        image=out["image"],
        results=[
            v1.NodeCacheResult(
                node=r["node"],
                ok=r["ok"],
                error=_error(r.get("error")),
                image=_image(r.get("image")),
            )
            for r in out["results"]
        ],
    )


_SCALARS = {str, int, float, bool, type(None)}
_REPORT_FIELDS = tuple(f.name for f in msgspec.structs.fields(AllocationReport))
# every field a scalar (or an optional one): copied by name, no generic conversion
_REPORT_FLAT = all(
    f.type in _SCALARS or set(typing.get_args(f.type)) <= _SCALARS
    for f in msgspec.structs.fields(AllocationReport)
)


def _report(m: v1.AllocationReport) -> AllocationReport:
    """An AllocationReport from the wire; field by field (unset optional ones are
    None) while the record is flat, else the generic conversion."""
    if not _REPORT_FLAT:
        return from_message(m, AllocationReport)
    return AllocationReport(**{f: getattr(m, f) for f in _REPORT_FIELDS})


_BATCH_PATH = "/lattice.v1.NodeService/BatchHeartbeat"


def _beat(m: v1.HeartbeatRequest) -> Beat:
    health = m.health  # `is not None`: a message's truth test walks its fields
    return Beat(
        node_id=m.node_id,
        sequence=m.sequence,
        reports=[_report(r) for r in m.allocations],
        fingerprint=health.conformance_fingerprint if health is not None else "",
        telemetry_sources=list(health.telemetry_sources) if health is not None else None,
    )


def _file_event(e: v1.FileAccessEvent) -> dict[str, Any]:
    return {
        "time": e.time,
        "allocation_id": e.allocation_id,
        "uid": e.uid,
        "pid": e.pid,
        "tid": e.tid,
        "comm": e.comm,
        "path": e.path,
        "cwd": e.cwd,
        "flags": e.flags,
        "result": e.result,
        "count": e.count,
        "source": e.source,
        "suppressed": e.suppressed,
    }


class NodeService(v1.NodeServiceBase):
    def __init__(self, ops: NodeOps, cache: CacheOps, pki: CertificateOps) -> None:
        self.ops = ops
        self.cache = cache
        self.pki = pki
        # audit mode's file-access events into the audit log (ReportFileAccess)
        self.file_access = FileAccessOps(ops)

    async def sign_node_certificate(
        self, message: v1.SignNodeCertificateRequest
    ) -> v1.IssuedCertificate:
        return v1.IssuedCertificate(
            **await self.pki.sign_node(who(), message.node_id, message.csr_pem)
        )

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
            self.ops.bind_agent(who(), message.node_id)  # followers check the node too
            return v1.HeartbeatResponse(leader_hint=hint)
        # the leader's hottest path (every node, every interval): flat reports copied
        # field by field, and `is not None` (a message's truth test walks its fields)
        reports = [_report(r) for r in message.allocations]
        health = message.health
        out = await self.ops.heartbeat(
            who(),
            message.node_id,
            message.sequence,
            reports,
            health.conformance_fingerprint if health is not None else "",
            telemetry_sources=list(health.telemetry_sources) if health is not None else None,
        )
        gen = self.ops.desired_generation(message.node_id)
        return v1.HeartbeatResponse(generation=gen, reregister=bool(out.get("reregister")))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        # BatchHeartbeat's request and answer go through heartbeat_wire (same bytes,
        # a fraction of the generic messages' cost): the hottest call at scale
        mapping = super().__mapping__()
        h = mapping[_BATCH_PATH]
        mapping[_BATCH_PATH] = grpclib.const.Handler(
            h.func, h.cardinality, heartbeat_wire.BatchRequest, heartbeat_wire.BatchReply
        )
        return mapping

    async def batch_heartbeat(  # type: ignore[override]
        self, message: v1.BatchHeartbeatRequest | heartbeat_wire.BatchRequest
    ) -> heartbeat_wire.BatchReply:
        if isinstance(message, heartbeat_wire.BatchRequest):
            beats = message.beats
        else:
            beats = [_beat(h) for h in message.heartbeats]
        hint = self.ops.leader_hint()
        if hint is not None:
            for b in beats:  # followers check the nodes too
                self.ops.bind_agent(who(), b.node_id)
            return heartbeat_wire.BatchReply(leader_hint=hint)
        return heartbeat_wire.BatchReply(await self.ops.heartbeats(who(), beats))

    async def watch_desired_state(
        self, message: v1.WatchDesiredStateRequest
    ) -> AsyncIterator[v1.DesiredState]:
        async for desired in self.ops.desired_state(
            who(), message.node_id, message.known_generation
        ):
            yield v1.DesiredState(
                node_id=message.node_id,
                generation=desired.generation,
                allocations=[to_message(a, v1.Allocation) for a in desired.allocations],
                claimed_by=desired.claimed_by,
            )

    async def report_file_access(
        self, message: v1.ReportFileAccessRequest
    ) -> v1.ReportFileAccessResponse:
        out = self.file_access.report(
            who(),
            message.node_id,
            [_file_event(e) for e in message.events],
            message.dropped,
        )
        return v1.ReportFileAccessResponse(
            accepted=out["accepted"],
            rejected=[v1.FileAccessRejection(**r) for r in out["rejected"]],
            audited_allocations=out["audited_allocations"],
        )

    # --- the nodes' uenv image caches ----------------------------------------------------

    async def cache_status(self, message: v1.GetCacheStatusRequest) -> v1.CacheStatusResponse:
        out = await self.cache.status(who(), message.node or None)
        return v1.CacheStatusResponse(
            nodes=[
                v1.NodeCacheStatus(
                    node=n["node"],
                    ok=n["ok"],
                    error=_error(n.get("error")),
                    enabled=n.get("enabled", False),
                    cache_dir=n.get("cache_dir", ""),
                    max_bytes=n.get("max_bytes", 0),
                    used_bytes=n.get("used_bytes", 0),
                    images=[v1.CachedImage(**i) for i in n.get("images", [])],
                )
                for n in out["nodes"]
            ]
        )

    async def warm_cache(self, message: v1.WarmCacheRequest) -> v1.CacheActionResponse:
        out = await self.cache.warm(
            who(),
            message.image,
            nodes=list(message.nodes),
            group=message.group,
            all=message.all,
        )
        return _results(out)

    async def evict_cache(self, message: v1.EvictCacheRequest) -> v1.CacheActionResponse:
        return _results(await self.cache.evict(who(), message.image, message.node))


__all__ = ["NodeService"]
