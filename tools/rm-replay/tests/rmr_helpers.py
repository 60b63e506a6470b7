"""Small builders shared by RM-Replay's tests (not a test module)."""

from __future__ import annotations

from typing import Any

from rm_replay.inventory import inventory_from_mapping
from rm_replay.model import Inventory, SubmitEvent

T0 = 1_772_323_200.0  # 2026-03-01T00:00:00Z
H = 3600.0


def inventory(
    nodes: int = 4,
    *,
    groups: int = 1,
    gpus: int = 0,
    gpu_type: str = "",
    extra: list[dict[str, Any]] | None = None,
    **top: Any,
) -> Inventory:
    """One node class ``n`` of ``nodes`` nodes (ids n-0, n-1, ...), plus ``extra`` classes."""
    cls: dict[str, Any] = {"name": "n", "count": nodes, "groups": groups, "gpus": gpus}
    if gpu_type:
        cls["gpu_type"] = gpu_type
    return inventory_from_mapping({"name": "test", "node_classes": [cls, *(extra or [])], **top})


def submit(
    aid: str,
    t: float,
    *,
    nodes: int = 1,
    walltime: float = H,
    runtime: float | None = None,
    tenant: str = "t",
    **kw: Any,
) -> SubmitEvent:
    """A submission at T0 + t with an inline runtime (default: the walltime)."""
    return SubmitEvent(
        t=T0 + t,
        id=aid,
        tenant=tenant,
        nodes=nodes,
        walltime=walltime,
        runtime=walltime if runtime is None else runtime,
        **kw,
    )
