"""All the operations of one server, per proto service, built from one set of settings.

Both transports take an :class:`Operations` and reach each service's operations by
name (``ops.allocations.submit``, ``ops.usage.tenant_usage``, ...).
"""

from __future__ import annotations

from lattice_common.agents import AgentChannels
from lattice_quorum.quorum import Quorum

from lattice_api.fabric import FabricManager
from lattice_api.node_monitor import NodeMonitor
from lattice_api.ops.admin import AdminOps
from lattice_api.ops.allocations import AllocationOps, LogSource, uenv_resolver
from lattice_api.ops.attach import AttachOps
from lattice_api.ops.cache import CacheOps
from lattice_api.ops.dags import DagOps
from lattice_api.ops.launches import LaunchOps
from lattice_api.ops.nodes import NodeOps
from lattice_api.ops.queue import QueueOps
from lattice_api.ops.quorum import QuorumOps
from lattice_api.ops.services import ServiceOps
from lattice_api.ops.sessions import SessionOps
from lattice_api.ops.usage import UsageOps
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
    ) -> None:
        settings = settings or ApiSettings()
        self.settings = settings
        self.queue = QueueOps(quorum, budget_period_days=settings.budget_period_days)
        self.allocations = AllocationOps(
            quorum,
            logs,
            self.queue,
            uenv=uenv_resolver(settings.uenv_registry, settings.uenv_signing_key),
        )
        self.dags = DagOps(quorum, self.allocations, max_size=settings.max_dag_size)
        self.sessions = SessionOps(quorum, self.allocations)
        self.launches = LaunchOps(quorum, agents or AgentChannels(), fabric=fabric)
        self.attach = AttachOps(quorum, self.launches.agents)
        # the nodes' uenv caches, through their agents (NodeService.CacheStatus, ...)
        self.cache = CacheOps(quorum, self.launches.agents)
        self.nodes = NodeOps(quorum, monitor, api_addresses=settings.api_addresses)
        self.admin = AdminOps(
            quorum,
            api_addresses=settings.api_addresses,
            oidc_issuer=settings.oidc_issuer,
            oidc_client_id=settings.oidc_client_id,
        )
        self.usage = UsageOps(quorum, budget_period_days=settings.budget_period_days)
        self.quorum = QuorumOps(quorum)
        self.services = ServiceOps(quorum)


__all__ = ["Operations"]
