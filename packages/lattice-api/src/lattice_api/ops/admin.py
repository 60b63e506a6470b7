"""AdminService operations: tenants, vClusters and Raft status; plus the member's health
the public REST routes serve. (Usage, also in AdminService, is lattice_api.ops.usage;
the login discovery document is lattice_api.ops.auth.)"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec
from lattice_common import audit
from lattice_common import commands as c
from lattice_common.errors import NotFound, PermissionDenied, ValidationError
from lattice_common.types import CostWeights, SchedulerType, Tenant, VCluster
from lattice_quorum import queries
from lattice_quorum.quorum import Quorum

from lattice_api.audit import AuditRecorder
from lattice_api.auth import Identity, Role
from lattice_api.ops.base import raise_if_error

#: what the budget authority's service token may set (spec: the PUT body of the Quota
#: Update Flow): the hard quotas and the GPU/node-hours budgets
QUOTA_FIELDS = frozenset(
    {"max_nodes", "max_concurrent_allocations", "gpu_hours_budget", "node_hours_budget"}
)


def _shown(t: Tenant) -> Tenant:
    """A tenant as the API answers it: without the quorum's internal ledger totals
    (``retired_usage``: the usage operations report usage)."""
    return msgspec.structs.replace(t, retired_usage={}) if t.retired_usage else t


def _set_fields(record: Tenant | VCluster) -> dict[str, Any]:
    """What a created record says beyond its defaults (for its audit entry)."""
    fields = msgspec.to_builtins(record)
    defaults = msgspec.to_builtins(type(record)(name=record.name))
    return {
        k: v
        for k, v in fields.items()
        if k not in ("name", "created_at", "revision") and v != defaults.get(k)
    }


def _check_quota_values(*vals: Any) -> None:
    for v in vals:
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValidationError(f"quota values must be whole numbers >= 0 (got {v!r})")


def _check_class(v: Any) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 10):
        raise ValidationError(
            f"max_preemption_class must be a whole number from 0 to 10 (got {v!r})",
            hint="Classes run from 0 (preempted first) to 10 (never preempted).",
        )


class AdminOps:
    def __init__(
        self,
        quorum: Quorum,
        *,
        api_addresses: Mapping[str, str],
        audit: AuditRecorder | None = None,
    ) -> None:
        self.quorum = quorum
        self.api_addresses = dict(api_addresses)
        self.audit = audit  # tenant and vCluster changes are recorded (lattice_api.audit)

    def _record(self, who: Identity, action: str, target: str, tenant: str, fields: Any) -> None:
        if self.audit is not None:
            self.audit.record(who.user, action, target, tenant=tenant, details=fields)

    # --- tenants --------------------------------------------------------------------

    def list_tenants(self, who: Identity) -> list[Tenant]:
        return [_shown(t) for t in self.quorum.read(queries.tenants)]

    def get_tenant(self, who: Identity, name: str) -> Tenant:
        t = self.quorum.read(queries.tenant, name)
        if t is None:
            raise NotFound(
                f'tenant "{name}" not found', hint="List tenants with `lattice admin tenant list`."
            )
        return _shown(t)

    async def create_tenant(self, who: Identity, body: dict[str, Any]) -> Tenant:
        name = str(body.get("name") or "").strip()
        if not name:
            raise ValidationError("tenant name is required", hint="Pass --name.")
        try:
            t = msgspec.convert({**body, "name": name}, Tenant)
        except msgspec.ValidationError as e:
            raise ValidationError(f"invalid tenant: {e}") from None
        _check_quota_values(t.max_nodes, t.max_concurrent_allocations)
        _check_class(t.max_preemption_class)
        res = raise_if_error(await self.quorum.propose(c.CreateTenant(tenant=t, now=time.time())))
        assert res.tenant is not None
        self._record(who, audit.TENANT_CREATE, f"tenant:{t.name}", t.name, _set_fields(t))
        return _shown(res.tenant)

    async def update_tenant(self, who: Identity, name: str, fields: dict[str, Any]) -> Tenant:
        fields = {k: v for k, v in fields.items() if k != "name"}
        _check_quota_values(fields.get("max_nodes"), fields.get("max_concurrent_allocations"))
        _check_class(fields.get("max_preemption_class"))
        res = raise_if_error(
            await self.quorum.propose(c.UpdateTenant(name=name, fields=fields, now=time.time()))
        )
        assert res.tenant is not None
        self._record(who, audit.TENANT_UPDATE, f"tenant:{name}", name, fields)
        return _shown(res.tenant)

    async def put_tenant(self, who: Identity, name: str, fields: dict[str, Any]) -> Tenant:
        """``PUT /api/v1/tenants/{name}`` (spec: Quota Update Flow): a system admin
        updates like ``PATCH``; the budget authority's service token (Waldur, role
        ``quota-service``) may set the quota fields only. Hard quotas are committed
        through the quorum like any tenant update: new work is held to them at once,
        running work is never preempted for them."""
        if who.role == Role.QUOTA_SERVICE:
            if not isinstance(fields, dict) or not fields:
                raise ValidationError(
                    "no quota fields given",
                    details={"allowed": ", ".join(sorted(QUOTA_FIELDS))},
                    hint='Send a JSON object such as {"max_nodes": 100}.',
                )
            other = sorted(k for k in fields if k not in QUOTA_FIELDS)
            if other:
                raise PermissionDenied(
                    f"{who.user} ({who.role.value}) may change quotas only, not {', '.join(other)}",
                    details={"allowed": ", ".join(sorted(QUOTA_FIELDS))},
                    hint="A quota-update service token sets max_nodes, "
                    "max_concurrent_allocations, gpu_hours_budget and node_hours_budget.",
                )
            for k in ("gpu_hours_budget", "node_hours_budget"):
                v = fields.get(k)
                if v is not None and (
                    isinstance(v, bool) or not isinstance(v, int | float) or v < 0
                ):
                    raise ValidationError(f"{k} must be a number >= 0 or null (got {v!r})")
        return await self.update_tenant(who, name, fields)

    # --- vClusters ------------------------------------------------------------------

    def list_vclusters(self, who: Identity) -> list[VCluster]:
        return self.quorum.read(queries.vclusters)

    def get_vcluster(self, who: Identity, name: str) -> VCluster:
        v = self.quorum.read(queries.vcluster, name)
        if v is None:
            raise NotFound(
                f'vCluster "{name}" not found',
                hint="List vClusters with `lattice admin vcluster list`.",
            )
        return v

    async def create_vcluster(self, who: Identity, body: dict[str, Any]) -> VCluster:
        name = str(body.get("name") or "").strip()
        if not name:
            raise ValidationError("vCluster name is required", hint="Pass --name.")
        st = str(body.get("scheduler_type") or "hpc-backfill")
        if st not in {s.value for s in SchedulerType}:
            raise ValidationError(
                f"unknown scheduler type {st!r}",
                details={"available": ", ".join(s.value for s in SchedulerType)},
            )
        try:
            v = msgspec.convert({**body, "name": name, "scheduler_type": st}, VCluster)
        except msgspec.ValidationError as e:
            raise ValidationError(f"invalid vCluster: {e}") from None
        if v.cycle_interval_seconds <= 0:
            raise ValidationError("cycle_interval_seconds must be greater than zero")
        res = raise_if_error(
            await self.quorum.propose(c.CreateVCluster(vcluster=v, now=time.time()))
        )
        assert res.vcluster is not None
        self._record(who, audit.VCLUSTER_CREATE, f"vcluster:{name}", v.tenant, _set_fields(v))
        return res.vcluster

    async def update_vcluster(self, who: Identity, name: str, fields: dict[str, Any]) -> VCluster:
        fields = {k: v for k, v in fields.items() if k != "name"}
        if "weights" in fields:
            try:
                msgspec.convert(fields["weights"], CostWeights)
            except msgspec.ValidationError as e:
                raise ValidationError(f"invalid weights: {e}") from None
        res = raise_if_error(
            await self.quorum.propose(c.UpdateVCluster(name=name, fields=fields, now=time.time()))
        )
        assert res.vcluster is not None
        self._record(who, audit.VCLUSTER_UPDATE, f"vcluster:{name}", res.vcluster.tenant, fields)
        return res.vcluster

    # --- the member -----------------------------------------------------------------

    def raft_status(self, who: Identity) -> dict[str, Any]:
        """The member's Raft status plus ``leader_api_address`` (where clients go)."""
        st = self.quorum.status()
        leader = st.get("leader_address") or ""
        st["leader_api_address"] = self.api_addresses.get(leader, "")
        return st

    def health(self) -> dict[str, Any]:
        st = self.quorum.status()  # also refreshes the Raft gauges
        return {
            "status": "ok",
            "member_id": st["member_id"],
            "is_leader": st["is_leader"],
            "leader_address": st["leader_address"],
            "revision": st["revision"],
        }

    def refresh_gauges(self) -> None:
        self.quorum.status()


__all__ = ["AdminOps"]
