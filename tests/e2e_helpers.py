"""Small helpers shared by the cross-package end-to-end tests in this folder.

Everything here talks to a real local cluster (lattice_test_harness.ClusterHandle)
or looks at real processes on this machine (/proc); nothing is mocked.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from lattice_test_harness.cluster import TERMINAL, ApiError, ClusterHandle


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def sleep_marker() -> int:
    """A sleep duration nobody else on this machine uses: its argv is our marker."""
    return random.randint(600_000, 699_999)


def procs_with(marker: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``marker``."""
    out = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if marker in cmd and stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


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


def agent_of(h: ClusterHandle, node_id: str) -> Any:
    return next(a for a in h.cluster.agents if a.node_id == node_id)


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


class StatePoller:
    """Records the distinct states of one allocation in a background thread, so that
    states are observed while the test does other things (kill an agent, ...)."""

    def __init__(self, h: ClusterHandle, alloc_id: str, interval: float = 0.02) -> None:
        self.h = h
        self.alloc_id = alloc_id
        self.interval = interval
        self.seen: list[str] = []
        self.records: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StatePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                a = self.h.get(self.alloc_id)
            except (ApiError, OSError):
                time.sleep(self.interval)
                continue
            if not self.seen or self.seen[-1] != a["state"]:
                self.seen.append(a["state"])
                self.records.append(a)
            time.sleep(self.interval)
