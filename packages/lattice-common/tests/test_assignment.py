"""The assignment and preemption rules the quorum and RM-Replay share (the quorum's own
error texts are covered through ``apply`` in lattice-quorum's test_state.py)."""

from __future__ import annotations

import pytest
from lattice_common.assignment import (
    check_assignment,
    check_preemption,
    is_reclaim,
    is_sensitive,
)
from lattice_common.errors import (
    InvalidTransition,
    NotFound,
    OwnershipConflict,
    QuotaExceeded,
    StaleRevision,
    ValidationError,
)
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    Node,
    NodeState,
    SchedulerType,
    Tenant,
    VCluster,
)


def alloc(aid: str = "a", *, nodes: int = 2, min_nodes: int = 0, **kw: object) -> Allocation:
    spec = AllocationSpec(
        entrypoint="x",
        tenant=str(kw.pop("tenant", "t")),
        vcluster=str(kw.pop("vcluster", "v")),
        user=str(kw.pop("user", "alice")),
        nodes=nodes,
        min_nodes=min_nodes,
        preemption_class=int(kw.pop("cls", 5)),  # type: ignore[call-overload]
    )
    return Allocation(id=aid, spec=spec, **kw)  # type: ignore[arg-type]


NODES = {f"n{i}": Node(id=f"n{i}", state=NodeState.READY) for i in range(4)}


def lookup(nid: str) -> Node:
    if nid not in NODES:
        raise NotFound(f"node {nid} not found")
    return NODES[nid]


def check(a: Allocation, ids: list[str], **kw: object) -> list[Node]:
    kw.setdefault("sensitive", False)
    kw.setdefault("tenant", None)
    kw.setdefault("tenant_usage", lambda: (0, 0))
    return check_assignment(a, ids, lookup, **kw)  # type: ignore[arg-type]


def test_a_valid_assignment_returns_the_nodes() -> None:
    assert [n.id for n in check(alloc(), ["n0", "n1"])] == ["n0", "n1"]
    assert [n.id for n in check(alloc(min_nodes=1), ["n2"])] == ["n2"]  # node range


@pytest.mark.parametrize(
    ("a", "ids", "error", "text"),
    [
        (alloc(state=AllocationState.RUNNING), ["n0", "n1"], InvalidTransition, "not Pending"),
        (alloc(), [], ValidationError, "non-empty list of distinct"),
        (alloc(), ["n0", "n0"], ValidationError, "distinct"),
        (alloc(), ["n0"], ValidationError, "needs 2..2 nodes, got 1"),
        (alloc(min_nodes=1, nodes=2), ["n0", "n1", "n2"], ValidationError, "needs 1..2"),
        (alloc(), ["n0", "nX"], NotFound, "node nX not found"),
    ],
)
def test_what_is_rejected(a: Allocation, ids: list[str], error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        check(a, ids)


def test_nodes_must_be_takeable() -> None:
    owned = Node(id="o", state=NodeState.READY, owner="x")
    down = Node(id="d", state=NodeState.DOWN)
    claimed = Node(id="c", state=NodeState.READY, claimed_by="bob")
    for n, text in ((owned, "already owned"), (down, "Down, not Ready"), (claimed, "claimed")):
        with pytest.raises(OwnershipConflict, match=text):
            check_assignment(
                alloc(nodes=1),
                [n.id],
                lambda _i, n=n: n,
                sensitive=False,
                tenant=None,
                tenant_usage=lambda: (0, 0),
            )
    # a claimed node serves its claiming user's sensitive work
    mine = Node(id="c", state=NodeState.READY, claimed_by="alice")
    assert check_assignment(
        alloc(nodes=1),
        ["c"],
        lambda _i: mine,
        sensitive=True,
        tenant=None,
        tenant_usage=lambda: (0, 0),
    ) == [mine]


def test_hard_quotas_report_current_requested_and_limit() -> None:
    t = Tenant(name="t", max_nodes=3, max_concurrent_allocations=2)
    with pytest.raises(QuotaExceeded) as e:
        check(alloc(), ["n0", "n1"], tenant=t, tenant_usage=lambda: (2, 0))
    assert e.value.details == {"current": 2, "requested": 2, "limit": 3}
    assert "max_nodes quota (current: 2, requested: 2, limit: 3)" in e.value.message
    with pytest.raises(QuotaExceeded, match=r"max_concurrent_allocations quota \(current: 2"):
        check(alloc(), ["n0", "n1"], tenant=t, tenant_usage=lambda: (0, 2))


def test_usage_is_counted_only_for_a_tenant_with_a_hard_quota() -> None:
    def never() -> tuple[int, int]:
        raise AssertionError("counted")

    check(alloc(), ["n0", "n1"], tenant=Tenant(name="t"), tenant_usage=never)


def test_the_sensitive_pool_limits_new_claims() -> None:
    kw = {"sensitive": True, "sensitive_pool_size": 3, "claimed_nodes": lambda: 2}
    with pytest.raises(QuotaExceeded, match="sensitive_pool_size"):
        check(alloc(), ["n0", "n1"], **kw)
    check(alloc(nodes=1), ["n0"], **kw)
    check(alloc(), ["n0", "n1"], **{**kw, "sensitive": False})


def test_stale_decisions_are_rejected() -> None:
    a = alloc()
    a.revision = 9
    with pytest.raises(StaleRevision):
        check(a, ["n0", "n1"], expected_revision=5)
    check(a, ["n0", "n1"])  # 0: not checked


def test_is_sensitive() -> None:
    vcs = {"s": VCluster(name="s", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)}
    assert is_sensitive(alloc(vcluster="s"), vcs) and not is_sensitive(alloc(), vcs)


def test_preemption_moves_down_or_reclaims() -> None:
    nodes = {"h": Node(id="h", home_vcluster="home")}
    victim = alloc("v", cls=5, vcluster="guest", state=AllocationState.RUNNING)
    victim.assigned_nodes = ["h"]
    check_preemption(victim, alloc("p", cls=6), nodes)
    with pytest.raises(ValidationError, match="preemption only moves down"):
        check_preemption(victim, alloc("p", cls=5), nodes)
    owner = alloc("p", cls=1, vcluster="home")
    assert is_reclaim(victim, owner, nodes)
    check_preemption(victim, owner, nodes)
    sensitive = alloc("v", cls=10, vcluster="guest", state=AllocationState.RUNNING)
    sensitive.assigned_nodes = ["h"]
    with pytest.raises(ValidationError):
        check_preemption(sensitive, owner, nodes)
    with pytest.raises(InvalidTransition, match="only running allocations"):
        check_preemption(alloc("v", cls=1), alloc("p", cls=6), nodes)
    with pytest.raises(InvalidTransition, match="preemptor p is Running"):
        check_preemption(victim, alloc("p", cls=6, state=AllocationState.RUNNING), nodes)
