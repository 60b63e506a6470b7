"""Admission: what can never run is refused at submit, with the numbers and a hint;
what could run (now or once nodes come back) is not."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.errors import QuotaExceeded, Unsatisfiable
from lattice_common.types import AllocationState, NodeState, SchedulerType
from lattice_scheduler import admission
from lattice_scheduler.solver import solve
from lattice_test_harness import builders as b


def check(spec, nodes, tenants=(), vclusters=(), allocations=()):
    admission.check(
        spec,
        nodes={n.id: n for n in nodes},
        tenants={t.name: t for t in tenants},
        vclusters={v.name: v for v in vclusters},
        allocations=allocations,
    )


FOUR = [b.node(f"n{i}") for i in range(4)]


def test_more_nodes_than_the_vcluster_has_is_refused_with_the_numbers() -> None:
    with pytest.raises(Unsatisfiable) as e:
        check(b.spec(nodes=8, vcluster="default"), FOUR)
    assert e.value.message == (
        'allocation rejected: needs 8 nodes, vCluster "default" could offer at most 4 that match'
    )
    assert e.value.details == {"requested": 8, "in_pool": 4, "borrowable": 0}
    assert "--wait-for-capacity" in e.value.hint and "Ask for 4 nodes or fewer" in e.value.hint


def test_down_and_drained_nodes_count_as_capacity_disabled_ones_do_not() -> None:
    nodes = [
        b.node("a"),
        b.node("b", state=NodeState.DOWN),
        b.node("c", state=NodeState.DRAINED),
        b.node("d", disabled=True),
    ]
    check(b.spec(nodes=3), nodes)
    with pytest.raises(Unsatisfiable):
        check(b.spec(nodes=4), nodes)


def test_waiting_for_capacity_lets_a_request_through() -> None:
    check(b.spec(nodes=8, wait_for_capacity=True), FOUR)
    check(b.spec(constraints={"gpu_type": "H100"}, wait_for_capacity=True), FOUR)


def test_a_range_needs_only_its_minimum() -> None:
    check(b.spec(nodes=8, min_nodes=2), FOUR)


def test_nodes_of_other_pools_count_when_the_vcluster_may_borrow_them() -> None:
    nodes = [b.node("own", home_vcluster="v"), b.node("lend", home_vcluster="other")]
    check(b.spec(nodes=2, vcluster="v"), nodes)
    no_borrowing = b.vcluster("v", allow_borrowing=False)
    with pytest.raises(Unsatisfiable) as e:
        check(b.spec(nodes=2, vcluster="v"), nodes, vclusters=[no_borrowing])
    assert e.value.details == {"requested": 2, "in_pool": 1, "borrowable": 0}
    # non-preemptible work never goes to borrowed nodes
    with pytest.raises(Unsatisfiable):
        check(b.spec(nodes=2, vcluster="v", preemption_class=10), nodes)
    # a sensitive pool never lends
    sens = b.vcluster("other", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)
    with pytest.raises(Unsatisfiable):
        check(b.spec(nodes=2, vcluster="v"), nodes, vclusters=[sens])


def test_an_unknown_gpu_type_lists_what_exists() -> None:
    nodes = [b.node("g1", gpu_type="A100", gpu_count=4), b.node("g2", gpu_type="A100", gpu_count=4)]
    with pytest.raises(Unsatisfiable) as e:
        check(b.spec(constraints={"gpu_type": "H100"}), [*nodes, b.node("c1")])
    assert e.value.message == 'no registered node has gpu_type "H100"'
    assert e.value.details["available"] == "A100 (2)"
    assert "--constraint gpu_type=" in e.value.hint
    with pytest.raises(Unsatisfiable) as e:
        check(b.spec(constraints={"gpu_type": "H100"}), [b.node("c1")])
    assert e.value.details["available"] == "none" and "drop the gpu_type" in e.value.hint


def test_too_many_gpus_unknown_features_and_too_much_memory_say_what_exists() -> None:
    nodes = [b.node("g1", gpu_type="A100", gpu_count=4, features=["ib"], memory_gb=512)]
    with pytest.raises(Unsatisfiable, match="the most on one node is 4"):
        check(b.spec(constraints={"gpu_count": 8}), nodes)
    with pytest.raises(Unsatisfiable, match='feature "nvme"') as e:
        check(b.spec(constraints={"features": ["nvme"]}), nodes)
    assert e.value.details["available"] == "ib (1)"
    with pytest.raises(Unsatisfiable, match="the most is 512 GB"):
        check(b.spec(constraints={"memory_gb": 1024}), nodes)
    # a solver flag is not a node feature
    check(b.spec(constraints={"features": ["prefer_same_numa"]}), nodes)


def test_more_nodes_than_the_tenants_max_nodes_is_the_quota_documents_text() -> None:
    physics = b.tenant("physics", max_nodes=5)
    holding = b.allocation(tenant="physics", state=AllocationState.RUNNING)
    holding = msgspec.structs.replace(holding, assigned_nodes=["n0", "n1", "n2"])
    with pytest.raises(QuotaExceeded) as e:
        check(b.spec(tenant="physics", nodes=6), FOUR * 2, [physics], allocations=[holding])
    assert e.value.message == (
        'allocation rejected: tenant "physics" would exceed max_nodes quota '
        "(current: 3, requested: 6, limit: 5)"
    )
    assert "Hint" not in e.value.message and "max_nodes" in e.value.hint
    # within the limit: accepted, it waits for headroom (the scheduler says so)
    check(b.spec(tenant="physics", nodes=4), FOUR, [physics], allocations=[holding])
    # waiting for capacity does not lift a hard quota
    with pytest.raises(QuotaExceeded):
        check(b.spec(tenant="physics", nodes=6, wait_for_capacity=True), FOUR, [physics])


def test_a_cluster_with_no_nodes_yet_refuses_nothing_but_hard_quotas() -> None:
    check(b.spec(nodes=100, constraints={"gpu_type": "H100"}), [])
    with pytest.raises(QuotaExceeded):
        check(b.spec(tenant="t", nodes=3), [], [b.tenant("t", max_nodes=2)])


@settings(max_examples=150, deadline=None)
@given(
    caps=st.lists(
        st.tuples(
            st.sampled_from(["", "A100", "GH200"]),
            st.integers(0, 8),
            st.sampled_from([128, 256, 512]),
            st.sets(st.sampled_from(["ib", "nvme", "cxl"]), max_size=2),
        ),
        min_size=1,
        max_size=8,
    ),
    k=st.integers(1, 9),
    gpu_type=st.sampled_from(["", "a100", "GH200", "H100"]),
    gpu_count=st.integers(0, 9),
    memory_gb=st.sampled_from([0, 200, 600]),
    features=st.sets(st.sampled_from(["ib", "nvme", "fpga"]), max_size=2),
)
def test_what_the_solver_places_on_an_idle_cluster_is_never_refused(
    caps, k, gpu_type, gpu_count, memory_gb, features
) -> None:
    """Admission refuses only what cannot run: whenever the solver can place a request on
    the whole cluster idle, admission accepts it; and whenever admission accepts it,
    the idle cluster has enough matching nodes."""
    nodes = [
        b.node(f"n{i}", gpu_type=t, gpu_count=g, memory_gb=m, features=sorted(f))
        for i, (t, g, m, f) in enumerate(caps)
    ]
    spec = b.spec(
        nodes=k,
        constraints={
            "gpu_type": gpu_type,
            "gpu_count": gpu_count,
            "memory_gb": memory_gb,
            "features": sorted(features),
        },
    )
    alloc = b.allocation(id="a", **msgspec.structs.asdict(spec))
    placed = bool(solve([alloc], {n.id: n for n in nodes}, score=lambda a: 0.0, now=0.0).proposals)
    try:
        check(spec, nodes)
        accepted = True
    except Unsatisfiable:
        accepted = False
    assert accepted == placed
