"""Exclusive node ownership and hard quotas are enforced by the quorum (spec INV-S1,
INV-S2, "Quota Enforcement"), against a real lattice-server over its gRPC endpoint.

Allocations that must stay Pending until the test assigns them itself are submitted
to a vCluster that no scheduler process serves; the last test races two real scheduler
processes for the same nodes instead.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from e2e_helpers import (
    cancel_quietly,
    create_vcluster_without_scheduler,
    unique,
    wait_idle,
)
from lattice_common import commands as c
from lattice_common.rpc import Endpoints, RemoteQuorum

pytestmark = pytest.mark.cluster


@pytest.fixture
def h(lattice_cluster):
    wait_idle(lattice_cluster)
    yield lattice_cluster


def propose_all(h, *cmds: c.Command) -> list[c.CommandResult]:
    """Propose each command from its own client (as separate schedulers would), all at once."""

    async def go() -> list[c.CommandResult]:
        clients = [RemoteQuorum(Endpoints(h.cluster.grpc_endpoints)) for _ in cmds]
        try:
            return list(
                await asyncio.gather(
                    *(q.propose(cmd) for q, cmd in zip(clients, cmds, strict=True))
                )
            )
        finally:
            for q in clients:
                q.endpoints.close()

    return asyncio.run(go())


def test_two_concurrent_assignments_of_one_node_exactly_one_commits(h):
    vc = create_vcluster_without_scheduler(h)
    a1 = h.submit("sleep 300", vcluster=vc)
    a2 = h.submit("sleep 300", vcluster=vc)
    try:
        node = h.nodes()[0]["id"]
        r1, r2 = propose_all(
            h,
            c.AssignNodes(
                allocation_id=a1["id"], node_ids=[node], expected_revision=0, now=time.time()
            ),
            c.AssignNodes(
                allocation_id=a2["id"], node_ids=[node], expected_revision=0, now=time.time()
            ),
        )
        ok = [r for r in (r1, r2) if r.error is None]
        rejected = [r for r in (r1, r2) if r.error is not None]
        assert len(ok) == 1 and len(rejected) == 1, (r1, r2)
        assert rejected[0].error["code"] == "ownership_conflict", rejected[0].error
        winner = ok[0].allocation.id
        loser = a2["id"] if winner == a1["id"] else a1["id"]
        assert node in rejected[0].error["message"]

        assert h.node(node)["owner"] == winner
        assert h.get(winner)["state"] == "Running"
        assert h.get(winner)["assigned_nodes"] == [node]
        assert h.get(loser)["state"] == "Pending"
        assert h.get(loser)["assigned_nodes"] == []
        # and nothing else claims the node afterwards
        again = propose_all(
            h, c.AssignNodes(allocation_id=loser, node_ids=[node], now=time.time())
        )[0]
        assert again.error is not None and again.error["code"] == "ownership_conflict"
        assert h.node(node)["owner"] == winner
    finally:
        cancel_quietly(h, a1["id"], a2["id"])


def test_tenant_at_max_nodes_gets_exact_rejection_and_its_jobs_stay_pending(h):
    tenant = unique("quota")
    h.request("POST", "/api/v1/tenants", {"name": tenant, "max_nodes": 1})
    vc = create_vcluster_without_scheduler(h)
    a = h.submit("sleep 300", tenant=tenant, vcluster=vc)
    b = h.submit("sleep 300", tenant=tenant, vcluster=vc)
    ids = [a["id"], b["id"]]
    try:
        node1, node2 = (n["id"] for n in h.nodes()[:2])
        (ra,) = propose_all(
            h, c.AssignNodes(allocation_id=a["id"], node_ids=[node1], now=time.time())
        )
        assert ra.error is None, ra.error
        # node2 is free and Ready: only the quota stands in the way
        (rb,) = propose_all(
            h, c.AssignNodes(allocation_id=b["id"], node_ids=[node2], now=time.time())
        )
        assert rb.error is not None
        assert rb.error["code"] == "quota_exceeded"
        assert rb.error["message"] == (
            f'allocation rejected: tenant "{tenant}" would exceed max_nodes quota '
            "(current: 1, requested: 1, limit: 1)"
        )
        assert rb.error["details"] == {"current": 1, "requested": 1, "limit": 1}
        assert rb.error["hint"]
        assert h.get(b["id"])["state"] == "Pending"
        assert not h.node(node2)["owner"]

        # Through REST and the real scheduler: the tenant's job waits although node2 is
        # free, while another tenant's work submitted later runs there.
        capped = h.submit("echo capped", tenant=tenant, walltime="1m")
        ids.append(capped["id"])
        other = h.submit("echo other; sleep 1", walltime="1m")
        ids.append(other["id"])
        done = h.wait_state(other["id"], ("Completed", "Failed", "Cancelled"), timeout=30)
        assert done["state"] == "Completed" and done["assigned_nodes"] == [node2]
        time.sleep(2.5)  # two more scheduling cycles with node2 free again
        assert h.get(capped["id"])["state"] == "Pending"
        assert not h.node(node2)["owner"]

        # headroom comes back when the tenant's running allocation ends
        h.cancel(a["id"])
        done = h.wait_state(capped["id"], ("Completed", "Failed", "Cancelled"), timeout=30)
        assert done["state"] == "Completed", done
    finally:
        cancel_quietly(h, *ids)


def test_lowering_max_nodes_keeps_running_work_but_blocks_new_assignments(h):
    tenant = unique("shrink")
    h.request("POST", "/api/v1/tenants", {"name": tenant, "max_nodes": 2})
    short = h.submit("sleep 2", tenant=tenant, walltime="1m")
    long = h.submit("sleep 5", tenant=tenant, walltime="1m")
    ids = [short["id"], long["id"]]
    try:
        h.wait_state(short["id"], "Running", timeout=20)
        h.wait_state(long["id"], "Running", timeout=20)
        t = h.request("PATCH", f"/api/v1/tenants/{tenant}", {"max_nodes": 1})
        assert t["max_nodes"] == 1
        new = h.submit("echo new", tenant=tenant, walltime="1m")
        ids.append(new["id"])

        # The running work is not touched by the lower limit (usage 2 > limit 1) ...
        assert h.get(short["id"])["state"] == "Running"
        assert h.get(long["id"])["state"] == "Running"
        s = h.wait_state(short["id"], ("Completed", "Failed", "Cancelled"), timeout=30)
        assert s["state"] == "Completed" and s["exit_code"] == 0
        # ... with a node free again, the new job still waits: usage 1 + 1 > limit 1
        # (the new job is read first: the commit that ends the long one may hand its node
        # to the new one at once, between two reads taken the other way round)
        while True:
            new_state = h.get(new["id"])["state"]
            if h.get(long["id"])["state"] != "Running":
                break
            assert new_state == "Pending"
            time.sleep(0.1)
        lg = h.get(long["id"])
        assert lg["state"] == "Completed" and lg["exit_code"] == 0, lg
        # once the long one ends there is headroom and the new job runs
        nd = h.wait_state(new["id"], ("Completed", "Failed", "Cancelled"), timeout=30)
        assert nd["state"] == "Completed", nd
        assert nd["started_at"] >= lg["finished_at"]
    finally:
        cancel_quietly(h, *ids)


def test_two_vcluster_schedulers_never_double_assign(cluster_factory):
    """Two scheduler processes, one per vCluster, race for the same three nodes: the
    quorum lets each node be held by one allocation at a time (INV-S1)."""
    h = cluster_factory(members=1, agents=3, vclusters=("default", "other"))
    jobs = []
    for i in range(30):
        jobs.append(h.submit("sleep 0.2", vcluster="default" if i % 2 else "other"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        running = h.allocations(state="running")
        nodes = [n for a in running for n in a["assigned_nodes"]]
        assert len(nodes) == len(set(nodes)), f"a node is held twice: {running}"
        if all(h.get(j["id"])["state"] == "Completed" for j in jobs[-4:]):
            break
        time.sleep(0.05)
    final = [h.wait_state(j["id"], "Completed", timeout=60) for j in jobs]
    assert all(a["state"] == "Completed" for a in final)
