"""Victim selection: the specification's Preemption Decision Algorithm."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import AllocationState
from lattice_scheduler.preemption import PreemptionPolicy, is_candidate, select_victims
from lattice_test_harness import builders as b

NOW = 100_000.0


def running(aid: str, cls: int, nodes: list[str], *, started: float = NOW - 600, wall: int = 7200):
    a = b.allocation(id=aid, preemption_class=cls, nodes=len(nodes), walltime_seconds=wall)
    a.state = AllocationState.RUNNING
    a.assigned_nodes = list(nodes)
    a.started_at = started
    return a


def job(cls: int, nodes: int = 1):
    return b.allocation(id="job", preemption_class=cls, nodes=nodes)


def test_only_strictly_lower_classes_are_candidates() -> None:
    pol = PreemptionPolicy()
    j = job(5)
    assert is_candidate(running("v", 4, ["n0"]), j, NOW, pol)
    assert not is_candidate(running("v", 5, ["n0"]), j, NOW, pol)
    assert not is_candidate(running("v", 6, ["n0"]), j, NOW, pol)


def test_class_10_and_checkpointing_are_never_victims() -> None:
    pol = PreemptionPolicy()
    j = job(10)
    assert not is_candidate(running("v", 10, ["n0"]), j, NOW, pol)
    v = running("v", 1, ["n0"])
    v.state = AllocationState.CHECKPOINTING
    assert not is_candidate(v, j, NOW, pol)


def test_near_completion_is_protected() -> None:
    pol = PreemptionPolicy()
    j = job(9)
    # 4 minutes left of 2 h: let it finish
    assert not is_candidate(running("v", 1, ["n0"], started=NOW - 7200 + 240), j, NOW, pol)
    # 92% of a long walltime used
    assert not is_candidate(
        running("v", 1, ["n0"], started=NOW - 0.92 * 100_000, wall=100_000), j, NOW, pol
    )


def test_cheapest_victims_first_until_enough_nodes() -> None:
    nodes = b.inventory(3)
    old = running("old", 1, ["n0000"], started=NOW - 3000)
    young = running("young", 1, ["n0001"], started=NOW - 60)
    mid = running("mid", 2, ["n0002"], started=NOW - 600)
    victims = select_victims(job(8, nodes=2), [old, young, mid], nodes, now=NOW)
    assert victims == ["young", "mid"]


def test_no_valid_set_returns_none() -> None:
    nodes = b.inventory(4)
    vs = [running(f"v{i}", 1, [f"n000{i}"]) for i in range(4)]
    assert select_victims(job(8, nodes=4), vs, nodes, now=NOW) is None  # needs 4 > max 3
    assert select_victims(job(8, nodes=1), [], nodes, now=NOW) is None


def test_free_nodes_count_towards_the_need() -> None:
    nodes = b.inventory(2)
    v = running("v", 1, ["n0000"])
    assert select_victims(job(8, nodes=1), [v], nodes, now=NOW, free_nodes=[nodes["n0001"]]) == []


def test_victims_must_free_nodes_the_job_can_use() -> None:
    nodes = {
        **b.inventory(1, prefix="cpu"),
        **b.inventory(1, prefix="gpu", gpu_type="H100", gpu_count=4),
    }
    cpu_job = running("cpu", 1, ["cpu0000"])
    j = b.allocation(id="job", preemption_class=8, constraints={"gpu_type": "H100"})
    assert select_victims(j, [cpu_job], nodes, now=NOW) is None


@settings(max_examples=200, deadline=None)
@given(
    job_class=st.integers(0, 10),
    victims=st.lists(
        st.tuples(
            st.integers(0, 10), st.sampled_from(["Running", "Checkpointing"]), st.integers(60, 7000)
        ),
        max_size=8,
    ),
    need=st.integers(1, 5),
)
def test_never_selects_equal_or_higher_sensitive_or_checkpointing(job_class, victims, need) -> None:
    nodes = b.inventory(len(victims) + 1)
    allocs = []
    for i, (cls, state, age) in enumerate(victims):
        v = running(f"v{i}", cls, [f"n{i:04d}"], started=NOW - age)
        v.state = AllocationState(state)
        allocs.append(v)
    chosen = select_victims(job(job_class, nodes=need), allocs, nodes, now=NOW)
    by_id = {a.id: a for a in allocs}
    for vid in chosen or []:
        v = by_id[vid]
        assert v.spec.preemption_class < job_class
        assert v.spec.preemption_class != 10
        assert v.state == AllocationState.RUNNING
    if chosen:
        assert len(chosen) <= 3
        assert sum(len(by_id[v].assigned_nodes) for v in chosen) >= need


def test_reclaim_ignores_class_order_but_never_takes_class_10() -> None:
    nodes = b.inventory(2)
    borrower = running("borrower", 9, ["n0000"])
    sensitive = running("sensitive", 10, ["n0001"])
    j = job(1, nodes=1)
    assert select_victims(j, [borrower], nodes, now=NOW) is None
    assert select_victims(j, [borrower], nodes, now=NOW, reclaimable=frozenset({"borrower"})) == [
        "borrower"
    ]
    assert (
        select_victims(j, [sensitive], nodes, now=NOW, reclaimable=frozenset({"sensitive"})) is None
    )


def test_just_resumed_victim_is_protected_from_thrashing() -> None:
    pol = PreemptionPolicy()
    v = running("v", 1, ["n0"], started=NOW - 60)
    v.preempted_count = 2
    assert not is_candidate(v, job(8), NOW, pol)
    v.started_at = NOW - 3600  # ran long enough since it came back
    assert is_candidate(v, job(8), NOW, pol)


def test_solver_flags_are_not_node_features_when_choosing_victims() -> None:
    """``require_unified_memory`` / ``prefer_same_numa`` are solver flags, not node
    features: a job asking for them finds victims on nodes that meet the flags."""
    nodes = {
        **b.inventory(1, prefix="gh", gpu_type="GH200", gpu_count=4),
        **b.inventory(1, prefix="cpu"),
    }
    on_gh = running("on_gh", 1, ["gh0000"])
    on_cpu = running("on_cpu", 1, ["cpu0000"])
    unified = b.allocation(
        id="job",
        preemption_class=8,
        constraints={"features": ["require_unified_memory"]},
    )
    assert select_victims(unified, [on_gh, on_cpu], nodes, now=NOW) == ["on_gh"]
    numa = b.allocation(
        id="job", preemption_class=8, constraints={"features": ["prefer_same_numa"]}
    )
    assert select_victims(numa, [on_cpu], nodes, now=NOW) == ["on_cpu"]
