"""The scrape-time gauges of lattice_api.cluster_metrics over a real (in-process) quorum:
what an operator's dashboard and the quota / Raft-disk alert rules read."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lattice_api.cluster_metrics import ClusterCollector
from lattice_common import commands as c
from lattice_common.types import AllocationState, NodeState
from lattice_test_harness.builders import spec
from prometheus_client import CollectorRegistry


def scrape(api: Any, data_dir: Path | None) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(api.quorum, data_dir))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


async def test_running_work_and_quotas_show_per_state_and_tenant(local_api: Any, tmp_path) -> None:
    api = local_api
    api.add_tenant("physics", max_nodes=4)
    api.add_tenant("bio")
    api.add_vcluster("hpc")
    for i in range(3):
        api.add_node(f"n{i}")
    a = api.submit(spec(tenant="physics", vcluster="hpc", nodes=2))
    api.submit(spec(tenant="physics", vcluster="hpc", nodes=1))  # stays pending
    api.start(a.id, ["n0", "n1"])
    (tmp_path / "raft.dump").write_bytes(b"x" * 1234)
    got = scrape(api, tmp_path)
    assert got[("lattice_allocations_active", (("state", "Running"),))] == 1
    assert got[("lattice_allocations_active", (("state", "Staging"),))] == 0
    assert got[("lattice_quota_used_nodes", (("tenant", "physics"),))] == 2
    assert got[("lattice_quota_used_nodes", (("tenant", "bio"),))] == 0
    assert got[("lattice_quota_max_nodes", (("tenant", "physics"),))] == 4
    assert ("lattice_quota_max_nodes", (("tenant", "bio"),)) not in got  # no hard quota
    assert got[("lattice_raft_snapshot_size_bytes", ())] == 1234
    used, total = (
        got[("lattice_raft_disk_used_bytes", ())],
        got[("lattice_raft_disk_total_bytes", ())],
    )
    assert 0 < used <= total
    api.set_state(a.id, AllocationState.COMPLETED)
    after = scrape(api, None)
    assert after[("lattice_quota_used_nodes", (("tenant", "physics"),))] == 0
    assert after[("lattice_allocations_active", (("state", "Running"),))] == 0
    assert ("lattice_raft_disk_total_bytes", ()) not in after  # no data dir: no disk series


async def test_nodes_by_state_are_counted_when_scraped(local_api: Any) -> None:
    api = local_api
    for i in range(3):
        api.add_node(f"s{i}")
    api.propose(c.SetNodeHealth(node_id="s2", state=NodeState.DOWN, reason="test", now=time.time()))
    got = scrape(api, None)
    assert got[("lattice_nodes_total", (("state", "Ready"),))] == 2
    assert got[("lattice_nodes_total", (("state", "Down"),))] == 1
    assert got[("lattice_nodes_total", (("state", "Draining"),))] == 0  # every state a series
