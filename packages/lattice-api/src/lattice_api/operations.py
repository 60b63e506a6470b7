"""All the operations of one server, per proto service, built from one set of settings.

Both transports take an :class:`Operations` and reach each service's operations by
name (``ops.allocations.submit``, ``ops.usage.tenant_usage``, ...).
"""

from __future__ import annotations

from lattice_common.agents import AgentChannels
from lattice_quorum.quorum import Quorum

from lattice_api.accounting_client import AccountingClient
from lattice_api.audit import AuditRecorder, load_signing_key
from lattice_api.fabric import FabricManager
from lattice_api.node_monitor import NodeMonitor
from lattice_api.oidc import OidcProvider
from lattice_api.ops.accounting import AccountingOps
from lattice_api.ops.admin import AdminOps
from lattice_api.ops.allocations import AllocationOps, LogSource, uenv_resolver
from lattice_api.ops.attach import AttachOps
from lattice_api.ops.audit import AuditOps
from lattice_api.ops.auth import AuthOps
from lattice_api.ops.backup import BackupOps
from lattice_api.ops.cache import CacheOps
from lattice_api.ops.compare import CompareOps
from lattice_api.ops.dags import DagOps
from lattice_api.ops.launches import LaunchOps
from lattice_api.ops.metrics import MetricsOps
from lattice_api.ops.nodes import NodeOps
from lattice_api.ops.pki import CertificateOps
from lattice_api.ops.queue import QueueOps
from lattice_api.ops.quorum import QuorumOps
from lattice_api.ops.services import ServiceOps
from lattice_api.ops.sessions import SessionOps
from lattice_api.ops.telemetry import TelemetryOps
from lattice_api.ops.usage import UsageOps
from lattice_api.ratelimit import RateLimiter
from lattice_api.settings import ApiSettings


class Operations:
    """A thin container: one operations object per service (AllocationService's task
    launches and DAGs apart, in ``launches`` and ``dags``), sharing the quorum."""

    def __init__(
        self,
        quorum: Quorum,
        *,
        monitor: NodeMonitor,
        logs: LogSource,
        settings: ApiSettings | None = None,
        agents: AgentChannels | None = None,
        fabric: FabricManager | None = None,
        oidc: OidcProvider | None = None,
        auth_mode: str = "",
    ) -> None:
        settings = settings or ApiSettings()
        self.settings = settings
        self.queue = QueueOps(quorum, budget_period_days=settings.budget_period_days)
        # the audit log: this server's signer (the operations record through it) and
        # AdminService's audit reads; leaders also sign the quorum's audit outbox
        self.recorder = AuditRecorder(
            quorum, load_signing_key(settings.audit_signing_key_path, settings.audit_key_dir)
        )
        quorum.on_leadership(self.recorder.on_leadership)
        self.audit = AuditOps(quorum, self.recorder)
        self.allocations = AllocationOps(
            quorum,
            logs,
            self.queue,
            uenv=uenv_resolver(settings.uenv_registry, settings.uenv_signing_key),
            audit=self.recorder,
        )
        # accounting (lattice-accounting's internal API): balances, prices, and the
        # reservation gate of every submit path (off: no client, the gate does nothing)
        self.accounting = AccountingOps(
            quorum,
            AccountingClient(
                settings.accounting_url,
                settings.accounting_token,
                timeout=settings.accounting_timeout,
            )
            if settings.accounting_url
            else None,
        )
        self.allocations.gate = self.accounting
        self.dags = DagOps(quorum, self.allocations, max_size=settings.max_dag_size)
        self.sessions = SessionOps(quorum, self.allocations)
        self.launches = LaunchOps(quorum, agents or AgentChannels(), fabric=fabric)
        # per-user limits, checked once by the REST middleware and the gRPC interceptor
        self.limiter = RateLimiter(settings.rate_limit)
        self.attach = AttachOps(
            quorum,
            self.launches.agents,
            user_limit=lambda u: self.limiter.limit(u, "attach"),
            audit=self.recorder,
        )
        # the nodes' uenv caches, through their agents (NodeService.CacheStatus, ...)
        self.cache = CacheOps(quorum, self.launches.agents)
        # live metrics and the telemetry mode (StreamMetrics, Update), through the agents
        self.telemetry = TelemetryOps(quorum, self.launches.agents, audit=self.recorder)
        self.nodes = NodeOps(
            quorum, monitor, api_addresses=settings.api_addresses, audit=self.recorder
        )
        self.admin = AdminOps(quorum, api_addresses=settings.api_addresses, audit=self.recorder)
        # the internal CA (AdminService CA RPCs, NodeService.SignNodeCertificate)
        self.pki = CertificateOps(quorum, settings.tls, audit=self.recorder)
        # backups of the state (lattice-server replaces it with one built from its config)
        self.backup = BackupOps(quorum, audit=self.recorder, data_dir=settings.audit_key_dir)
        # login discovery and whoami; ``oidc`` is the Authenticator's provider (one cache)
        self.auth = AuthOps(
            oidc_issuer=settings.oidc_issuer,
            oidc_client_id=settings.oidc_client_id,
            oidc=oidc,
            mode=auth_mode,
        )
        self.usage = UsageOps(quorum, budget_period_days=settings.budget_period_days)
        self.quorum = QuorumOps(quorum)
        self.services = ServiceOps(quorum)
        # QueryMetrics (`lattice top`): the TSDB, scoped to the allocation
        self.metrics = MetricsOps(
            quorum,
            tsdb_endpoint=settings.tsdb_endpoint,
            timeout=settings.tsdb_timeout,
            window=settings.telemetry_window_seconds,
            telemetry_mode=settings.telemetry_mode,
            audit=self.recorder,
        )
        # CompareMetrics (`lattice compare`): the same TSDB settings, several allocations
        self.compare = CompareOps(self.metrics)


__all__ = ["Operations"]
