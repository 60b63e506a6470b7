"""The one permission table: every RPC and every REST route, and who holds each permission.

Each entry of :data:`RPCS` (``"Service.Rpc"``) and :data:`ROUTES` (``"METHOD /path"``,
the route's canonical path) names exactly one permission. The gRPC interceptor and the
REST middleware look the caller's request up here and check it once, before any
adapter or operation runs; operations only make object-level checks (lattice_api.access).

Two names are not permissions: :data:`PUBLIC` (no identity needed: health, metrics,
OIDC discovery) and :data:`NOT_BUILT` (an RPC of the contract with no adapter yet; it
answers UNIMPLEMENTED to anyone, and the table test fails once an adapter implements it
while it is still marked so). ``tests/test_permissions.py`` fails when an RPC of a
served service or a registered route has no entry here, or an entry names nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from lattice_common.errors import PermissionDenied

from lattice_api.auth import Identity, Role

PUBLIC = "public"
NOT_BUILT = "unimplemented"

# --- who holds each permission ----------------------------------------------------------

# agents and internal services read what they need; a bootstrap identity reads nothing
_READ = frozenset(Role) - {Role.AGENT, Role.BOOTSTRAP, Role.SERVICE, Role.QUOTA_SERVICE}
_WRITE_OWN = frozenset(
    {Role.SYSTEM_ADMIN, Role.TENANT_ADMIN, Role.OPERATOR, Role.CLAIMING_USER, Role.USER}
)
ROLES: dict[str, frozenset[Role]] = {
    "allocation.read": _READ | {Role.AGENT, Role.SERVICE},
    "allocation.submit": _WRITE_OWN,
    "allocation.cancel": _WRITE_OWN,
    "allocation.launch": _WRITE_OWN,
    "allocation.attach": _WRITE_OWN,  # the owner only (sensitive: the claiming user)
    # change a running allocation (its telemetry mode): the owner, a tenant admin of its
    # tenant, a system admin (lattice_api.access.check_update)
    "allocation.update": _WRITE_OWN,
    "allocation.list_all": frozenset(
        {Role.SYSTEM_ADMIN, Role.TENANT_ADMIN, Role.OPERATOR, Role.READ_ONLY}
    ),
    "node.read": _READ | {Role.AGENT, Role.SERVICE},
    "node.admin": frozenset({Role.SYSTEM_ADMIN, Role.OPERATOR, Role.TENANT_ADMIN}),
    "node.agent": frozenset({Role.AGENT, Role.SYSTEM_ADMIN}),
    "node.release": frozenset({Role.SYSTEM_ADMIN, Role.CLAIMING_USER}),
    "tenant.read": _READ,
    "tenant.admin": frozenset({Role.SYSTEM_ADMIN}),
    # PUT /api/v1/tenants/{name}: system admins (any field), and the budget authority's
    # service token (Waldur), which lattice_api.ops.admin.put_tenant limits to quotas
    "tenant.quota": frozenset({Role.SYSTEM_ADMIN, Role.QUOTA_SERVICE}),
    "vcluster.read": _READ,
    "vcluster.admin": frozenset({Role.SYSTEM_ADMIN}),
    "raft.read": _READ,
    # service discovery; which tenants' services is lattice_api.access.service_tenants
    "service.read": _READ,
    # the nodes' uenv image caches: anyone reads them, system admins warm and evict
    "cache.read": _READ,
    "cache.admin": frozenset({Role.SYSTEM_ADMIN}),
    # the audit log: tenant admins query their own tenant's entries (lattice_api.ops.audit);
    # exporting and verifying the whole log is for system admins
    "audit.read": frozenset({Role.SYSTEM_ADMIN, Role.TENANT_ADMIN}),
    "audit.admin": frozenset({Role.SYSTEM_ADMIN}),
    "quorum.internal": frozenset({Role.SYSTEM_ADMIN, Role.AGENT, Role.SERVICE}),
    # the internal CA: its certificate is public to anyone authenticated; a node agent
    # (its bootstrap or current certificate) asks for its own certificate
    "pki.read": frozenset(Role),
    "pki.admin": frozenset({Role.SYSTEM_ADMIN}),
    "node.certificate": frozenset({Role.AGENT, Role.BOOTSTRAP, Role.SYSTEM_ADMIN}),
    # who the caller is (`lattice whoami`): anyone authenticated
    "auth.whoami": frozenset(Role),
    # backups of the whole quorum state (every tenant's records, the CA key)
    "backup.admin": frozenset({Role.SYSTEM_ADMIN}),
    # accounting (lattice_api.ops.accounting): balances, transactions, costs and prices
    # are read by people (which tenant: check_tenant/check_project there); transfers by
    # system and tenant admins (their tenant); top-ups, prices, status, reconcile by
    # system admins
    "accounting.read": _READ,
    "accounting.transfer": frozenset({Role.SYSTEM_ADMIN, Role.TENANT_ADMIN}),
    "accounting.admin": frozenset({Role.SYSTEM_ADMIN}),
}
_ADMIN_ONLY = frozenset({Role.SYSTEM_ADMIN})  # any permission not listed in ROLES

# --- gRPC: "Service.Rpc" -> permission (services served by lattice-server) --------------

RPCS: dict[str, str] = {
    "AllocationService.Submit": "allocation.submit",
    "AllocationService.Get": "allocation.read",
    "AllocationService.List": "allocation.read",
    "AllocationService.Cancel": "allocation.cancel",
    "AllocationService.Update": "allocation.update",  # telemetry mode only, so far
    "AllocationService.Watch": "allocation.read",
    # checkpoint now and run on: the owner's (or an admin's), like cancel
    "AllocationService.Checkpoint": "allocation.cancel",
    "AllocationService.LaunchTasks": "allocation.launch",
    "AllocationService.WatchLaunch": "allocation.read",
    "AllocationService.Attach": "allocation.attach",
    "AllocationService.StreamLogs": "allocation.read",
    "AllocationService.GetLogs": "allocation.read",
    "AllocationService.QueryMetrics": "allocation.read",
    "AllocationService.StreamMetrics": "allocation.read",
    "AllocationService.GetDiagnostics": "allocation.read",
    "AllocationService.CompareMetrics": "allocation.read",
    "AllocationService.GetDag": "allocation.read",
    "AllocationService.ListDags": "allocation.read",
    "AllocationService.CancelDag": "allocation.cancel",
    # suspend / resume on demand: the owner's (or an admin's), like cancel
    "AllocationService.Suspend": "allocation.cancel",
    "AllocationService.Resume": "allocation.cancel",
    "AllocationService.CreateSession": "allocation.submit",
    "AllocationService.GetSession": "allocation.read",
    "AllocationService.DeleteSession": "allocation.cancel",
    "NodeService.ListNodes": "node.read",
    "NodeService.GetNode": "node.read",
    "NodeService.DrainNode": "node.admin",
    "NodeService.UndrainNode": "node.admin",
    "NodeService.DisableNode": "node.admin",
    "NodeService.EnableNode": "node.admin",
    "NodeService.ReleaseNodeClaim": "node.release",
    "NodeService.RegisterNode": "node.agent",
    "NodeService.Heartbeat": "node.agent",
    "NodeService.BatchHeartbeat": "node.agent",
    "NodeService.WatchDesiredState": "node.agent",
    "NodeService.GetNodeHealth": NOT_BUILT,
    "NodeService.CacheStatus": "cache.read",
    "NodeService.WarmCache": "cache.admin",
    "NodeService.EvictCache": "cache.admin",
    "NodeService.SignNodeCertificate": "node.certificate",
    "NodeService.ReportFileAccess": "node.agent",
    "AdminService.CreateTenant": "tenant.admin",
    "AdminService.ListTenants": "tenant.read",
    "AdminService.GetTenant": "tenant.read",
    "AdminService.UpdateTenant": "tenant.admin",
    "AdminService.DeleteTenant": NOT_BUILT,
    "AdminService.CreateVCluster": "vcluster.admin",
    "AdminService.ListVClusters": "vcluster.read",
    "AdminService.GetVCluster": "vcluster.read",
    "AdminService.UpdateVCluster": "vcluster.admin",
    "AdminService.DeleteVCluster": NOT_BUILT,
    "AdminService.GetVClusterQueue": "vcluster.read",
    "AdminService.GetRaftStatus": "raft.read",
    "AdminService.CreateBackup": "backup.admin",
    "AdminService.VerifyBackup": "backup.admin",
    "AdminService.RestoreBackup": "backup.admin",
    "AdminService.QueryAudit": "audit.read",
    "AdminService.ExportAudit": "audit.admin",
    "AdminService.VerifyAudit": "audit.admin",
    "AdminService.InitCertificateAuthority": "pki.admin",
    "AdminService.GetCertificateAuthority": "pki.read",
    "AdminService.IssueCertificate": "pki.admin",
    "AdminService.GetAccountingUsage": NOT_BUILT,
    "AdminService.GetTenantUsage": "tenant.read",
    "AdminService.GetUserUsage": "tenant.read",
    "AdminService.LookupService": "service.read",
    "AdminService.ListServices": "service.read",
    "AccountingService.GetBalance": "accounting.read",
    "AccountingService.TopUp": "accounting.admin",
    "AccountingService.Transfer": "accounting.transfer",
    "AccountingService.ListTransactions": "accounting.read",
    "AccountingService.GetCosts": "accounting.read",
    "AccountingService.SetPrice": "accounting.admin",
    "AccountingService.ListPrices": "accounting.read",
    "AccountingService.GetAccountingStatus": "accounting.admin",
    "AccountingService.Reconcile": "accounting.admin",
    "QuorumService.Propose": "quorum.internal",
    "QuorumService.Read": NOT_BUILT,
    "QuorumService.WatchState": "quorum.internal",
}

# --- REST: "METHOD canonical-path" -> permission -----------------------------------------

_NODE_ACTION = "POST /api/v1/nodes/{id}/"
ROUTES: dict[str, str] = {
    "GET /healthz": PUBLIC,
    "GET /metrics": PUBLIC,
    "GET /api/v1/auth/discovery": PUBLIC,
    "GET /api/v1/auth/whoami": "auth.whoami",  # REST only: the proto has no such RPC
    "POST /api/v1/allocations": "allocation.submit",
    "GET /api/v1/allocations": "allocation.read",
    "GET /api/v1/allocations/{id}": "allocation.read",
    "DELETE /api/v1/allocations/{id}": "allocation.cancel",
    "POST /api/v1/allocations/{id}/suspend": "allocation.cancel",
    "POST /api/v1/allocations/{id}/resume": "allocation.cancel",
    "POST /api/v1/allocations/{id}/checkpoint": "allocation.cancel",
    "GET /api/v1/allocations/{id}/watch": "allocation.read",
    "POST /api/v1/sessions": "allocation.submit",
    "GET /api/v1/sessions": "allocation.read",
    "GET /api/v1/sessions/{id}": "allocation.read",
    "DELETE /api/v1/sessions/{id}": "allocation.cancel",
    "GET /api/v1/allocations/{id}/logs": "allocation.read",
    "POST /api/v1/allocations/{id}/tasks": "allocation.launch",
    "GET /api/v1/allocations/{id}/attach": "allocation.attach",  # WebSocket
    "GET /api/v1/allocations/{id}/tasks/{task_id}/events": "allocation.read",
    "GET /api/v1/allocations/{id}/logs/stream": "allocation.read",
    # `lattice top`: the allocation's metrics from the TSDB (visible allocations only)
    "GET /api/v1/allocations/{id}/metrics": "allocation.read",
    # `lattice watch`: the agents' live metrics and alerts, fanned in (NDJSON)
    "GET /api/v1/allocations/{id}/metrics/stream": "allocation.read",
    # `lattice telemetry`: switch the telemetry mode on the allocation's nodes
    "PATCH /api/v1/allocations/{id}": "allocation.update",
    # `lattice diag`: network, storage and GPU health through the agents and the TSDB
    "GET /api/v1/allocations/{id}/diagnostics": "allocation.read",
    "GET /api/v1/allocations/{id}/diagnostics/{section}": "allocation.read",
    # `lattice compare`: several allocations' metrics, each one visible to the caller
    "GET /api/v1/compare": "allocation.read",
    # DAG workflows: submitting one is submitting its allocations; cancelling one, its
    # submitter's or an admin's (lattice_api.access.check_dag_cancel)
    "POST /api/v1/dags": "allocation.submit",
    "GET /api/v1/dags": "allocation.read",
    "GET /api/v1/dags/{id}": "allocation.read",
    "DELETE /api/v1/dags/{id}": "allocation.cancel",
    "GET /api/v1/nodes": "node.read",
    "POST /api/v1/nodes/register": "node.agent",
    "GET /api/v1/nodes/{id}": "node.read",
    "POST /api/v1/nodes/{id}/heartbeat": "node.agent",
    "POST /api/v1/nodes/heartbeats": "node.agent",
    _NODE_ACTION + "drain": "node.admin",
    _NODE_ACTION + "undrain": "node.admin",
    _NODE_ACTION + "disable": "node.admin",
    _NODE_ACTION + "enable": "node.admin",
    _NODE_ACTION + "release": "node.release",
    # the nodes' uenv image caches (lattice cache status|warm|evict)
    "GET /api/v1/cache": "cache.read",
    "POST /api/v1/cache/warm": "cache.admin",
    "POST /api/v1/cache/evict": "cache.admin",
    "GET /api/v1/tenants": "tenant.read",
    "POST /api/v1/tenants": "tenant.admin",
    "GET /api/v1/tenants/{name}": "tenant.read",
    "PATCH /api/v1/tenants/{name}": "tenant.admin",
    "PUT /api/v1/tenants/{name}": "tenant.quota",
    # usage: every role but the agents'; another user's usage is an object-level check
    "GET /api/v1/tenants/{name}/usage": "tenant.read",
    "GET /api/v1/usage": "tenant.read",
    "GET /api/v1/vclusters": "vcluster.read",
    "POST /api/v1/vclusters": "vcluster.admin",
    "GET /api/v1/vclusters/{name}": "vcluster.read",
    "PATCH /api/v1/vclusters/{name}": "vcluster.admin",
    # the caller's own entries; everyone's needs allocation.list_all (lattice_api.access)
    "GET /api/v1/vclusters/{name}/queue": "vcluster.read",
    "GET /api/v1/raft/status": "raft.read",
    # service discovery, tenant-filtered (lattice_api.access.service_tenants)
    "GET /api/v1/services": "service.read",
    "GET /api/v1/services/{name}": "service.read",
    # the audit log (also at the specification's /api/v1/audit)
    "GET /api/v1/admin/audit": "audit.read",
    "GET /api/v1/audit": "audit.read",
    "GET /api/v1/admin/audit/export": "audit.admin",
    "POST /api/v1/admin/audit/verify": "audit.admin",
    # the internal CA
    "POST /api/v1/admin/ca": "pki.admin",
    "GET /api/v1/admin/ca": "pki.read",
    "POST /api/v1/admin/ca/issue": "pki.admin",
    "POST /api/v1/nodes/{id}/certificate": "node.certificate",
    # backups of the quorum state (spec: Administration, Backup & Restore)
    "POST /api/v1/admin/backup": "backup.admin",
    "GET /api/v1/admin/backup/verify": "backup.admin",
    "POST /api/v1/admin/restore": "backup.admin",
    # accounting (lattice-accounting's ledger, through lattice_api.ops.accounting)
    "GET /api/v1/accounts/balance": "accounting.read",
    "POST /api/v1/accounts/topup": "accounting.admin",
    "POST /api/v1/accounts/transfer": "accounting.transfer",
    "GET /api/v1/accounts/transactions": "accounting.read",
    "GET /api/v1/accounts/costs": "accounting.read",
    "GET /api/v1/accounts/allocations": "accounting.read",  # visible allocations only
    "GET /api/v1/admin/prices": "accounting.read",
    "POST /api/v1/admin/prices": "accounting.admin",
    "GET /api/v1/admin/accounting/status": "accounting.admin",
    "POST /api/v1/admin/accounting/reconcile": "accounting.admin",
}


def _with_head(routes: Mapping[str, str]) -> dict[str, str]:
    """aiohttp answers HEAD on every GET route: same permission."""
    out = dict(routes)
    for key, perm in routes.items():
        if key.startswith("GET "):
            out["HEAD " + key[4:]] = perm
    return out


# What the interceptor and the middleware look up: one dict access per request.
RPC_BY_PATH: dict[str, str] = {
    "/lattice.v1." + name.replace(".", "/"): perm for name, perm in RPCS.items()
}
ROUTE_PERMISSIONS: dict[str, str] = _with_head(ROUTES)


def allowed(identity: Identity, permission: str) -> bool:
    return identity.role in ROLES.get(permission, _ADMIN_ONLY)


def authorize(identity: Identity, permission: str) -> None:
    """Raise PermissionDenied unless the caller's role holds ``permission``."""
    if identity.role not in ROLES.get(permission, _ADMIN_ONLY):
        raise PermissionDenied(
            f"{identity.user} ({identity.role.value}) may not perform {permission}",
            hint="Ask your tenant or system administrator for the needed role.",
        )


__all__ = [
    "NOT_BUILT",
    "PUBLIC",
    "ROLES",
    "ROUTES",
    "ROUTE_PERMISSIONS",
    "RPCS",
    "RPC_BY_PATH",
    "allowed",
    "authorize",
]
