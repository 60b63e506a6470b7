"""gRPC (grpclib) services of lattice-server.

Authentication and metrics happen once, in a RecvRequest listener that wraps every
method handler: it resolves the caller's Identity into a context variable, times the
call, and maps LatticeError to a gRPC status whose message is the error as JSON
(code, message, details, hint) so clients can rebuild the typed error. RPCs of the
contract that are not built yet answer UNIMPLEMENTED naming the RPC.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpclib
import msgspec
from grpclib.const import Status
from grpclib.events import RecvRequest, listen
from grpclib.server import Server
from lattice_common import commands as c
from lattice_common.errors import LatticeError, ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import (
    AllocationReport,
    Node,
    Tenant,
    VCluster,
)
from lattice_common.wire import from_message, to_message

from lattice_api.auth import Authenticator, Identity, authorize
from lattice_api.logs import LogProxy
from lattice_api.node_monitor import NodeMonitor
from lattice_api.rest import LATENCY, REQUESTS
from lattice_api.service import LatticeService

log = logging.getLogger("lattice.api.grpc")

_identity: contextvars.ContextVar[Identity | LatticeError] = contextvars.ContextVar("identity")


def who() -> Identity:
    ident = _identity.get()
    if isinstance(ident, LatticeError):
        raise ident
    return ident


def grpc_error(err: LatticeError) -> grpclib.GRPCError:
    return grpclib.GRPCError(Status(err.grpc_status), msgspec.json.encode(err.to_dict()).decode())


def install_interceptor(server: Server, auth: Authenticator) -> None:
    async def on_request(event: RecvRequest) -> None:
        try:
            _identity.set(auth.authenticate(dict(event.metadata)))
        except LatticeError as e:
            _identity.set(e)
        inner = event.method_func
        name = event.method_name

        async def wrapped(stream: Any) -> None:
            t0 = time.perf_counter()
            status = "OK"
            try:
                await inner(stream)
            except LatticeError as e:
                status = Status(e.grpc_status).name
                raise grpc_error(e) from None
            except grpclib.GRPCError as e:
                status = e.status.name
                raise
            except Exception:
                status = "INTERNAL"
                log.exception("unhandled error in %s", name)
                raise
            finally:
                REQUESTS.labels(name, status).inc()
                LATENCY.labels(name).observe(time.perf_counter() - t0)

        event.method_func = wrapped

    listen(server, RecvRequest, on_request)


def _unimplemented(base: type) -> None:
    """Make the generated default handlers say which RPC is missing."""
    for attr, fn in list(vars(base).items()):
        if attr.startswith("_") or not callable(fn):
            continue

        def make(rpc: str, service: str) -> Any:
            async def handler(self: Any, message: Any) -> Any:
                raise grpclib.GRPCError(
                    Status.UNIMPLEMENTED, f"{service}.{rpc} is not implemented yet"
                )

            return handler

        setattr(base, attr, make(attr, base.__name__.removesuffix("Base")))


# Subclasses below override what exists; everything else inherits these.
for _base in (
    v1.AllocationServiceBase,
    v1.NodeServiceBase,
    v1.AdminServiceBase,
    v1.QuorumServiceBase,
):
    _unimplemented(_base)


class AllocationService(v1.AllocationServiceBase):
    def __init__(self, svc: LatticeService, logs: LogProxy) -> None:
        self.svc = svc
        self.logs = logs

    async def submit(self, message: v1.SubmitRequest) -> v1.SubmitResponse:
        if message.task_group is not None and message.task_group.template is not None:
            tg = message.task_group
            body = tg.template.to_dict(casing=msgspec_casing(), output_format=_py())
            body["task_group"] = {
                "start": tg.range_start,
                "end": tg.range_end,
                "step": tg.step or 1,
                "concurrency": tg.concurrency,
            }
            res = await self.svc.submit_task_group(who(), body)
            tasks = res.allocations or []
            return v1.SubmitResponse(
                allocation_ids=[a.id for a in tasks], task_group_id=res.task_group_id
            )
        if message.allocation is None:
            raise grpclib.GRPCError(
                Status.UNIMPLEMENTED,
                "AllocationService.Submit: the DAG form is not implemented yet",
            )
        body = message.allocation.to_dict(casing=msgspec_casing(), output_format=_py())
        a = await self.svc.submit(who(), body)
        return v1.SubmitResponse(allocation_ids=[a.id], allocations=[to_message(a, v1.Allocation)])

    async def get(self, message: v1.GetAllocationRequest) -> v1.Allocation:
        return to_message(self.svc.get_allocation(who(), message.id), v1.Allocation)

    async def list(self, message: v1.ListAllocationsRequest) -> v1.ListAllocationsResponse:
        allocs = self.svc.list_allocations(
            who(),
            state=message.state or None,
            tenant=message.tenant or None,
            vcluster=message.vcluster or None,
            user=message.user or None,
            all_users=not message.user and who().role.value in ("system-admin",),
            limit=message.limit or None,
        )
        return v1.ListAllocationsResponse(
            allocations=[to_message(a, v1.Allocation) for a in allocs]
        )

    async def cancel(self, message: v1.CancelAllocationRequest) -> v1.Allocation:
        return to_message(await self.svc.cancel(who(), message.id), v1.Allocation)

    async def watch(self, message: v1.WatchAllocationsRequest) -> AsyncIterator[v1.AllocationEvent]:
        if not message.id:
            raise grpclib.GRPCError(
                Status.UNIMPLEMENTED,
                "AllocationService.Watch: watching all allocations is not implemented yet",
            )
        alloc_id = message.id
        async for rev, a in self.svc.watch(who(), alloc_id):
            yield v1.AllocationEvent(revision=rev, allocation=to_message(a, v1.Allocation))

    async def get_logs(self, message: v1.GetLogsRequest) -> v1.GetLogsResponse:
        a = self.svc.get_allocation(who(), message.allocation_id)
        lines = await self.logs.fetch(a, tail=message.tail or None, stream=message.stream or "both")
        return v1.GetLogsResponse(lines=[v1.LogLine(**ln) for ln in lines])

    async def stream_logs(self, message: v1.StreamLogsRequest) -> AsyncIterator[v1.LogLine]:
        a = self.svc.get_allocation(who(), message.allocation_id)
        async for ln in self.logs.follow(
            a, tail=message.tail or None, stream=message.stream or "both"
        ):
            yield v1.LogLine(**ln)


class NodeService(v1.NodeServiceBase):
    def __init__(self, svc: LatticeService, monitor: NodeMonitor) -> None:
        self.svc = svc
        self.monitor = monitor

    async def list_nodes(self, message: v1.ListNodesRequest) -> v1.ListNodesResponse:
        nodes = self.svc.list_nodes(who(), state=message.state or None)
        return v1.ListNodesResponse(nodes=[to_message(n, v1.Node) for n in nodes])

    async def get_node(self, message: v1.GetNodeRequest) -> v1.Node:
        return to_message(self.svc.get_node(who(), message.id), v1.Node)

    async def _action(self, message: v1.NodeActionRequest, action: str) -> v1.Node:
        return to_message(
            await self.svc.node_action(who(), message.id, action, message.reason), v1.Node
        )

    async def drain_node(self, message: v1.NodeActionRequest) -> v1.Node:
        return await self._action(message, "drain")

    async def undrain_node(self, message: v1.NodeActionRequest) -> v1.Node:
        return await self._action(message, "undrain")

    async def disable_node(self, message: v1.NodeActionRequest) -> v1.Node:
        return await self._action(message, "disable")

    async def enable_node(self, message: v1.NodeActionRequest) -> v1.Node:
        return await self._action(message, "enable")

    async def release_node_claim(self, message: v1.NodeActionRequest) -> v1.Node:
        return await self._action(message, "release")

    async def register_node(self, message: v1.RegisterNodeRequest) -> v1.RegisterNodeResponse:
        if message.node is None:
            raise ValidationError("RegisterNode needs a node")
        n = from_message(message.node, Node)
        node = await self.svc.register_node(
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
        self.monitor.last_seen[node.id] = self.monitor.clock()
        return v1.RegisterNodeResponse(node=to_message(node, v1.Node))

    async def heartbeat(self, message: v1.HeartbeatRequest) -> v1.HeartbeatResponse:
        authorize(who(), "node.agent")
        if not self.svc.member.is_leader:
            return v1.HeartbeatResponse(leader_hint=self.svc.leader_api_address())
        reports = [from_message(r, AllocationReport) for r in message.allocations]
        fingerprint = message.health.conformance_fingerprint if message.health else ""
        out = await self.monitor.heartbeat(message.node_id, message.sequence, reports, fingerprint)
        gen, _ = self.svc.desired_for(message.node_id)
        return v1.HeartbeatResponse(generation=gen, reregister=bool(out.get("reregister")))

    async def watch_desired_state(
        self, message: v1.WatchDesiredStateRequest
    ) -> AsyncIterator[v1.DesiredState]:
        async for gen, allocs in self.svc.desired_state(who(), message.node_id):
            yield v1.DesiredState(
                node_id=message.node_id,
                generation=gen,
                allocations=[to_message(a, v1.Allocation) for a in allocs],
            )


class AdminService(v1.AdminServiceBase):
    def __init__(self, svc: LatticeService) -> None:
        self.svc = svc

    async def create_tenant(self, message: v1.CreateTenantRequest) -> v1.Tenant:
        t = from_message(message.tenant, Tenant) if message.tenant else None
        if t is None:
            raise ValidationError("CreateTenant needs a tenant")
        body = {
            k: v for k, v in msgspec.to_builtins(t).items() if k not in ("created_at", "revision")
        }
        return to_message(await self.svc.create_tenant(who(), body), v1.Tenant)

    async def list_tenants(self, message: v1.ListTenantsRequest) -> v1.ListTenantsResponse:
        return v1.ListTenantsResponse(
            tenants=[to_message(t, v1.Tenant) for t in self.svc.list_tenants(who())]
        )

    async def get_tenant(self, message: v1.GetTenantRequest) -> v1.Tenant:
        return to_message(self.svc.get_tenant(who(), message.name), v1.Tenant)

    async def update_tenant(self, message: v1.UpdateTenantRequest) -> v1.Tenant:
        fields = _update_fields(message, "tenant")
        return to_message(
            await self.svc.update_tenant(who(), message.tenant.name, fields), v1.Tenant
        )

    async def create_v_cluster(self, message: v1.CreateVClusterRequest) -> v1.VCluster:
        v = from_message(message.vcluster, VCluster) if message.vcluster else None
        if v is None:
            raise ValidationError("CreateVCluster needs a vcluster")
        body = {
            k: val
            for k, val in msgspec.to_builtins(v).items()
            if k not in ("created_at", "revision")
        }
        return to_message(await self.svc.create_vcluster(who(), body), v1.VCluster)

    async def list_v_clusters(self, message: v1.ListVClustersRequest) -> v1.ListVClustersResponse:
        return v1.ListVClustersResponse(
            vclusters=[to_message(v, v1.VCluster) for v in self.svc.list_vclusters(who())]
        )

    async def get_v_cluster(self, message: v1.GetVClusterRequest) -> v1.VCluster:
        return to_message(self.svc.get_vcluster(who(), message.name), v1.VCluster)

    async def update_v_cluster(self, message: v1.UpdateVClusterRequest) -> v1.VCluster:
        fields = _update_fields(message, "vcluster")
        return to_message(
            await self.svc.update_vcluster(who(), message.vcluster.name, fields), v1.VCluster
        )

    async def get_raft_status(self, message: v1.GetRaftStatusRequest) -> v1.RaftStatus:
        st = self.svc.raft_status(who())
        return v1.RaftStatus(
            member_id=str(st["member_id"]),
            leader_address=st.get("leader_api_address") or st["leader_address"],
            term=st["term"],
            commit_index=st["commit_index"],
            last_applied=st["last_applied"],
            members=[
                v1.RaftMember(id=str(m["id"]), address=m["address"], state=m["state"])
                for m in st["members"]
            ],
        )

    # --- usage (lattice_api.usage) ---------------------------------------------------

    async def get_tenant_usage(self, message: v1.GetTenantUsageRequest) -> v1.TenantUsage:
        from lattice_api.usage import grpc_tenant_usage

        return grpc_tenant_usage(self.svc, who(), message)

    async def get_user_usage(self, message: v1.GetUserUsageRequest) -> v1.UserUsage:
        from lattice_api.usage import grpc_user_usage

        return grpc_user_usage(self.svc, who(), message)

    # --- end usage --------------------------------------------------------------------


class QuorumService(v1.QuorumServiceBase):
    """Internal: schedulers and the broker propose commands and watch state here."""

    def __init__(self, svc: LatticeService) -> None:
        self.svc = svc

    async def propose(self, message: v1.ProposeRequest) -> v1.ProposeResponse:
        authorize(who(), "quorum.internal")
        try:
            cmd = c.decode_command(message.command)
        except msgspec.DecodeError as e:
            raise ValidationError(f"undecodable command: {e}") from None
        res = await self.svc.member.propose(cmd)
        return v1.ProposeResponse(result=c.encode_result(res), revision=res.revision)

    async def watch_state(self, message: v1.WatchStateRequest) -> AsyncIterator[v1.StateEvent]:
        authorize(who(), "quorum.internal")
        q = self.svc.member.subscribe()
        try:
            while True:
                raw = await q.get()
                if raw is None:  # state replaced under us: start over with a snapshot
                    raw = self.svc.member.snapshot_delta()
                    yield v1.StateEvent(
                        revision=self.svc.member.revision, snapshot=True, payload=raw
                    )
                    continue
                yield v1.StateEvent(payload=raw)
        finally:
            self.svc.member.unsubscribe(q)


def _update_fields(message: Any, kind: str) -> dict[str, Any]:
    """Fields to change, from an Update*Request (an explicit field mask if present)."""
    record = getattr(message, kind, None)
    if record is None:
        raise ValidationError(f"Update needs a {kind}")
    data = record.to_dict(casing=msgspec_casing(), output_format=_py())
    mask = list(getattr(message, "update_mask", []) or getattr(message, "fields", []) or [])
    if mask:
        return {k: data.get(k) for k in mask}
    return {k: v for k, v in data.items() if k not in ("name", "created_at", "revision")}


def msgspec_casing() -> Any:
    from betterproto2 import Casing

    return Casing.SNAKE


def _py() -> Any:
    from betterproto2 import OutputFormat

    return OutputFormat.PYTHON


def build_grpc_server(
    svc: LatticeService, auth: Authenticator, monitor: NodeMonitor, logs: LogProxy
) -> Server:
    server = Server(
        [
            AllocationService(svc, logs),
            NodeService(svc, monitor),
            AdminService(svc),
            QuorumService(svc),
        ]
    )
    install_interceptor(server, auth)
    return server


__all__ = ["build_grpc_server", "who"]
