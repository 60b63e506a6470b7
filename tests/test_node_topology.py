"""On a real cluster: an agent reports its intra-node topology and conformance
fingerprint, both land on the node record (`lattice nodes ID -o json`), and an agent
that comes back with another fingerprint is recorded as drifted while work goes on."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.cluster


def test_topology_and_fingerprint_reach_the_node_record(cluster_factory) -> None:
    h = cluster_factory(members=1, agents=1)
    node = h.node("node-001")
    fp = node["conformance_group"]
    assert re.fullmatch(r"[0-9a-f]{64}", fp), fp  # computed: no --conformance-group given
    assert node["expected_conformance"] == fp and not node["conformance_drift"]
    caps = node["capabilities"]
    for field in ("gpus", "gpu_links", "memory_domains", "memory_interconnects"):
        assert isinstance(caps[field], list)
    # the CI machines are Linux: the NUMA domains come from /sys/devices/system/node
    assert caps["memory_domains"], caps
    assert sum(d["cpu_count"] for d in caps["memory_domains"]) >= 1

    out = h.cli("nodes", "node-001", "--output", "json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["conformance_group"] == fp
    assert shown["capabilities"]["memory_domains"] == caps["memory_domains"]

    # a running allocation, then the agent comes back with another fingerprint
    job = h.submit("sleep 30", walltime="5m")
    h.wait_state(job["id"], "Running")
    agent = h.cluster.agents[0]
    h.cluster.stop_agent(agent)
    agent.args = [*agent.args, "--conformance-group", "cg-other"]
    h.cluster.start_agent(agent)
    drifted = h.wait_for(
        "drift recorded",
        lambda: (n := h.node("node-001"))["conformance_group"] == "cg-other" and n,
        timeout=30,
    )
    assert drifted["conformance_drift"]
    assert drifted["expected_conformance"] == fp
    assert drifted["state_reason"] == f"conformance_drift: expected={fp}, actual=cg-other"
    assert drifted["owner"] == job["id"]
    assert h.get(job["id"])["state"] == "Running"  # drift never disturbs running work
    h.cancel(job["id"])
