"""A thousand nodes on one quorum member: the bounded version of the scale benchmark.

1,000 simulated agents (lattice_test_harness.simagents, 2 processes, the real agent
protocol) register with a real 1-member lattice-server, heartbeat every 5 s for a
minute and keep one desired-state stream each. Every node stays Ready the whole time
(the quorum's own state stream shows no node ever Degraded or Down), and a task group
of one-node jobs is placed by the real scheduler, run by the simulated agents and
completes. Figures (CPU, cycle time) are for scripts/bench/scale.py, not asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from lattice_common.rpc import Endpoints, RemoteQuorum
from lattice_test_harness.simagents import SimFleet

pytestmark = pytest.mark.cluster

NODES = 1_000
PROCESSES = 2
INTERVAL = 5.0  # heartbeat interval of the agents and the quorum
TIMEOUT = 20.0  # heartbeat_timeout: silence before Degraded
STEADY = 60.0  # a minute of heartbeats
JOBS = 200


class NodeStateWatch:
    """Every node state the quorum commits, from its WatchState stream (in a thread)."""

    def __init__(self, endpoints: str) -> None:
        self.endpoints = endpoints
        self.bad: dict[str, str] = {}  # node -> the non-Ready state it was put in
        self.deltas = 0
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(self._watch())
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._task)

    async def _watch(self) -> None:
        q = RemoteQuorum(Endpoints(self.endpoints))
        try:
            async for d in q.watch():
                self._ready.set()
                self.deltas += 1
                for n in d.nodes:
                    if n.state in ("Degraded", "Down"):
                        self.bad.setdefault(n.id, f"{n.state} ({n.state_reason})")
        finally:
            q.endpoints.close()

    def start(self) -> NodeStateWatch:
        self._thread.start()
        assert self._ready.wait(30), "the quorum's state stream did not start"
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)


def _states(h: Any) -> Counter[str]:
    return Counter(n["state"] for n in h.nodes())


def test_thousand_simulated_nodes_stay_ready_and_run_work(
    cluster_factory: Any, tmp_path: Path
) -> None:
    h = cluster_factory(
        members=1,
        agents=0,
        heartbeat_interval=INTERVAL,
        heartbeat_timeout=TIMEOUT,
        grace_period=30.0,
        cycle_interval=1.0,
    )
    endpoints = h.cluster.grpc_endpoints
    with SimFleet(
        endpoints, NODES, PROCESSES, tmp_path / "sim", heartbeat_interval=INTERVAL, run_seconds=1.0
    ) as fleet:
        ready = fleet.wait_ready(timeout=180)
        assert sum(r["nodes"] for r in ready) == NODES
        h.wait_for(
            f"{NODES} nodes Ready",
            lambda: _states(h)["Ready"] == NODES,
            timeout=60,
            interval=1.0,
        )
        watch = NodeStateWatch(endpoints).start()
        t0 = time.monotonic()
        try:
            group = h.submit("true", nodes=1, walltime="10m", task_group=f"0-{JOBS - 1}")
            ids = set(group["allocation_ids"])
            assert len(ids) == JOBS

            def all_completed() -> bool:
                done = Counter(a["state"] for a in h.allocations() if a["id"] in ids)
                return done["Completed"] == JOBS

            h.wait_for(f"{JOBS} jobs Completed", all_completed, timeout=STEADY, interval=1.0)
            time.sleep(max(0.0, STEADY - (time.monotonic() - t0)))  # the rest of the minute
        finally:
            watch.stop()
        status = fleet.status()
        final = _states(h)
    assert watch.bad == {}, f"nodes left Ready during {STEADY:.0f}s of heartbeats: {watch.bad}"
    assert final == {"Ready": NODES}, final
    # the agents really heartbeat the whole minute (about STEADY / INTERVAL each) and
    # were never refused
    assert status["heartbeats"] >= NODES * (STEADY / INTERVAL) * 0.7, status
    assert status["rate_limited"] == 0, status
    assert status["started"] >= JOBS and status["exited"] >= JOBS, status
