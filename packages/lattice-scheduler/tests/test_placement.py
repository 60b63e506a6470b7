"""Placement core: ordering, constraint matching, topology packing and one planning cycle.

Examples first, then Hypothesis properties over random inventories and queues: every
proposal is valid (constraints, eligibility, size, distinct nodes, quotas) and
pick_nodes spans no more topology groups than necessary.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import (
    HOLDING_STATES,
    Allocation,
    AllocationState,
    Constraints,
    Node,
    NodeState,
    Tenant,
)
from lattice_scheduler.filters import node_satisfies
from lattice_scheduler.placement import eligible, order_pending, pick_nodes, plan_cycle
from lattice_scheduler.solver import Pending, Proposal
from lattice_test_harness import builders as b

A = AllocationState
N = NodeState


def alloc(aid: str, **kw: Any) -> Allocation:
    kw.setdefault("tenant", "t")
    kw.setdefault("vcluster", "v")
    return b.allocation(id=aid, **kw)


def plan(
    allocs: list[Allocation],
    nodes: dict[str, Node] | list[Node],
    tenants: list[Tenant] = (),  # type: ignore[assignment]
    **kw: Any,
) -> tuple[list[Proposal], list[Pending]]:
    if isinstance(nodes, list):
        nodes = {n.id: n for n in nodes}
    return plan_cycle(
        vcluster=kw.pop("vcluster", "v"),
        allocations={a.id: a for a in allocs},
        nodes=nodes,
        tenants={t.name: t for t in tenants},
        **kw,
    )


def reasons(waiting: list[Pending]) -> dict[str, str]:
    return {p.allocation_id: p.reason for p in waiting}


# --- order_pending -------------------------------------------------------------------


def test_order_by_preemption_class_then_wait_time_then_id() -> None:
    allocs = [
        alloc("a1", preemption_class=5, submitted_at=30.0),
        alloc("a2", preemption_class=9, submitted_at=50.0),
        alloc("a3", preemption_class=5, submitted_at=10.0),
        alloc("a5", preemption_class=0, submitted_at=1.0),
        alloc("a4", preemption_class=5, submitted_at=10.0),
    ]
    assert [a.id for a in order_pending(allocs)] == ["a2", "a3", "a4", "a1", "a5"]


def test_order_is_independent_of_input_order() -> None:
    allocs = [alloc(f"a{i}", preemption_class=i % 3, submitted_at=float(i % 4)) for i in range(12)]
    expected = [a.id for a in order_pending(allocs)]
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(allocs)
        assert [a.id for a in order_pending(allocs)] == expected


def test_requeued_allocation_keeps_its_place() -> None:
    """Requeue keeps submitted_at, so an old requeued job still goes before newer ones."""
    old = alloc("zz", submitted_at=1.0)
    old.requeue_count = 2
    new = alloc("aa", submitted_at=100.0)
    assert [a.id for a in order_pending([new, old])] == ["zz", "aa"]


# --- eligible ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, True),
        ({"home_vcluster": "v"}, True),
        ({"home_vcluster": "w"}, False),
        ({"owner": "a1"}, False),
        ({"state": N.DEGRADED}, False),
        ({"state": N.DOWN}, False),
        ({"state": N.DRAINING}, False),
        ({"state": N.DRAINED}, False),
        ({"state": N.UNKNOWN}, False),
    ],
)
def test_eligible(kw: dict[str, Any], expected: bool) -> None:
    assert eligible(b.node("x", **kw), "v") is expected


# --- pick_nodes ----------------------------------------------------------------------


def test_pick_nodes_returns_none_when_too_few() -> None:
    assert pick_nodes(list(b.inventory(3).values()), 4) is None
    assert pick_nodes([], 1) is None


def test_pick_nodes_prefers_the_tightest_single_group() -> None:
    nodes = [
        *[b.node(f"g0-{i}", group=0) for i in range(8)],
        *[b.node(f"g1-{i}", group=1) for i in range(4)],
        *[b.node(f"g2-{i}", group=2) for i in range(2)],
    ]
    chosen = pick_nodes(nodes, 3)
    assert chosen is not None
    assert [n.id for n in chosen] == ["g1-0", "g1-1", "g1-2"]
    chosen = pick_nodes(nodes, 2)
    assert chosen is not None
    assert {n.group for n in chosen} == {2}
    chosen = pick_nodes(nodes, 5)
    assert chosen is not None
    assert {n.group for n in chosen} == {0}


def test_pick_nodes_spans_largest_groups_first_when_none_fits() -> None:
    nodes = [
        *[b.node(f"a{i}", group=0) for i in range(2)],
        *[b.node(f"b{i}", group=1) for i in range(5)],
        *[b.node(f"c{i}", group=2) for i in range(3)],
        *[b.node(f"d{i}", group=3) for i in range(1)],
    ]
    chosen = pick_nodes(nodes, 7)
    assert chosen is not None
    assert len(chosen) == 7
    assert Counter(n.group for n in chosen) == {1: 5, 2: 2}


def test_pick_nodes_is_deterministic_and_sorted_within_group() -> None:
    nodes = list(b.inventory(10, groups=2).values())
    expected = [n.id for n in pick_nodes(nodes, 4) or []]
    rng = random.Random(3)
    for _ in range(5):
        rng.shuffle(nodes)
        assert [n.id for n in pick_nodes(nodes, 4) or []] == expected


# --- plan_cycle: examples ------------------------------------------------------------


def test_plan_places_in_priority_order() -> None:
    nodes = b.inventory(2)
    low = alloc("low", preemption_class=1, submitted_at=1.0, nodes=2)
    high = alloc("high", preemption_class=8, submitted_at=9.0, nodes=2)
    proposals, waiting = plan([low, high], nodes)
    assert proposals == [Proposal("high", ("n0000", "n0001"))]
    assert reasons(waiting) == {"low": "all suitable nodes occupied"}


def test_plan_places_in_wait_order_within_a_class() -> None:
    nodes = b.inventory(1)
    proposals, waiting = plan(
        [alloc("young", submitted_at=20.0), alloc("old", submitted_at=10.0)], nodes
    )
    assert [p.allocation_id for p in proposals] == ["old"]
    assert reasons(waiting) == {"young": "all suitable nodes occupied"}


def test_plan_backfills_smaller_allocations() -> None:
    nodes = b.inventory(4)
    nodes["n0003"].owner = "someone"  # 3 free of 4: big waits, small fits
    big = alloc("big", preemption_class=9, nodes=4)
    small = alloc("small", preemption_class=1, nodes=2)
    proposals, waiting = plan([big, small], nodes)
    assert [p.allocation_id for p in proposals] == ["small"]
    assert reasons(waiting) == {"big": "all suitable nodes occupied"}


@pytest.mark.parametrize(
    ("constraints", "expected_nodes"),
    [
        ({"gpu_type": "H100"}, {"h0", "h1"}),
        ({"gpu_type": "A100", "gpu_count": 8}, {"a8"}),
        ({"features": ["nvme"]}, {"h1", "c0"}),
        ({"memory_gb": 1024}, {"c0"}),
    ],
)
def test_plan_honours_constraints(constraints: dict[str, Any], expected_nodes: set[str]) -> None:
    nodes = [
        b.node("h0", gpu_type="H100", gpu_count=4),
        b.node("h1", gpu_type="H100", gpu_count=4, features=["nvme"]),
        b.node("a4", gpu_type="A100", gpu_count=4),
        b.node("a8", gpu_type="A100", gpu_count=8),
        b.node("c0", memory_gb=2048, features=["nvme"]),
    ]
    a = alloc("x", nodes=len(expected_nodes), constraints=constraints)
    proposals, waiting = plan([a], nodes)
    assert waiting == []
    assert set(proposals[0].node_ids) == expected_nodes


def test_plan_packs_into_one_group_when_possible() -> None:
    # groups: 0 -> 3 free nodes, 1 -> 5 free nodes, 2 -> 2 free nodes
    nodes = [
        *[b.node(f"g0-{i}", group=0) for i in range(3)],
        *[b.node(f"g1-{i}", group=1) for i in range(5)],
        *[b.node(f"g2-{i}", group=2) for i in range(2)],
    ]
    proposals, _ = plan([alloc("x", nodes=4, constraints={"topology": "tight"})], nodes)
    assert len(proposals) == 1
    assert {nid.split("-")[0] for nid in proposals[0].node_ids} == {"g1"}
    proposals, _ = plan([alloc("x", nodes=3)], nodes)
    assert {nid.split("-")[0] for nid in proposals[0].node_ids} == {"g0"}


def test_plan_skips_ineligible_nodes() -> None:
    nodes = [
        b.node("busy", owner="other"),
        b.node("down", state=N.DOWN),
        b.node("draining", state=N.DRAINING),
        b.node("degraded", state=N.DEGRADED),
        b.node("theirs", home_vcluster="w"),
        b.node("mine", home_vcluster="v"),
        b.node("shared"),
    ]
    proposals, waiting = plan([alloc("x", nodes=2), alloc("y", nodes=1, submitted_at=5.0)], nodes)
    assert proposals == [Proposal("x", ("mine", "shared"))]
    assert reasons(waiting) == {"y": "all suitable nodes occupied"}


def test_plan_only_considers_pending_allocations_of_its_vcluster() -> None:
    nodes = b.inventory(4)
    other_vc = alloc("w1", vcluster="w")
    run = alloc("r1", state=A.RUNNING)
    excluded = alloc("ex")
    mine = alloc("m1")
    proposals, waiting = plan([other_vc, run, excluded, mine], nodes, exclude=["ex"])
    assert [p.allocation_id for p in proposals] == ["m1"]
    assert waiting == []


def test_plan_with_nothing_pending() -> None:
    assert plan([], b.inventory(2)) == ([], [])
    assert plan([alloc("r", state=A.RUNNING)], b.inventory(2)) == ([], [])


def test_no_nodes_matching_constraints_vs_all_suitable_nodes_occupied() -> None:
    nodes = [b.node("g0", gpu_type="H100", gpu_count=4, owner="busy"), b.node("c0")]
    proposals, waiting = plan(
        [
            alloc("gpu", constraints={"gpu_type": "H100"}),
            alloc("fpga", constraints={"features": ["fpga"]}, submitted_at=1.0),
        ],
        nodes,
    )
    assert proposals == []
    assert reasons(waiting) == {
        "gpu": "all suitable nodes occupied",
        "fpga": "no nodes matching constraints",
    }


def test_too_few_matching_nodes_in_total_is_not_reported_as_occupied() -> None:
    nodes = [b.node(f"h{i}", gpu_type="H100", gpu_count=4) for i in range(2)]
    _, waiting = plan([alloc("x", nodes=4, constraints={"gpu_type": "H100"})], nodes)
    assert reasons(waiting) == {"x": "no nodes matching constraints"}


def test_quota_precheck_waits_for_headroom() -> None:
    nodes = b.inventory(10)
    holding = alloc("run", state=A.RUNNING)
    holding.assigned_nodes = ["n0009", "n0008", "n0007"]
    for nid in holding.assigned_nodes:
        nodes[nid].owner = holding.id
    tenants = [b.tenant("t", max_nodes=5), b.tenant("u", max_concurrent_allocations=1)]
    allocs = [
        holding,
        alloc("fits", nodes=2, submitted_at=1.0),
        alloc("over", nodes=1, submitted_at=2.0),  # 3 + 2 + 1 > 5
        alloc("u1", tenant="u", submitted_at=3.0),
        alloc("u2", tenant="u", submitted_at=4.0),
    ]
    proposals, waiting = plan(allocs, nodes, tenants)
    assert [p.allocation_id for p in proposals] == ["fits", "u1"]
    assert reasons(waiting) == {
        "over": "waiting for quota headroom",
        "u2": "waiting for quota headroom",
    }


def test_unknown_tenant_has_no_quota() -> None:
    proposals, _ = plan([alloc("x", tenant="ghost", nodes=3)], b.inventory(3))
    assert len(proposals) == 1


# --- properties ----------------------------------------------------------------------

GPU_TYPES = ["", "H100", "A100"]
FEATURES = ["nvme", "ib", "fast"]
TENANT_NAMES = ["t1", "t2", "t3"]


@st.composite
def nodes_st(draw: st.DrawFn) -> dict[str, Node]:
    count = draw(st.integers(0, 24))
    out: dict[str, Node] = {}
    for i in range(count):
        nid = f"n{i:03d}"
        gpu_type = draw(st.sampled_from(GPU_TYPES))
        out[nid] = b.node(
            nid,
            group=draw(st.integers(0, 4)),
            gpu_type=gpu_type,
            gpu_count=draw(st.integers(1, 8)) if gpu_type else 0,
            memory_gb=draw(st.sampled_from([128, 256, 512])),
            features=draw(st.lists(st.sampled_from(FEATURES), unique=True, max_size=3)),
            state=draw(st.sampled_from([N.READY, N.READY, N.READY, N.DOWN, N.DRAINING])),
            home_vcluster=draw(st.sampled_from(["", "", "v", "w"])),
        )
    return out


@st.composite
def constraints_st(draw: st.DrawFn) -> Constraints:
    return Constraints(
        gpu_type=draw(st.sampled_from(["", "", "H100", "a100"])),
        gpu_count=draw(st.sampled_from([0, 0, 2, 4, 8])),
        memory_gb=draw(st.sampled_from([0, 0, 256, 512])),
        features=draw(st.lists(st.sampled_from(FEATURES), unique=True, max_size=2)),
        topology=draw(st.sampled_from(["", "tight", "any"])),
    )


@st.composite
def world_st(draw: st.DrawFn) -> tuple[dict[str, Allocation], dict[str, Node], dict[str, Tenant]]:
    nodes = draw(nodes_st())
    allocs: dict[str, Allocation] = {}
    for i in range(draw(st.integers(0, 12))):
        aid = f"a{i:03d}"
        a = b.allocation(
            id=aid,
            tenant=draw(st.sampled_from(TENANT_NAMES)),
            vcluster=draw(st.sampled_from(["v", "v", "w"])),
            nodes=draw(st.integers(1, 6)),
            preemption_class=draw(st.integers(0, 10)),
            submitted_at=float(draw(st.integers(0, 5))),
            constraints=draw(constraints_st()),
        )
        allocs[aid] = a
    # Some allocations already hold some of the nodes (for quotas and ownership).
    free_ids = sorted(nodes)
    for a in list(allocs.values()):
        if free_ids and draw(st.integers(0, 3)) == 0:
            k = min(len(free_ids), a.spec.nodes)
            a.state = draw(st.sampled_from(sorted(HOLDING_STATES)))
            a.assigned_nodes = free_ids[:k]
            for nid in free_ids[:k]:
                nodes[nid].owner = a.id
                nodes[nid].owner_tenant = a.spec.tenant
            free_ids = free_ids[k:]
    tenants = {
        name: b.tenant(
            name,
            max_nodes=draw(st.one_of(st.none(), st.integers(0, 12))),
            max_concurrent_allocations=draw(st.one_of(st.none(), st.integers(0, 4))),
        )
        for name in TENANT_NAMES
        if draw(st.booleans())
    }
    return allocs, nodes, tenants


@settings(max_examples=200, deadline=None)
@given(world=world_st(), exclude=st.sets(st.sampled_from([f"a{i:03d}" for i in range(12)])))
def test_every_proposal_is_valid(
    world: tuple[dict[str, Allocation], dict[str, Node], dict[str, Tenant]], exclude: set[str]
) -> None:
    allocs, nodes, tenants = world
    proposals, waiting = plan_cycle(
        vcluster="v", allocations=allocs, nodes=nodes, tenants=tenants, exclude=exclude
    )
    pending = {
        a.id
        for a in allocs.values()
        if a.state == A.PENDING and a.spec.vcluster == "v" and a.id not in exclude
    }
    decided = [p.allocation_id for p in proposals] + [w.allocation_id for w in waiting]
    # every pending allocation of the vCluster is decided exactly once
    assert sorted(decided) == sorted(pending)
    used: set[str] = set()
    for p in proposals:
        a = allocs[p.allocation_id]
        assert len(p.node_ids) == a.spec.nodes
        assert len(set(p.node_ids)) == len(p.node_ids)
        for nid in p.node_ids:
            n = nodes[nid]
            assert node_satisfies(n, a.spec)
            assert eligible(n, "v")
            assert n.state == N.READY and not n.owner and n.home_vcluster in ("", "v")
        assert used.isdisjoint(p.node_ids), "a node proposed twice in one cycle"
        used.update(p.node_ids)
    # hard quotas hold for what is held plus what is proposed
    for name, t in tenants.items():
        held = [a for a in allocs.values() if a.state in HOLDING_STATES and a.spec.tenant == name]
        new = [p for p in proposals if allocs[p.allocation_id].spec.tenant == name]
        if new and t.max_nodes is not None:
            total = sum(len(a.assigned_nodes) for a in held) + sum(len(p.node_ids) for p in new)
            assert total <= t.max_nodes
        if new and t.max_concurrent_allocations is not None:
            assert len(held) + len(new) <= t.max_concurrent_allocations
    for w in waiting:
        assert w.reason in {
            "waiting for quota headroom",
            "all suitable nodes occupied",
            "no nodes matching constraints",
        }
        a = allocs[w.allocation_id]
        usable = [
            n
            for n in nodes.values()
            if n.state not in (N.DOWN, N.FAILED)
            and n.home_vcluster in ("", "v")
            and node_satisfies(n, a.spec)
        ]
        if w.reason == "no nodes matching constraints":
            assert len(usable) < a.spec.nodes
        elif w.reason == "all suitable nodes occupied":
            assert len(usable) >= a.spec.nodes


@settings(max_examples=100, deadline=None)
@given(world=world_st(), seed=st.integers(0, 1000))
def test_plan_is_independent_of_mapping_order(
    world: tuple[dict[str, Allocation], dict[str, Node], dict[str, Tenant]], seed: int
) -> None:
    allocs, nodes, tenants = world
    expected = plan_cycle(vcluster="v", allocations=allocs, nodes=nodes, tenants=tenants)
    rng = random.Random(seed)
    a_items, n_items = list(allocs.items()), list(nodes.items())
    rng.shuffle(a_items)
    rng.shuffle(n_items)
    got = plan_cycle(vcluster="v", allocations=dict(a_items), nodes=dict(n_items), tenants=tenants)
    assert got == expected


def min_groups(candidates: list[Node], count: int) -> int:
    """Fewest groups that can hold ``count`` nodes: greedily take the largest groups."""
    sizes = sorted(Counter(n.group for n in candidates).values(), reverse=True)
    taken = groups = 0
    for size in sizes:
        if taken >= count:
            break
        taken += size
        groups += 1
    return groups


@st.composite
def candidates_st(draw: st.DrawFn) -> list[Node]:
    groups = draw(st.lists(st.integers(0, 9), min_size=0, max_size=40))
    return [b.node(f"c{i:03d}", group=g) for i, g in enumerate(groups)]


@settings(max_examples=300, deadline=None)
@given(candidates=candidates_st(), count=st.integers(1, 45))
def test_pick_nodes_uses_the_fewest_groups(candidates: list[Node], count: int) -> None:
    chosen = pick_nodes(candidates, count)
    if len(candidates) < count:
        assert chosen is None
        return
    assert chosen is not None
    assert len(chosen) == count
    assert len({n.id for n in chosen}) == count
    assert {n.id for n in chosen} <= {n.id for n in candidates}
    spanned = len({n.group for n in chosen})
    assert spanned == min_groups(candidates, count)
    if spanned == 1:
        # the tightest group that fits: no smaller group could have held it
        sizes = Counter(n.group for n in candidates)
        g = chosen[0].group
        assert all(size >= sizes[g] or size < count for size in sizes.values())


def test_with_nothing_free_a_job_that_outgrew_the_pool_says_so_with_the_numbers() -> None:
    """A cycle with no free node still tells a job that the pool shrank below it:
    disabled and down nodes are not usable now, but are said to exist."""
    from lattice_scheduler import reasons

    busy = b.node("n1", owner="x")
    gone = b.node("n2", disabled=True)
    down = b.node("n3", state=NodeState.DOWN)
    a = b.allocation(id="a", nodes=3, vcluster="v")
    _, waiting = plan_cycle(
        vcluster="v",
        allocations={"a": a},
        nodes={n.id: n for n in (busy, gone, down)},
        tenants={},
    )
    assert [(w.reason, w.text) for w in waiting] == [
        (
            reasons.NO_MATCH,
            "no nodes matching constraints: needs 3 nodes, vCluster v has 1 that match "
            "(2 more down or disabled)",
        )
    ]
