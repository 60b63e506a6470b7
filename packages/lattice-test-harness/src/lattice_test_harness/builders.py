"""Builders for allocation specs and node inventories (plain domain records)."""

from __future__ import annotations

import itertools
from typing import Any

from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    Constraints,
    Node,
    NodeCapabilities,
    NodeState,
    Tenant,
    VCluster,
)

_ids = itertools.count(1)


def spec(
    entrypoint: str = "true", *, tenant: str = "t", vcluster: str = "v", **kw: Any
) -> AllocationSpec:
    kw.setdefault("walltime_seconds", 3600)
    if isinstance(kw.get("constraints"), dict):
        kw["constraints"] = Constraints(**kw["constraints"])
    return AllocationSpec(entrypoint=entrypoint, tenant=tenant, vcluster=vcluster, **kw)


def allocation(
    *,
    id: str | None = None,
    state: AllocationState = AllocationState.PENDING,
    submitted_at: float = 0.0,
    **kw: Any,
) -> Allocation:
    return Allocation(
        id=id or f"a{next(_ids):07x}", spec=spec(**kw), state=state, submitted_at=submitted_at
    )


def node(
    node_id: str,
    *,
    group: int = 0,
    gpu_type: str = "",
    gpu_count: int = 0,
    features: list[str] | None = None,
    memory_gb: int = 256,
    state: NodeState = NodeState.READY,
    **kw: Any,
) -> Node:
    return Node(
        id=node_id,
        state=state,
        group=group,
        capabilities=NodeCapabilities(
            cpu_cores=64,
            memory_gb=memory_gb,
            gpu_type=gpu_type,
            gpu_count=gpu_count,
            features=features or [],
        ),
        **kw,
    )


def inventory(count: int, *, groups: int = 1, prefix: str = "n", **kw: Any) -> dict[str, Node]:
    """``count`` Ready nodes spread round-robin over ``groups`` topology groups."""
    return {
        f"{prefix}{i:04d}": node(f"{prefix}{i:04d}", group=i % groups, **kw) for i in range(count)
    }


def tenant(name: str = "t", **kw: Any) -> Tenant:
    return Tenant(name=name, **kw)


def vcluster(name: str = "v", **kw: Any) -> VCluster:
    return VCluster(name=name, **kw)
