"""Named reads over GlobalState (lattice_quorum.queries): filters, order, and copies."""

from __future__ import annotations

import pytest
from lattice_common import commands as c
from lattice_common.types import AllocationState, NodeCapabilities, NodeState
from lattice_quorum import queries
from lattice_quorum.state import GlobalState, apply
from lattice_test_harness import builders as b


def ok(s: GlobalState, cmd: c.Command) -> c.CommandResult:
    res = apply(s, cmd)
    assert res.error is None, res.error
    return res


@pytest.fixture
def state() -> GlobalState:
    s = GlobalState()
    ok(s, c.CreateTenant(tenant=b.tenant("t"), now=1.0))
    ok(s, c.CreateTenant(tenant=b.tenant("u"), now=1.0))
    ok(s, c.CreateVCluster(vcluster=b.vcluster("v"), now=1.0))
    for nid, gpus in (("n2", 4), ("n1", 0)):
        ok(s, c.RegisterNode(node_id=nid, capabilities=NodeCapabilities(gpu_count=gpus), now=1))
    for i, (tenant, user) in enumerate((("t", "alice"), ("u", "bob"), ("t", "bob"))):
        spec = b.spec("true", tenant=tenant, vcluster="v", user=user)
        ok(s, c.SubmitAllocation(spec=spec, now=10.0 + i))
    return s


def test_names(state: GlobalState) -> None:
    assert queries.tenant_and_vcluster_names(state) == ({"t", "u"}, {"v"})


def test_allocations_matching_filters_orders_limits_and_copies(state: GlobalState) -> None:
    everything = queries.allocations_matching(state)
    assert [a.submitted_at for a in everything] == [10.0, 11.0, 12.0]
    assert [a.spec.user for a in queries.allocations_matching(state, user="bob")] == ["bob"] * 2
    assert [a.spec.tenant for a in queries.allocations_matching(state, tenant="t")] == ["t"] * 2
    assert queries.allocations_matching(state, states={AllocationState.RUNNING}) == []
    newest = queries.allocations_matching(state, limit=1)
    assert [a.submitted_at for a in newest] == [12.0]
    a = everything[0]
    assert a == state.allocations[a.id] and a is not state.allocations[a.id]
    assert queries.allocation(state, "nope") is None
    one = queries.allocation(state, a.id)
    assert one == a and one is not state.allocations[a.id]


def test_nodes_sorted_filtered_and_copied(state: GlobalState) -> None:
    assert [n.id for n in queries.nodes(state)] == ["n1", "n2"]
    assert queries.nodes(state, {NodeState.DOWN}) == []
    n = queries.node(state, "n1")
    assert n is not None and n is not state.nodes["n1"]
    assert sorted(queries.node_ids(state)) == ["n1", "n2"]
    counts = queries.node_state_counts(state)
    assert counts[NodeState.READY] == 2 and counts[NodeState.DOWN] == 0
    assert sorted(queries.each_node(state, lambda n: n.id)) == ["n1", "n2"]


def test_desired_for(state: GlobalState) -> None:
    assert queries.desired_for(state, "n1") == (state.nodes["n1"].revision, [], "")
    assert queries.desired_for(state, "nx") == (state.revision, [], "")
    aid = queries.allocations_matching(state)[0].id
    ok(state, c.AssignNodes(allocation_id=aid, node_ids=["n1"], now=20.0))
    gen, allocs, claimed_by = queries.desired_for(state, "n1")
    assert [a.id for a in allocs] == [aid] and gen == state.allocations[aid].revision
    assert allocs[0] is not state.allocations[aid] and claimed_by == ""
    # the node's claim is read with the set; a claimed idle node says so too
    state.nodes["n1"].claimed_by = "alice"
    assert queries.desired_for(state, "n1").claimed_by == "alice"
    state.nodes["n2"].claimed_by = "bob"
    assert queries.desired_for(state, "n2") == (state.nodes["n2"].revision, [], "bob")


def test_desired_content_ignores_changes_to_the_node_alone(state: GlobalState) -> None:
    aid = queries.allocations_matching(state)[0].id
    ok(state, c.AssignNodes(allocation_id=aid, node_ids=["n1"], now=20.0))
    before = queries.desired_for(state, "n1")
    state.nodes["n1"].next_allocation = "another"  # as SetNextAllocations does
    state.nodes["n1"].revision = state.revision = state.revision + 1
    after = queries.desired_for(state, "n1")
    assert after.generation > before.generation and after.content() == before.content()
    state.allocations[aid].revision = state.revision = state.revision + 1  # the work changed
    assert queries.desired_for(state, "n1").content() != before.content()


def test_desired_generation_is_desired_fors_revision(state: GlobalState) -> None:
    def same() -> None:
        for node_id in ("n1", "n2", "nx"):
            gen = queries.desired_generation(state, node_id)
            assert gen == queries.desired_for(state, node_id)[0], node_id

    same()
    aid = queries.allocations_matching(state)[0].id
    ok(state, c.AssignNodes(allocation_id=aid, node_ids=["n1"], now=20.0))
    same()
    ok(
        state,
        c.UpdateAllocationState(
            allocation_id=aid, state=AllocationState.COMPLETED, finished_at=30.0, now=30.0
        ),
    )
    same()


def test_tenants_and_vclusters(state: GlobalState) -> None:
    assert [t.name for t in queries.tenants(state)] == ["t", "u"]
    assert [v.name for v in queries.vclusters(state)] == ["v"]
    t = queries.tenant(state, "t")
    assert t is not None and t is not state.tenants["t"]
    assert queries.tenant(state, "x") is None and queries.vcluster(state, "x") is None


def test_usage_picks(state: GlobalState) -> None:
    aid = queries.allocations_matching(state, user="alice")[0].id
    ok(state, c.AssignNodes(allocation_id=aid, node_ids=["n2"], now=3600.0))
    ok(
        state,
        c.UpdateAllocationState(
            allocation_id=aid, state=AllocationState.COMPLETED, finished_at=7200.0, now=7200.0
        ),
    )
    d = queries.tenant_usage(state, "t", window_days=90, period_days=90, now=7200.0)
    assert d is not None
    assert d["node_hours"] == pytest.approx(1.0) and d["gpu_hours"] == pytest.approx(4.0)
    assert [u["user"] for u in d["users"]] == ["alice"]
    assert queries.tenant_usage(state, "x", window_days=90, period_days=90, now=1) is None
    u = queries.user_usage(state, "alice", tenant=None, window_days=90, now=7200.0)
    assert u is not None and [x["tenant"] for x in u["tenants"]] == ["t"]
    assert queries.user_usage(state, "alice", tenant="x", window_days=90, now=1) is None
