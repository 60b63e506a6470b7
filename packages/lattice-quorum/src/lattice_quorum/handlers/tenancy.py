"""Command handlers for tenants and vClusters: create, and update of the fields an
administrator may change (merged over the current record and validated as a whole).
"""

from __future__ import annotations

import msgspec
from lattice_common import commands as c
from lattice_common.errors import AlreadyExists, NotFound, ValidationError
from lattice_common.types import CostWeights, Tenant, VCluster

from lattice_quorum.global_state import Changes, GlobalState
from lattice_quorum.handlers.common import bump

_TENANT_FIELDS = {
    "max_nodes",
    "max_concurrent_allocations",
    "fair_share_target",
    "burst_allowance",
    "gpu_hours_budget",
    "node_hours_budget",
    "isolation",
    "max_preemption_class",
}
_VCLUSTER_FIELDS = {
    "scheduler_type",
    "tenant",
    "weights",
    "cycle_interval_seconds",
    "backfill_depth",
    "allow_borrowing",
    "allow_user_suspend",
}


def create_tenant(state: GlobalState, cmd: c.CreateTenant, ch: Changes) -> c.CommandResult:
    t = cmd.tenant
    if t.name in state.tenants:
        raise AlreadyExists(
            f'tenant "{t.name}" already exists', hint="Use `lattice admin tenant update`."
        )
    bump(state)
    t.created_at = cmd.now
    t.revision = state.revision
    t.retired_usage = {}  # the ledger's totals are the quorum's own (handlers.retention)
    state.tenants[t.name] = t
    ch.tenants.add(t.name)
    return c.CommandResult(revision=state.revision, tenant=t)


def update_tenant(state: GlobalState, cmd: c.UpdateTenant, ch: Changes) -> c.CommandResult:
    t = state.tenants.get(cmd.name)
    if t is None:
        raise NotFound(
            f'tenant "{cmd.name}" not found', hint="List tenants with `lattice admin tenant list`."
        )
    unknown = set(cmd.fields) - _TENANT_FIELDS
    if unknown:
        raise ValidationError(f"unknown tenant fields: {', '.join(sorted(unknown))}")
    try:
        merged = msgspec.convert({**msgspec.to_builtins(t), **cmd.fields}, Tenant)
    except msgspec.ValidationError as e:
        raise ValidationError(f"invalid tenant update: {e}") from None
    bump(state)
    merged.revision = state.revision
    state.tenants[t.name] = merged
    ch.tenants.add(t.name)
    return c.CommandResult(revision=state.revision, tenant=merged)


def create_vcluster(state: GlobalState, cmd: c.CreateVCluster, ch: Changes) -> c.CommandResult:
    v = cmd.vcluster
    if v.name in state.vclusters:
        raise AlreadyExists(f'vCluster "{v.name}" already exists')
    if v.tenant and v.tenant not in state.tenants:
        raise NotFound(f'tenant "{v.tenant}" not found')
    bump(state)
    v.created_at = cmd.now
    v.revision = state.revision
    state.vclusters[v.name] = v
    ch.vclusters.add(v.name)
    return c.CommandResult(revision=state.revision, vcluster=v)


def update_vcluster(state: GlobalState, cmd: c.UpdateVCluster, ch: Changes) -> c.CommandResult:
    v = state.vclusters.get(cmd.name)
    if v is None:
        raise NotFound(f'vCluster "{cmd.name}" not found')
    unknown = set(cmd.fields) - _VCLUSTER_FIELDS
    if unknown:
        raise ValidationError(f"unknown vCluster fields: {', '.join(sorted(unknown))}")
    data = msgspec.to_builtins(v)
    for k, val in cmd.fields.items():
        if k == "weights" and isinstance(val, dict):
            bad = set(val) - set(CostWeights.__struct_fields__)
            if bad:
                raise ValidationError(
                    f"unknown cost weights: {', '.join(sorted(bad))}",
                    details={"available": ", ".join(CostWeights.__struct_fields__)},
                )
            data["weights"] = {**data["weights"], **val}
        else:
            data[k] = val
    try:
        merged = msgspec.convert(data, VCluster)
    except msgspec.ValidationError as e:
        raise ValidationError(f"invalid vCluster update: {e}") from None
    bump(state)
    merged.revision = state.revision
    state.vclusters[v.name] = merged
    ch.vclusters.add(v.name)
    return c.CommandResult(revision=state.revision, vcluster=merged)
