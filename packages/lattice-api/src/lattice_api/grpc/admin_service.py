"""gRPC adapter of AdminService: tenants, vClusters, Raft status (AdminOps), the
usage RPCs (UsageOps), service discovery (ServiceOps) and the audit log (AuditOps)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from lattice_common.audit import AuditEntry
from lattice_common.errors import ValidationError
from lattice_common.proto.lattice import v1
from lattice_common.types import Tenant, VCluster
from lattice_common.wire import from_message, to_message

from lattice_api.grpc.context import update_fields, who
from lattice_api.ops.admin import AdminOps
from lattice_api.ops.audit import AuditOps
from lattice_api.ops.backup import BackupOps
from lattice_api.ops.pki import CertificateOps
from lattice_api.ops.queue import QueueOps
from lattice_api.ops.services import ServiceOps
from lattice_api.ops.usage import UsageOps


def _record_body(record: Tenant | VCluster) -> dict[str, object]:
    return {
        k: v for k, v in msgspec.to_builtins(record).items() if k not in ("created_at", "revision")
    }


class AdminService(v1.AdminServiceBase):
    def __init__(
        self,
        ops: AdminOps,
        usage: UsageOps,
        queue: QueueOps,
        services: ServiceOps,
        audit: AuditOps | None = None,
        pki: CertificateOps | None = None,
        backup: BackupOps | None = None,
    ) -> None:
        self.ops = ops
        self.usage = usage
        self.queue = queue
        self.services = services
        self.audit = audit
        self.pki = pki
        self.backup = backup

    # --- the queue view -------------------------------------------------------------

    async def get_v_cluster_queue(self, message: v1.GetVClusterQueueRequest) -> v1.VClusterQueue:
        q = self.queue.queue(who(), message.name, all_users=message.all_users)
        return v1.VClusterQueue(
            vcluster=q["vcluster"],
            total=q["total"],
            computed_at=q["computed_at"],
            entries=[
                v1.QueueEntry(
                    **{k: v for k, v in e.items() if k != "allocation"},
                    allocation=to_message(e["allocation"], v1.Allocation),
                )
                for e in q["entries"]
            ],
        )

    # --- tenants --------------------------------------------------------------------

    async def create_tenant(self, message: v1.CreateTenantRequest) -> v1.Tenant:
        t = from_message(message.tenant, Tenant) if message.tenant else None
        if t is None:
            raise ValidationError("CreateTenant needs a tenant")
        body = _record_body(t)
        return to_message(await self.ops.create_tenant(who(), body), v1.Tenant)

    async def list_tenants(self, message: v1.ListTenantsRequest) -> v1.ListTenantsResponse:
        return v1.ListTenantsResponse(
            tenants=[to_message(t, v1.Tenant) for t in self.ops.list_tenants(who())]
        )

    async def get_tenant(self, message: v1.GetTenantRequest) -> v1.Tenant:
        return to_message(self.ops.get_tenant(who(), message.name), v1.Tenant)

    async def update_tenant(self, message: v1.UpdateTenantRequest) -> v1.Tenant:
        fields = update_fields(message, "tenant")
        return to_message(
            await self.ops.update_tenant(who(), message.tenant.name, fields), v1.Tenant
        )

    # --- vClusters ------------------------------------------------------------------

    async def create_v_cluster(self, message: v1.CreateVClusterRequest) -> v1.VCluster:
        v = from_message(message.vcluster, VCluster) if message.vcluster else None
        if v is None:
            raise ValidationError("CreateVCluster needs a vcluster")
        body = _record_body(v)
        return to_message(await self.ops.create_vcluster(who(), body), v1.VCluster)

    async def list_v_clusters(self, message: v1.ListVClustersRequest) -> v1.ListVClustersResponse:
        return v1.ListVClustersResponse(
            vclusters=[to_message(v, v1.VCluster) for v in self.ops.list_vclusters(who())]
        )

    async def get_v_cluster(self, message: v1.GetVClusterRequest) -> v1.VCluster:
        return to_message(self.ops.get_vcluster(who(), message.name), v1.VCluster)

    async def update_v_cluster(self, message: v1.UpdateVClusterRequest) -> v1.VCluster:
        fields = update_fields(message, "vcluster")
        return to_message(
            await self.ops.update_vcluster(who(), message.vcluster.name, fields), v1.VCluster
        )

    # --- Raft -----------------------------------------------------------------------

    async def get_raft_status(self, message: v1.GetRaftStatusRequest) -> v1.RaftStatus:
        st = self.ops.raft_status(who())
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

    # --- usage ----------------------------------------------------------------------

    async def get_tenant_usage(self, message: v1.GetTenantUsageRequest) -> v1.TenantUsage:
        d = await self.usage.read_tenant_usage_between(
            who(), message.tenant, message.since, message.until
        )
        return v1.TenantUsage(
            tenant=d["tenant"],
            node_hours=d["node_hours"],
            gpu_hours=d["gpu_hours"],
            node_hours_budget=d["node_hours_budget"],
            gpu_hours_budget=d["gpu_hours_budget"],
            nodes_in_use=d["nodes_in_use"],
            max_nodes=d["max_nodes"],
            running_allocations=d["running_allocations"],
            max_concurrent_allocations=d["max_concurrent_allocations"],
            fair_share_target=d["fair_share_target"],
            fair_share_usage=d["fair_share_usage"],
        )

    async def get_user_usage(self, message: v1.GetUserUsageRequest) -> v1.UserUsage:
        d = await self.usage.read_user_usage_between(
            who(), message.user, message.tenant, message.since, message.until
        )
        return v1.UserUsage(
            user=d["user"],
            tenant=d["tenant"],
            node_hours=d["node_hours"],
            gpu_hours=d["gpu_hours"],
            allocations=d["allocations"],
        )

    # --- service discovery (tenant: the caller's, from its token or x-lattice-tenant) ----

    async def lookup_service(self, message: v1.LookupServiceRequest) -> v1.LookupServiceResponse:
        svc = self.services.lookup(who(), message.name)
        return v1.LookupServiceResponse(
            name=svc.name, endpoints=[to_message(e, v1.ServiceEndpoint) for e in svc.endpoints]
        )

    async def list_services(self, message: v1.ListServicesRequest) -> v1.ListServicesResponse:
        return v1.ListServicesResponse(names=[s.name for s in self.services.list_services(who())])

    # --- the audit log --------------------------------------------------------------

    def _audit(self) -> AuditOps:
        assert self.audit is not None, "AdminService built without AuditOps"
        return self.audit

    async def query_audit(self, message: v1.QueryAuditRequest) -> v1.QueryAuditResponse:
        params = {
            "tenant": message.tenant,
            "user": message.user,
            "allocation_id": message.allocation_id,
            "action": message.action,
            "target": message.target,
            "since": message.since,
            "until": message.until,
            "limit": message.limit,
            "page_token": message.page_token,
        }
        page = await self._audit().query(who(), params)
        return v1.QueryAuditResponse(
            entries=[_audit_entry(e) for e in page["entries"]],
            next_page_token=page["next_page_token"],
        )

    async def export_audit(
        self, message: v1.ExportAuditRequest
    ) -> AsyncIterator[v1.ExportAuditChunk]:
        chunk = bytearray()
        for line in await self._audit().export(who()):
            chunk += line
            if len(chunk) >= 1 << 20:
                yield v1.ExportAuditChunk(data=bytes(chunk))
                chunk.clear()
        if chunk:
            yield v1.ExportAuditChunk(data=bytes(chunk))

    async def verify_audit(self, message: v1.VerifyAuditRequest) -> v1.VerifyAuditResponse:
        return v1.VerifyAuditResponse(**await self._audit().verify(who()))

    # --- the internal CA --------------------------------------------------------------

    def _pki(self) -> CertificateOps:
        assert self.pki is not None, "AdminService built without CertificateOps"
        return self.pki

    async def init_certificate_authority(
        self, message: v1.InitCertificateAuthorityRequest
    ) -> v1.CertificateAuthority:
        return v1.CertificateAuthority(**await self._pki().init_ca(who(), rotate=message.rotate))

    async def get_certificate_authority(
        self, message: v1.GetCertificateAuthorityRequest
    ) -> v1.CertificateAuthority:
        return v1.CertificateAuthority(**self._pki().view())

    async def issue_certificate(self, message: v1.IssueCertificateRequest) -> v1.IssuedCertificate:
        out = await self._pki().issue(
            who(),
            kind=message.kind,
            name=message.name,
            csr_pem=message.csr_pem,
            lifetime=message.lifetime_seconds,
            hosts=list(message.hosts),
        )
        return v1.IssuedCertificate(**out)

    # --- backups (lattice_api.ops.backup) ---------------------------------------------

    def _backup(self) -> BackupOps:
        assert self.backup is not None, "AdminService built without BackupOps"
        return self.backup

    async def create_backup(self, message: v1.CreateBackupRequest) -> v1.BackupInfo:
        return _backup_info(await self._backup().create(who(), message.path))

    async def verify_backup(self, message: v1.VerifyBackupRequest) -> v1.VerifyBackupResponse:
        out = await self._backup().verify(who(), message.path)
        if not out.get("valid"):
            return v1.VerifyBackupResponse(
                valid=False, message=out.get("message", ""), hint=out.get("hint", "")
            )
        return v1.VerifyBackupResponse(valid=True, info=_backup_info(out))

    async def restore_backup(self, message: v1.RestoreBackupRequest) -> v1.RestoreBackupResponse:
        out = await self._backup().restore(who(), message.path, force=message.force)
        return v1.RestoreBackupResponse(info=_backup_info(out["info"]), message=out["message"])


def _backup_info(d: dict[str, object]) -> v1.BackupInfo:
    fields = set(v1.BackupInfo.__dataclass_fields__)
    return v1.BackupInfo(**{k: v for k, v in d.items() if k in fields})


def _audit_entry(e: AuditEntry) -> v1.AuditEntry:
    kind, _, ident = e.target.partition(":")
    return v1.AuditEntry(
        sequence=e.seq,
        timestamp=e.time,
        user=e.actor,
        tenant=e.tenant,
        action=e.action,
        allocation_id=ident if kind == "allocation" else "",
        node_id=ident if kind == "node" else "",
        details=dict(e.details),
        prev_hash=e.prev_hash,
        signature=e.signature,
        target=e.target,
        hash=e.hash,
        key_id=e.key_id,
    )


__all__ = ["AdminService"]
