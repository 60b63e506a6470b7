"""Small helpers shared by the cross-package tests in this folder (quorum failover and
ownership races).

Everything here talks to a real local cluster (lattice_test_harness.ClusterHandle) or
reads a real agent's state file; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any

from lattice_test_harness.cluster import TERMINAL, ApiError, ClusterHandle


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def agent_state(h: ClusterHandle, node_id: str) -> list[dict[str, Any]]:
    path = h.cluster.base / "agents" / node_id / "agent-state.json"
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
        allocs = data.get("allocations", []) if isinstance(data, dict) else data
        return [a for a in allocs if isinstance(a, dict)]
    return []


def pgid_of(h: ClusterHandle, alloc_id: str, node_id: str, timeout: float = 10.0) -> int:
    """The process group the agent on ``node_id`` runs ``alloc_id`` in (its state file)."""

    def find() -> int | None:
        for rec in agent_state(h, node_id):
            if rec.get("id") == alloc_id and rec.get("pgid"):
                return int(rec["pgid"])
        return None

    return h.wait_for(f"pgid of {alloc_id} in {node_id}'s state file", find, timeout)


def wait_idle(h: ClusterHandle, timeout: float = 30.0) -> None:
    """Every agent's node Ready and free, no allocation still holding nodes."""

    def idle() -> bool:
        nodes = h.nodes()
        return len(nodes) >= len(h.cluster.agents) and all(
            n["state"] == "Ready" and not n["owner"] for n in nodes
        )

    h.wait_for("all nodes Ready and free", idle, timeout, interval=0.1)


def cancel_quietly(h: ClusterHandle, *ids: str) -> None:
    for i in ids:
        with contextlib.suppress(ApiError, OSError):
            if h.get(i)["state"] not in TERMINAL:
                h.cancel(i)


def create_vcluster_without_scheduler(h: ClusterHandle, name: str | None = None) -> str:
    """A vCluster no scheduler process serves: its allocations stay Pending."""
    name = name or unique("idle-vc")
    assert name not in h.cluster.schedulers
    h.request("POST", "/api/v1/vclusters", {"name": name, "scheduler_type": "hpc-backfill"})
    return name
