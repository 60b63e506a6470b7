"""The sensitive-reservation scheduler on a real cluster: a sensitive allocation claims
its nodes for its user, the claim outlives the allocation, nobody else's work runs
there, and the claiming user releases the node back to the pool."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.cluster


def test_sensitive_claim_is_exclusive_until_released(cluster_factory) -> None:
    h = cluster_factory(members=1, agents=2, vclusters=("default", "sensitive"))
    h.user = "alice"
    first = h.submit("echo regulated", vcluster="sensitive", preemption_class=2)
    done = h.wait_state(first["id"], "Completed", timeout=30)
    assert done["spec"]["preemption_class"] == 10  # sensitive work is never preempted
    (claimed,) = done["assigned_nodes"]
    node = h.node(claimed)
    assert node["claimed_by"] == "alice" and node["owner"] == ""

    # the idle claimed node stays with alice: bob's batch work fills the other node,
    # then waits instead of using the claimed one
    h.user = "bob"
    blocker = h.submit("sleep 30", walltime="5m", preemption_class=9)
    running = h.wait_state(blocker["id"], "Running", timeout=20)
    assert running["assigned_nodes"] != [claimed]
    waiting = h.submit("true", walltime="5m", preemption_class=1)
    time.sleep(2.0)
    assert h.get(waiting["id"])["state"] == "Pending"

    # alice's next sensitive allocation goes back to her claimed node
    h.user = "alice"
    again = h.submit("echo again", vcluster="sensitive")
    assert h.wait_state(again["id"], "Completed", timeout=30)["assigned_nodes"] == [claimed]

    # only the claiming user (or an admin) may release; then bob's job gets the node
    released = h.cli("node", "release", claimed)
    assert released.returncode == 0, released.stderr
    assert "released" in released.stdout
    assert h.node(claimed)["claimed_by"] == ""
    assert h.wait_state(waiting["id"], "Completed", timeout=30)["assigned_nodes"] == [claimed]
    h.cancel(blocker["id"])


def test_releasing_an_unclaimed_node_is_refused_with_a_hint(lattice_cluster) -> None:
    h = lattice_cluster
    node_id = h.nodes()[0]["id"]
    out = h.cli("node", "release", node_id)
    assert out.returncode != 0
    assert "not claimed" in out.stderr and "Hint:" in out.stderr
