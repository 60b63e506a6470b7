"""The autoscaler's word on a reactive allocation, through the state machine: recorded
with the ScaleAllocation that acts on it, or on its own (SetScalingStatus) only when it
changed; never on allocations that are not running reactive ones."""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.types import (
    AllocationSpec,
    LifecycleType,
    NodeCapabilities,
    ScalingSpec,
    ScalingStatus,
    Tenant,
    VCluster,
)
from lattice_quorum.state import GlobalState, apply


def setup(**tenant: object) -> tuple[GlobalState, str]:
    s = GlobalState()
    assert apply(s, c.CreateTenant(tenant=Tenant(name="physics", **tenant))).error is None  # type: ignore[arg-type]
    assert apply(s, c.CreateVCluster(vcluster=VCluster(name="svc"))).error is None
    for i in range(4):
        r = apply(s, c.RegisterNode(node_id=f"n{i}", capabilities=NodeCapabilities(cpu_cores=2)))
        assert r.error is None
    spec = AllocationSpec(
        entrypoint="serve",
        tenant="physics",
        vcluster="svc",
        nodes=3,
        min_nodes=1,
        lifecycle=LifecycleType.REACTIVE,
        scaling=ScalingSpec(),
    )
    r = apply(s, c.SubmitAllocation(spec=spec, now=1.0))
    assert r.error is None, r.error
    aid = r.allocation.id
    assert apply(s, c.AssignNodes(allocation_id=aid, node_ids=["n0"], now=2.0)).error is None
    return s, aid


def test_scale_records_the_decision_with_the_change() -> None:
    s, aid = setup()
    status = ScalingStatus(target=2, last_decision="up", reason="x 0.9 >= 0.8 for 120 s", at=5.0)
    r = apply(s, c.ScaleAllocation(allocation_id=aid, add_node_ids=["n1"], status=status, now=5.0))
    assert r.error is None, r.error
    a = s.allocations[aid]
    assert a.assigned_nodes == ["n0", "n1"] and a.scaling_status == status
    assert s.nodes["n1"].owner == aid


def test_a_rejected_scale_records_nothing() -> None:
    s, aid = setup(max_nodes=1)
    status = ScalingStatus(target=2, last_decision="up", reason="r", at=5.0)
    r = apply(s, c.ScaleAllocation(allocation_id=aid, add_node_ids=["n1"], status=status, now=5.0))
    assert r.error is not None and "max_nodes" in str(r.error)
    assert s.allocations[aid].scaling_status is None
    assert s.allocations[aid].assigned_nodes == ["n0"]


def test_set_status_changes_only_what_differs() -> None:
    s, aid = setup()
    blocked = ScalingStatus(target=1, blocked="tenant physics holds 1 of max_nodes 1")
    rev = s.revision
    assert apply(s, c.SetScalingStatus(statuses={aid: blocked, "nope": blocked})).error is None
    assert s.allocations[aid].scaling_status == blocked and s.revision == rev + 1
    apply(s, c.SetScalingStatus(statuses={aid: blocked}))
    assert s.revision == rev + 1  # unchanged: no new revision
    long = ScalingStatus(target=1, blocked="x" * 500)
    apply(s, c.SetScalingStatus(statuses={aid: long}))
    assert len(s.allocations[aid].scaling_status.blocked) == 200


def test_status_of_an_ended_allocation_is_ignored() -> None:
    s, aid = setup()
    apply(s, c.CancelAllocation(allocation_id=aid, now=3.0))
    rev = s.revision
    apply(s, c.SetScalingStatus(statuses={aid: ScalingStatus(target=1, blocked="b")}))
    assert s.revision == rev and s.allocations[aid].scaling_status is None
