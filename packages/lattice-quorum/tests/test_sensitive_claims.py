"""Sensitive node claims and node-range scaling in apply(): who may take a claimed node,
the claim outliving its allocation, release rules, sensitive_pool_size, class 10."""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.types import NEVER_PREEMPTED_CLASS, AllocationState, SchedulerType
from lattice_quorum.state import GlobalState
from lattice_test_harness import builders as b
from test_state import assign, ok, rejected, set_state, submit, world


def sensitive_world(nodes: int = 4) -> GlobalState:
    s = world(nodes=nodes, vclusters=("v",))
    ok(
        s,
        c.CreateVCluster(
            vcluster=b.vcluster("sens", scheduler_type=SchedulerType.SENSITIVE_RESERVATION),
            now=1.0,
        ),
    )
    return s


def test_sensitive_allocation_claims_its_nodes_for_its_user_beyond_its_life() -> None:
    s = sensitive_world()
    aid = submit(s, vcluster="sens", user="alice", nodes=2, preemption_class=3)
    assert s.allocations[aid].spec.preemption_class == NEVER_PREEMPTED_CLASS
    assign(s, aid, ["n0000", "n0001"], now=50.0)
    assert s.nodes["n0000"].claimed_by == "alice" and s.nodes["n0000"].claimed_at == 50.0
    set_state(s, aid, AllocationState.COMPLETED, exit_code=0)
    # idle claimed nodes stay with their user
    assert s.nodes["n0001"].owner == "" and s.nodes["n0001"].claimed_by == "alice"


def test_claimed_nodes_run_only_the_claiming_users_sensitive_work() -> None:
    s = sensitive_world()
    first = submit(s, vcluster="sens", user="alice")
    assign(s, first, ["n0000"])
    set_state(s, first, AllocationState.COMPLETED, exit_code=0)
    other_user = submit(s, vcluster="sens", user="bob")
    err = rejected(
        s,
        c.AssignNodes(allocation_id=other_user, node_ids=["n0000"], now=60.0),
        "ownership_conflict",
    )
    assert "claimed by user alice" in err["message"]
    same_user_batch = submit(s, vcluster="v", user="alice")
    rejected(
        s,
        c.AssignNodes(allocation_id=same_user_batch, node_ids=["n0000"], now=60.0),
        "ownership_conflict",
    )
    again = submit(s, vcluster="sens", user="alice")
    assign(s, again, ["n0000"])


def test_release_needs_the_claiming_user_or_an_admin_and_an_idle_node() -> None:
    s = sensitive_world()
    aid = submit(s, vcluster="sens", user="alice")
    assign(s, aid, ["n0002"])
    busy = rejected(
        s, c.ReleaseNodeClaim(node_id="n0002", user="alice", now=70.0), "invalid_transition"
    )
    assert aid in busy["message"] and busy.get("hint")
    set_state(s, aid, AllocationState.COMPLETED, exit_code=0)
    rejected(s, c.ReleaseNodeClaim(node_id="n0002", user="bob", now=71.0), "permission_denied")
    ok(s, c.ReleaseNodeClaim(node_id="n0002", user="alice", now=72.0))
    assert s.nodes["n0002"].claimed_by == "" and s.nodes["n0002"].claimed_at is None
    rejected(s, c.ReleaseNodeClaim(node_id="n0002", admin=True, now=73.0), "invalid_argument")
    batch = submit(s, vcluster="v")
    assign(s, batch, ["n0002"])


def test_sensitive_pool_size_is_a_hard_limit_on_claimed_nodes() -> None:
    s = sensitive_world()
    s.sensitive_pool_size = 2
    a = submit(s, vcluster="sens", user="alice", nodes=2)
    assign(s, a, ["n0000", "n0001"])
    b2 = submit(s, vcluster="sens", user="bob")
    err = rejected(
        s, c.AssignNodes(allocation_id=b2, node_ids=["n0002"], now=80.0), "quota_exceeded"
    )
    assert "sensitive_pool_size" in err["message"] and "limit: 2" in err["message"]


def test_scale_grows_and_shrinks_within_the_node_range() -> None:
    s = world(nodes=5)
    aid = submit(s, nodes=4, min_nodes=2, lifecycle="unbounded", walltime_seconds=0)
    assign(s, aid, ["n0000", "n0001"])
    ok(s, c.ScaleAllocation(allocation_id=aid, add_node_ids=["n0002", "n0003"], now=90.0))
    assert s.allocations[aid].assigned_nodes == ["n0000", "n0001", "n0002", "n0003"]
    assert s.nodes["n0003"].owner == aid
    rejected(
        s,
        c.ScaleAllocation(allocation_id=aid, add_node_ids=["n0004"], now=91.0),
        "invalid_argument",
    )
    rejected(
        s,
        c.ScaleAllocation(allocation_id=aid, remove_node_ids=["n0000"], now=91.0),
        "invalid_argument",
    )
    ok(s, c.ScaleAllocation(allocation_id=aid, remove_node_ids=["n0003", "n0002"], now=92.0))
    assert s.nodes["n0003"].owner == "" and s.allocations[aid].assigned_nodes == ["n0000", "n0001"]
    rejected(
        s,
        c.ScaleAllocation(allocation_id=aid, remove_node_ids=["n0001"], now=93.0),
        "invalid_argument",
    )
    fixed = submit(s, nodes=1)
    assign(s, fixed, ["n0004"])
    rejected(
        s,
        c.ScaleAllocation(allocation_id=fixed, add_node_ids=["n0002"], now=94.0),
        "invalid_argument",
    )


def test_drift_on_a_claimed_node_drains_it() -> None:
    s = sensitive_world()
    ok(s, c.ReportConformance(node_id="n0000", fingerprint="good", now=40.0))
    aid = submit(s, vcluster="sens", user="alice")
    assign(s, aid, ["n0000"])
    ok(s, c.ReportConformance(node_id="n0000", fingerprint="bad", now=41.0))
    n = s.nodes["n0000"]
    assert n.state.value == "Draining" and n.conformance_drift and n.owner == aid
    assert n.state_reason.startswith("conformance_drift")
    ok(s, c.ReportConformance(node_id="n0001", fingerprint="good", now=42.0))
    ok(s, c.ReportConformance(node_id="n0001", fingerprint="bad", now=43.0))
    assert s.nodes["n0001"].state.value == "Ready"  # unclaimed: only deprioritised
