"""Service discovery (AdminService.LookupService/ListServices, ``/api/v1/services``):
the quorum's service registry, where the exposed ports of running service allocations
answer (lattice_quorum.handlers.services keeps it).

Tenant-filtered (spec: Security, Service Discovery Isolation): whose services a caller
sees is :func:`lattice_api.access.service_tenants` (its tenant; operators and system
admins every tenant, or the one they name).
"""

from __future__ import annotations

import msgspec
from lattice_common.errors import NotFound, ValidationError
from lattice_common.types import ServiceEndpoint
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api import access
from lattice_api.auth import Identity

__all__ = ["Service", "ServiceOps"]


class Service(msgspec.Struct, kw_only=True):
    """A service name with its endpoints (the REST and SDK shape)."""

    name: str
    endpoints: list[ServiceEndpoint] = msgspec.field(default_factory=list)


class ServiceOps:
    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum

    def list_services(self, who: Identity, tenant: str | None = None) -> list[Service]:
        """Every service the caller may see, by name, with its endpoints."""
        tenants = access.service_tenants(who, tenant)
        found = self.quorum.read(queries.services, tenants)
        return [Service(name=n, endpoints=eps) for n, eps in found.items()]

    def lookup(self, who: Identity, name: str, tenant: str | None = None) -> Service:
        """The endpoints of ``name``; NotFound when the caller sees none."""
        name = (name or "").strip()
        if not name:
            raise ValidationError(
                "a service name is required", hint="List them with `lattice services`."
            )
        tenants = access.service_tenants(who, tenant)
        eps = self.quorum.read(queries.service, name, tenants)
        if not eps:
            raise NotFound(
                f'no service "{name}" is registered',
                hint="A service is registered while an allocation exposing it runs; "
                "list them with `lattice services`.",
            )
        return Service(name=name, endpoints=eps)
