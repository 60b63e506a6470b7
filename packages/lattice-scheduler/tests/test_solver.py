"""GreedyTopologyAwareBackfill: ordering, filters, packing, conformance, backfill.

Examples first, then Hypothesis properties over random inventories, running work and
queues. The properties check the solver against independent re-implementations in
this file: every proposal meets every hard constraint on eligible free nodes, no node
is used twice, sizes are exact, spans are minimal, ``require_conformance`` placements
are homogeneous, no proposal delays a reservation, and the result is deterministic.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import (
    Allocation,
    AllocationState,
    Node,
    NodeState,
    Tenant,
)
from lattice_scheduler.filters import constraint_flags, node_satisfies
from lattice_scheduler.solver import (
    INF,
    REASON_CONFORMANCE,
    REASON_NO_MATCH,
    REASON_OCCUPIED,
    REASON_POWER,
    REASON_QUOTA,
    SolveResult,
    choose,
    plan_fitness,
    solve,
)
from lattice_scheduler.topology import TopologyModel
from lattice_test_harness import builders as b

A = AllocationState
N = NodeState
H = 3600.0
FLAGS = {
    "require_unified_memory",
    "allow_cxl_memory",
    "require_conformance",
    "prefer_same_numa",
    "prefer_local_memory",
}


def alloc(aid: str, **kw: Any) -> Allocation:
    kw.setdefault("tenant", "t")
    kw.setdefault("vcluster", "v")
    return b.allocation(id=aid, **kw)


def running(
    aid: str, nodes: dict[str, Node], ids: list[str], *, walltime: float, **kw: Any
) -> Allocation:
    """A Running allocation holding ``ids`` since t=0 (and the nodes marked owned)."""
    started_at = kw.pop("started_at", 0.0)
    a = alloc(aid, state=A.RUNNING, nodes=len(ids), walltime_seconds=int(walltime), **kw)
    a.started_at = started_at
    a.assigned_nodes = list(ids)
    for i in ids:
        nodes[i].owner = aid
    return a


def by_score(scores: dict[str, float]):
    return lambda a: scores.get(a.id, 0.0)


def run(
    pending: list[Allocation],
    nodes: dict[str, Node] | list[Node],
    holding: list[Allocation] = (),  # type: ignore[assignment]
    *,
    scores: dict[str, float] | None = None,
    now: float = 0.0,
    **kw: Any,
) -> SolveResult:
    if isinstance(nodes, list):
        nodes = {n.id: n for n in nodes}
    kw.setdefault("vcluster", "v")
    return solve(pending, nodes, holding, score=by_score(scores or {}), now=now, **kw)


def placed(res: SolveResult) -> dict[str, tuple[str, ...]]:
    return {p.allocation_id: p.node_ids for p in res.proposals}


def grid(groups: dict[int, int], conf: str | dict[int, str] = "c1", **kw: Any) -> dict[str, Node]:
    """Ready nodes g<group>n<i>, ``groups[g]`` of them per group."""
    out: dict[str, Node] = {}
    for g, count in groups.items():
        cg = conf if isinstance(conf, str) else conf[g]
        for i in range(count):
            nid = f"g{g}n{i:02d}"
            out[nid] = b.node(nid, group=g, conformance_group=cg, **kw)
    return out


# --- flags and filters ---------------------------------------------------------------------


def test_constraint_flags_are_read_from_features() -> None:
    a = alloc("a", constraints={"features": ["nvme", "require_conformance", "prefer_same_numa"]})
    assert constraint_flags(a.spec) == {"require_conformance", "prefer_same_numa"}
    assert constraint_flags(alloc("b").spec) == frozenset()


@pytest.mark.parametrize(
    ("node_kw", "constraints", "ok"),
    [
        ({"gpu_type": "H100", "gpu_count": 4}, {"gpu_type": "h100", "gpu_count": 4}, True),
        ({"gpu_type": "H100", "gpu_count": 2}, {"gpu_count": 4}, False),
        ({"gpu_type": "A100"}, {"gpu_type": "H100"}, False),
        ({"memory_gb": 256}, {"memory_gb": 512}, False),
        ({"features": ["nvme"]}, {"features": ["nvme"]}, True),
        ({"features": []}, {"features": ["nvme"]}, False),
        # solver flags are not node features
        ({}, {"features": ["require_conformance", "prefer_same_numa"]}, True),
        ({}, {"features": ["require_unified_memory"]}, False),
        ({"features": ["unified_memory"]}, {"features": ["require_unified_memory"]}, True),
        ({"gpu_type": "GH200"}, {"features": ["require_unified_memory"]}, True),
        ({"gpu_type": "MI300A"}, {"features": ["require_unified_memory"]}, True),
        # CXL counts only with the opt-in
        ({"memory_gb": 512, "features": ["cxl_memory_gb=1024"]}, {"memory_gb": 1024}, False),
        (
            {"memory_gb": 512, "features": ["cxl_memory_gb=1024"]},
            {"memory_gb": 1024, "features": ["allow_cxl_memory"]},
            True,
        ),
        (
            {"memory_gb": 512, "features": ["cxl_memory_gb=256"]},
            {"memory_gb": 1024, "features": ["allow_cxl_memory"]},
            False,
        ),
        ({"memory_gb": 512}, {"memory_gb": 1024, "features": ["allow_cxl_memory"]}, False),
    ],
)
def test_hard_filter(node_kw: dict[str, Any], constraints: dict[str, Any], ok: bool) -> None:
    n = b.node("n", **node_kw)
    a = alloc("a", constraints=constraints)
    assert node_satisfies(n, a.spec) is ok
    res = run([a], [n])
    assert bool(res.proposals) is ok
    if not ok:
        assert res.reasons == {"a": REASON_NO_MATCH}


def test_only_ready_unowned_enabled_nodes_of_the_vcluster() -> None:
    nodes = [
        b.node("busy", owner="x"),
        b.node("down", state=N.DOWN),
        b.node("draining", state=N.DRAINING),
        b.node("off", disabled=True),
        b.node("other", home_vcluster="w"),
        b.node("mine", home_vcluster="v"),
        b.node("shared"),
    ]
    res = run([alloc("a", nodes=2)], nodes)
    assert sorted(placed(res)["a"]) == ["mine", "shared"]
    res = run([alloc("a", nodes=3)], nodes)
    assert res.reasons == {"a": REASON_OCCUPIED}  # busy/draining may come back
    res = run([alloc("a", nodes=5)], nodes)
    assert res.reasons == {"a": REASON_NO_MATCH}


def test_skips_non_pending_excluded_and_other_vclusters() -> None:
    nodes = grid({0: 4})
    allocs = [
        alloc("p"),
        alloc("r", state=A.RUNNING),
        alloc("x"),
        alloc("w", vcluster="w"),
    ]
    res = run(allocs, nodes, exclude={"x"})
    assert set(placed(res)) == {"p"}
    assert set(res.scores) == {"p"}
    assert run([], nodes).proposals == []


def test_nodes_its_prologue_failed_on_are_withheld_for_it_only() -> None:
    nodes = {n.id: n for n in (b.node(f"n{i}") for i in range(3))}
    bad = alloc("bad", nodes=2, submitted_at=1.0)
    bad.excluded_nodes = ["n0"]
    other = alloc("other", nodes=1, submitted_at=2.0)
    res = run([bad, other], nodes)
    assert placed(res) == {"bad": ("n1", "n2"), "other": ("n0",)}
    bad.spec.nodes = 3
    res = run([bad], nodes)
    assert res.reasons == {"bad": REASON_OCCUPIED}  # never on n0, whatever it waits for


# --- ordering ----------------------------------------------------------------------------


def test_order_by_score_then_class_then_submit_time_then_id() -> None:
    allocs = [
        alloc("a1", preemption_class=5, submitted_at=30.0),
        alloc("a2", preemption_class=9, submitted_at=50.0),
        alloc("a3", preemption_class=5, submitted_at=10.0),
        alloc("a4", preemption_class=5, submitted_at=10.0),
        alloc("a5", preemption_class=0, submitted_at=1.0),
        alloc("top", preemption_class=0, submitted_at=99.0),
    ]
    res = run(allocs, grid({0: 10}), scores={"top": 1.0})
    assert [p.allocation_id for p in res.proposals] == ["top", "a2", "a3", "a4", "a1", "a5"]
    assert res.proposals[0].score == 1.0


def test_higher_score_wins_contended_nodes() -> None:
    res = run([alloc("lo", nodes=3), alloc("hi", nodes=3)], grid({0: 4}), scores={"hi": 2})
    assert set(placed(res)) == {"hi"}
    assert res.reasons == {"lo": REASON_OCCUPIED}


# --- topology packing -------------------------------------------------------------------


def test_single_group_when_one_holds_the_job_tightest_first() -> None:
    nodes = grid({0: 8, 1: 4, 2: 6})
    res = run([alloc("a", nodes=4)], nodes)
    p = res.proposals[0]
    assert {nodes[n].group for n in p.node_ids} == {1}
    assert p.groups_spanned == 1
    assert len(p.node_ids) == 4


def test_large_jobs_span_the_fewest_groups_preferring_adjacent_ones() -> None:
    nodes = grid({0: 6, 2: 4, 3: 4, 5: 5})
    res = run([alloc("a", nodes=8)], nodes)
    p = res.proposals[0]
    assert sorted({nodes[n].group for n in p.node_ids}) == [2, 3]
    assert p.groups_spanned == 2


def test_prefers_the_largest_conformance_group_within_a_group() -> None:
    nodes = grid({0: 3}, conf="c1")
    nodes |= {f"x{i}": b.node(f"x{i}", group=0, conformance_group="c2") for i in range(5)}
    res = run([alloc("a", nodes=4)], nodes)
    p = res.proposals[0]
    assert all(nodes[n].conformance_group == "c2" for n in p.node_ids)
    assert p.conformance_fitness == 1.0


def test_prefers_a_homogeneous_group_over_a_tighter_mixed_one() -> None:
    nodes = grid({0: 4, 1: 6}, conf={0: "c1", 1: "c2"})
    nodes["g0n00"].conformance_group = "c9"
    res = run([alloc("a", nodes=4)], nodes)
    p = res.proposals[0]
    assert {nodes[n].group for n in p.node_ids} == {1}
    assert p.conformance_fitness == 1.0


def test_conformance_fitness_reports_a_mixed_set() -> None:
    nodes = grid({0: 2}, conf="c1") | {"z": b.node("z", group=0, conformance_group="c2")}
    nodes["u"] = b.node("u", group=0)  # unknown fingerprint: a group of one
    res = run([alloc("a", nodes=4)], nodes)
    assert res.proposals[0].conformance_fitness == 0.5
    res = run([alloc("a", nodes=1)], {"u": b.node("u")})
    assert res.proposals[0].conformance_fitness == 1.0


def test_require_conformance_is_hard() -> None:
    nodes = grid({0: 3}, conf="c1") | grid({1: 3}, conf="c2")
    rc = {"features": ["require_conformance"]}
    res = run([alloc("a", nodes=4, constraints=rc)], nodes)
    assert res.reasons == {"a": REASON_CONFORMANCE}
    res = run([alloc("a", nodes=4)], nodes)  # soft: mixes
    assert res.proposals[0].conformance_fitness == 0.75
    # the conformance group exists but is partly busy: occupied (and reserved)
    nodes = grid({0: 6}, conf="c1") | grid({1: 6}, conf="c2")
    hold = running("r", nodes, ["g0n00", "g0n01", "g0n02", "g1n00", "g1n01", "g1n02"], walltime=H)
    res = run([alloc("a", nodes=4, constraints=rc)], nodes, [hold])
    assert res.reasons == {"a": REASON_OCCUPIED}
    assert res.reservations[0].start_time == H


def test_require_conformance_picks_one_group_spanning_the_fewest_groups() -> None:
    nodes = grid({0: 2, 1: 2, 2: 2}, conf="c1") | {
        f"y{i}": b.node(f"y{i}", group=4, conformance_group="c2") for i in range(5)
    }
    rc = {"features": ["require_conformance"]}
    p = run([alloc("a", nodes=4, constraints=rc)], nodes).proposals[0]
    assert {nodes[n].conformance_group for n in p.node_ids} == {"c2"}
    assert p.groups_spanned == 1
    # single-node jobs: conformance is trivial, unknown fingerprints are fine
    res = run([alloc("a", nodes=1, constraints=rc)], {"u": b.node("u")})
    assert placed(res) == {"a": ("u",)}


def test_topology_any_relaxes_packing_for_conformance() -> None:
    # group 0 holds 4 mixed nodes; c2 has 4 nodes spread over groups 1 and 2
    nodes = {
        "a0": b.node("a0", group=0, conformance_group="c1"),
        "a1": b.node("a1", group=0, conformance_group="c1"),
        "a2": b.node("a2", group=0, conformance_group="c3"),
        "a3": b.node("a3", group=0, conformance_group="c4"),
    } | grid({1: 2, 2: 3}, conf="c2")
    packed = run([alloc("a", nodes=4)], nodes).proposals[0]
    assert packed.groups_spanned == 1 and packed.conformance_fitness == 0.5
    anyp = run([alloc("a", nodes=4, constraints={"topology": "any"})], nodes).proposals[0]
    assert anyp.conformance_fitness == 1.0 and anyp.groups_spanned == 2


def test_topology_tight_waits_for_the_ideal_span() -> None:
    nodes = grid({0: 4, 1: 4})
    hold = running("r", nodes, ["g0n00", "g1n00"], walltime=H)
    tight = alloc("t", nodes=4, constraints={"topology": "tight"}, walltime_seconds=600)
    res = run([tight], nodes, [hold])
    assert res.reasons == {"t": REASON_OCCUPIED}
    (r,) = res.reservations
    assert r.start_time == H
    assert len({nodes[n].group for n in r.node_ids}) == 1
    loose = alloc("l", nodes=4, walltime_seconds=600)
    assert run([loose], nodes, [hold]).proposals[0].groups_spanned == 2


def test_tight_ideal_span_is_per_job_size() -> None:
    """Same constraints, different sizes: each tight job gets its own ideal span."""
    nodes = grid({0: 4, 1: 4, 2: 4})
    busy = [
        "g0n00",
        "g0n01",
        "g0n02",
        "g0n03",
        "g1n00",
        "g1n01",
        "g1n02",
        "g2n00",
        "g2n01",
        "g2n02",
    ]
    hold = running("r", nodes, busy, walltime=H)
    tight = {"topology": "tight"}
    pending = [alloc("six", nodes=6, constraints=tight), alloc("two", nodes=2, constraints=tight)]
    res = run(pending, nodes, [hold], scores={"six": 2, "two": 1}, backfill_depth=0)
    # two nodes are free, one in each of groups 1 and 2: "two" fits in one group when
    # idle, so it waits instead of spanning two
    assert res.proposals == []
    assert res.reasons == {"six": REASON_OCCUPIED, "two": REASON_OCCUPIED}


def test_prefer_same_numa_takes_single_domain_nodes_first() -> None:
    nodes = {f"m{i}": b.node(f"m{i}", conformance_group="c") for i in range(3)}
    nodes |= {
        f"s{i}": b.node(f"s{i}", conformance_group="c", features=["single_numa"]) for i in range(2)
    }
    res = run([alloc("a", nodes=2, constraints={"features": ["prefer_same_numa"]})], nodes)
    assert sorted(placed(res)["a"]) == ["s0", "s1"]
    assert res.proposals[0].memory_locality == 1.0
    res = run([alloc("a", nodes=2)], nodes)  # least capable first: plain nodes
    assert sorted(placed(res)["a"]) == ["m0", "m1"]
    assert res.proposals[0].memory_locality == 0.0


def test_small_jobs_leave_rarer_nodes_for_jobs_that_need_them() -> None:
    nodes = {
        "gpu": b.node("gpu", gpu_type="H100", gpu_count=4),
        "cpu": b.node("cpu"),
    }
    res = run([alloc("any1"), alloc("needs_gpu", constraints={"gpu_type": "H100"})], nodes)
    assert placed(res) == {"any1": ("cpu",), "needs_gpu": ("gpu",)}


# --- quotas and power -------------------------------------------------------------------


def test_quota_precheck() -> None:
    nodes = grid({0: 8})
    tenants = {"t": Tenant(name="t", max_nodes=3, max_concurrent_allocations=2)}
    hold = running("r", nodes, ["g0n00"], walltime=H)
    allocs = [alloc("a", nodes=2), alloc("b", nodes=1), alloc("c")]
    res = run(allocs, nodes, [hold], tenants=tenants, scores={"a": 3, "b": 2, "c": 1})
    assert set(placed(res)) == {"a"}
    assert res.reasons == {"b": REASON_QUOTA, "c": REASON_QUOTA}
    assert res.reservations == []  # quota waits are not reserved


def test_power_headroom() -> None:
    nodes = grid({0: 4})
    power = {n: 2.0 for n in nodes}
    allocs = [alloc("a", nodes=2), alloc("b", nodes=2)]
    res = run(
        allocs,
        nodes,
        scores={"a": 2},
        power_headroom_kw=5.0,
        node_power_kw=power,
    )
    assert set(placed(res)) == {"a"}
    assert res.reasons == {"b": REASON_POWER}
    assert run(allocs, nodes, power_headroom_kw=8.0, node_power_kw=power).pending == []


# --- backfill ----------------------------------------------------------------------------


def backfill_case() -> tuple[dict[str, Node], list[Allocation], list[Allocation]]:
    """4 nodes; 2 held by a job ending in 1 h; a 4-node job (highest score), a short
    2-node 30 min job and a long 2-node 2 h job pending."""
    nodes = grid({0: 4})
    hold = running("r", nodes, ["g0n00", "g0n01"], walltime=H)
    pending = [
        alloc("big", nodes=4, walltime_seconds=int(4 * H)),
        alloc("long", nodes=2, walltime_seconds=int(2 * H)),
        alloc("short", nodes=2, walltime_seconds=int(0.5 * H)),
    ]
    return nodes, [hold], pending


SCORES = {"big": 3.0, "long": 2.0, "short": 1.0}


def test_short_job_backfills_without_delaying_the_reserved_large_job() -> None:
    nodes, holding, pending = backfill_case()
    res = run(pending, nodes, holding, scores=SCORES)
    (p,) = res.proposals
    assert p.allocation_id == "short" and p.backfilled
    assert sorted(p.node_ids) == ["g0n02", "g0n03"]
    big = res.reservations[0]
    assert big.allocation_id == "big"
    assert big.start_time == H  # not delayed: the short job ends at 0.5 h
    assert sorted(big.node_ids) == sorted(nodes)
    assert big.end_time == 5 * H
    assert res.reasons == {"big": REASON_OCCUPIED, "long": REASON_OCCUPIED}


def test_long_job_does_not_backfill_in_front_of_the_reservation() -> None:
    nodes, holding, pending = backfill_case()
    long_ = [a for a in pending if a.id != "short"]
    res = run(long_, nodes, holding, scores=SCORES)
    assert res.proposals == []
    assert res.reservations[0].start_time == H
    # without reservations (depth 0) it would have started and delayed "big"
    res = run(long_, nodes, holding, scores=SCORES, backfill_depth=0)
    assert set(placed(res)) == {"long"}
    assert res.reservations == []


def test_backfill_may_use_unreserved_nodes_however_long() -> None:
    nodes = grid({0: 6})
    hold = running("r", nodes, ["g0n00", "g0n01"], walltime=H)
    pending = [
        alloc("big", nodes=5, walltime_seconds=int(4 * H)),
        alloc("forever", nodes=1, walltime_seconds=0, lifecycle="unbounded"),
        alloc("long", nodes=1, walltime_seconds=int(10 * H)),
    ]
    res = run(pending, nodes, [hold], scores={"big": 3, "forever": 2, "long": 1})
    big = res.reservations[0]
    assert big.allocation_id == "big" and big.start_time == H
    got = placed(res)
    assert set(got) == {"forever"}  # on the one free node big does not need
    assert not set(big.node_ids) & set(got["forever"])
    assert big.end_time == 5 * H
    assert res.reasons["long"] == REASON_OCCUPIED
    # "long" is reserved after big ends (conservative: reserved nodes busy until then)
    assert [r.allocation_id for r in res.reservations] == ["big", "long"]
    assert res.reservations[1].start_time == 5 * H


def test_easy_versus_conservative_depth() -> None:
    """big (GPU) is reserved on the GPU nodes, mid on the CPU nodes, both at +1 h. A 2 h
    job on the free CPU node would delay mid: conservative (depth 10) keeps it out;
    EASY (depth 1) protects only big and lets it start."""
    nodes = {
        "gpu0": b.node("gpu0", gpu_type="H100", gpu_count=4),
        "gpu1": b.node("gpu1", gpu_type="H100", gpu_count=4),
        "cpu0": b.node("cpu0"),
        "cpu1": b.node("cpu1"),
    }
    hold = running("r", nodes, ["gpu0", "cpu0"], walltime=H)
    pending = [
        alloc("big", nodes=2, walltime_seconds=int(H), constraints={"gpu_type": "H100"}),
        alloc("mid", nodes=2, walltime_seconds=int(2 * H)),  # too long to go first
        alloc("small", nodes=1, walltime_seconds=int(2 * H)),
    ]
    scores = {"big": 3, "mid": 2, "small": 1}
    deep = run(pending, nodes, [hold], scores=scores, backfill_depth=10)
    assert [(r.allocation_id, r.start_time) for r in deep.reservations][:2] == [
        ("big", H),
        ("mid", H),
    ]
    assert set(deep.reservations[1].node_ids) == {"cpu0", "cpu1"}
    assert deep.proposals == []
    easy = run(pending, nodes, [hold], scores=scores, backfill_depth=1)
    assert [r.allocation_id for r in easy.reservations] == ["big"]
    assert placed(easy) == {"small": ("cpu1",)}
    assert easy.proposals[0].backfilled
    none = run(pending, nodes, [hold], scores=scores, backfill_depth=0)
    assert none.reservations == []
    assert placed(none) == {"mid": ("cpu1", "gpu1")}  # greedy: big is delayed


def test_backfill_on_reserved_free_nodes_requires_ending_before_the_start() -> None:
    nodes = grid({0: 4})
    hold = running("r", nodes, ["g0n00"], walltime=H)
    pending = [
        alloc("big", nodes=4, walltime_seconds=int(H)),
        alloc("fits", nodes=3, walltime_seconds=int(H)),  # ends exactly at the start
        alloc("late", nodes=1, walltime_seconds=int(H) + 1),
    ]
    res = run(pending, nodes, [hold], scores={"big": 3, "fits": 2, "late": 1})
    assert set(placed(res)) == {"fits"}
    assert res.reasons["late"] == REASON_OCCUPIED
    assert res.reservations[0].start_time == H


def test_overrunning_and_unbounded_holders() -> None:
    nodes = grid({0: 2})
    over = running("over", nodes, ["g0n00"], walltime=60, started_at=-H)
    forever = running("forever", nodes, ["g0n01"], walltime=0)
    res = run([alloc("a", nodes=1), alloc("b", nodes=2)], nodes, [over, forever], now=0.0)
    assert res.proposals == []
    reserved = {r.allocation_id: r for r in res.reservations}
    assert reserved["a"].start_time == 0.0  # overdue: expected any moment
    assert "b" not in reserved  # never, as far as anyone knows
    assert res.reasons == {"a": REASON_OCCUPIED, "b": REASON_OCCUPIED}


def test_reservations_account_for_proposals_made_this_cycle() -> None:
    nodes = grid({0: 4})
    pending = [
        alloc("first", nodes=2, walltime_seconds=int(2 * H)),
        alloc("big", nodes=4, walltime_seconds=int(H)),
    ]
    res = run(pending, nodes, scores={"first": 2, "big": 1})
    assert set(placed(res)) == {"first"}
    assert res.proposals[0].backfilled is False
    assert res.reservations[0].start_time == 2 * H


# --- choose / fitness helpers ---------------------------------------------------------------


def test_choose_and_plan_fitness() -> None:
    by_group = {0: {"a": 2, None: 1}, 1: {"b": 3}}
    totals = {0: 3, 1: 3}
    plan = choose(by_group, totals, 6, 4)
    assert plan is not None and sum(sum(p.values()) for p in plan.values()) == 4
    assert plan_fitness(plan, 4)[0] == 2
    assert choose(by_group, totals, 6, 7) is None
    assert choose(by_group, totals, 6, 4, max_span=1) is None
    assert choose(by_group, totals, 6, 3, require_conformance=True) == {1: {"b": 3}}
    assert choose(by_group, totals, 6, 1) == {0: {None: 1}}
    assert plan_fitness({0: {None: 2}}, 2) == (1, 0.5)


# --- determinism -------------------------------------------------------------------------


def test_same_input_same_output_regardless_of_order() -> None:
    rng = random.Random(3)
    nodes = {}
    for i in range(200):
        nid = f"n{i:03d}"
        nodes[nid] = b.node(
            nid,
            group=rng.randrange(8),
            conformance_group=rng.choice(["c1", "c2", "c3", ""]),
            gpu_type=rng.choice(["", "H100"]),
        )
    hold = running("r", nodes, [f"n{i:03d}" for i in range(0, 200, 3)], walltime=H)
    pending = [
        alloc(
            f"a{i:02d}",
            nodes=rng.choice([1, 2, 4, 8, 16, 40]),
            walltime_seconds=rng.choice([0, 600, 7200]),
            constraints={
                "topology": rng.choice(["", "tight", "any"]),
                "features": rng.choice([[], ["require_conformance"]]),
            },
        )
        for i in range(40)
    ]
    scores = {a.id: rng.choice([0.1, 0.5, 0.9]) for a in pending}
    first = run(pending, nodes, [hold], scores=scores)
    shuffled_nodes = list(nodes.values())
    rng.shuffle(shuffled_nodes)
    shuffled_pending = pending[:]
    rng.shuffle(shuffled_pending)
    second = run(shuffled_pending, shuffled_nodes, [hold], scores=scores)
    assert first == second
    assert first.proposals and first.reservations


def test_prebuilt_topology_gives_the_same_result() -> None:
    nodes, holding, pending = backfill_case()
    topo = TopologyModel.from_nodes(nodes)
    assert run(pending, nodes, holding, scores=SCORES, topology=topo) == run(
        pending, nodes, holding, scores=SCORES
    )


# --- properties --------------------------------------------------------------------------

GPU_TYPES = ["", "H100", "GH200"]
NODE_FEATURES = ["nvme", "unified_memory", "cxl_memory_gb=1024", "single_numa"]
JOB_FEATURES = ["nvme", *sorted(FLAGS)]


def cxl_gb(features: list[str]) -> int:
    return max(
        (int(f.split("=")[1]) for f in features if f.startswith("cxl_memory_gb=")), default=0
    )


def hard_ok(n: Node, a: Allocation) -> bool:
    """Independent re-statement of the hard filter."""
    c = a.spec.constraints
    caps = n.capabilities
    flags = set(c.features) & FLAGS
    if c.gpu_type and caps.gpu_type.lower() != c.gpu_type.lower():
        return False
    if c.gpu_count and caps.gpu_count < c.gpu_count:
        return False
    mem = caps.memory_gb + (cxl_gb(caps.features) if "allow_cxl_memory" in flags else 0)
    if c.memory_gb and mem < c.memory_gb:
        return False
    if not (set(c.features) - FLAGS) <= set(caps.features):
        return False
    unified = "unified_memory" in caps.features or caps.gpu_type.lower() in ("gh200", "mi300a")
    return not ("require_unified_memory" in flags and not unified)


def free_for(n: Node, vcluster: str = "v") -> bool:
    return (
        n.state == N.READY and not n.owner and not n.disabled and n.home_vcluster in ("", vcluster)
    )


def min_span_largest_first(nodes: list[Node], k: int) -> int | None:
    sizes = sorted(Counter(n.group for n in nodes).values(), reverse=True)
    acc = 0
    for i, s in enumerate(sizes, 1):
        acc += s
        if acc >= k:
            return i
    return None


def min_span(nodes: list[Node], k: int, need_conf: bool) -> int | None:
    if not need_conf:
        return min_span_largest_first(nodes, k)
    spans = [
        m
        for cg in {n.conformance_group for n in nodes if n.conformance_group}
        if (m := min_span_largest_first([n for n in nodes if n.conformance_group == cg], k))
        is not None
    ]
    return min(spans, default=None)


@st.composite
def scenario(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(0, 28))
    nodes: dict[str, Node] = {}
    for i in range(count):
        gt = draw(st.sampled_from(GPU_TYPES))
        nid = f"n{i:02d}"
        nodes[nid] = b.node(
            nid,
            group=draw(st.integers(0, 5)),
            conformance_group=draw(st.sampled_from(["", "c1", "c1", "c2", "c3"])),
            gpu_type=gt,
            gpu_count=draw(st.integers(1, 4)) if gt else 0,
            memory_gb=draw(st.sampled_from([256, 512])),
            features=draw(st.lists(st.sampled_from(NODE_FEATURES), unique=True, max_size=2)),
            state=draw(st.sampled_from([N.READY] * 6 + [N.DOWN, N.DRAINING])),
            home_vcluster=draw(st.sampled_from(["", "", "", "v", "w"])),
            disabled=draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans()),
        )
    holders: list[Allocation] = []
    owned = [nid for nid in nodes if draw(st.integers(0, 2)) == 0]
    for j in range(0, len(owned), 3):
        ids = owned[j : j + 3]
        holders.append(
            running(
                f"r{j}",
                nodes,
                ids,
                walltime=draw(st.sampled_from([0, 900, 3600, 7200])),
                started_at=draw(st.sampled_from([-3000.0, 0.0])),
                tenant=draw(st.sampled_from(["t1", "t2"])),
            )
        )
    pending = []
    for i in range(draw(st.integers(0, 10))):
        pending.append(
            alloc(
                f"p{i}",
                nodes=draw(st.integers(1, 7)),
                tenant=draw(st.sampled_from(["t1", "t2", "t3"])),
                walltime_seconds=draw(st.sampled_from([0, 600, 3600, 7200])),
                preemption_class=draw(st.integers(0, 3)),
                submitted_at=draw(st.sampled_from([0.0, 10.0])),
                constraints={
                    "gpu_type": draw(st.sampled_from(["", "", "h100", "GH200"])),
                    "gpu_count": draw(st.sampled_from([0, 0, 2])),
                    "memory_gb": draw(st.sampled_from([0, 0, 512, 1024])),
                    "features": draw(
                        st.lists(st.sampled_from(JOB_FEATURES), unique=True, max_size=3)
                    ),
                    "topology": draw(st.sampled_from(["", "", "tight", "any"])),
                },
            )
        )
    scores = {a.id: draw(st.sampled_from([0.0, 0.3, 0.7])) for a in pending}
    tenants = {
        "t1": Tenant(name="t1", max_nodes=draw(st.sampled_from([None, 4, 10]))),
        "t2": Tenant(name="t2", max_concurrent_allocations=draw(st.sampled_from([None, 1, 3]))),
    }
    return {
        "nodes": nodes,
        "holders": holders,
        "pending": pending,
        "scores": scores,
        "tenants": tenants,
        "depth": draw(st.sampled_from([0, 1, 10])),
    }


def solve_scenario(s: dict[str, Any], **kw: Any) -> SolveResult:
    kw.setdefault("backfill_depth", s["depth"])
    return run(
        s["pending"],
        s["nodes"],
        s["holders"],
        scores=s["scores"],
        tenants=s["tenants"],
        **kw,
    )


@settings(max_examples=200, deadline=None)
@given(scenario())
def test_proposals_are_valid(s: dict[str, Any]) -> None:
    res = solve_scenario(s)
    nodes: dict[str, Node] = s["nodes"]
    allocs = {a.id: a for a in s["pending"]}
    used: set[str] = set()
    tenant_nodes = Counter()
    tenant_allocs = Counter()
    for h in s["holders"]:
        tenant_nodes[h.spec.tenant] += len(h.assigned_nodes)
        tenant_allocs[h.spec.tenant] += 1
    for p in res.proposals:
        a = allocs[p.allocation_id]
        assert len(p.node_ids) == a.spec.nodes  # exactly the size asked for
        assert len(set(p.node_ids)) == len(p.node_ids)
        assert not used & set(p.node_ids)  # no node used twice
        used |= set(p.node_ids)
        for nid in p.node_ids:
            assert free_for(nodes[nid])
            assert hard_ok(nodes[nid], a)
        confs = [nodes[n].conformance_group for n in p.node_ids]
        if "require_conformance" in a.spec.constraints.features and a.spec.nodes > 1:
            assert len(set(confs)) == 1 and confs[0]
            assert p.conformance_fitness == 1.0
        assert p.groups_spanned == len({nodes[n].group for n in p.node_ids})
        t = s["tenants"].get(a.spec.tenant)
        tenant_nodes[a.spec.tenant] += a.spec.nodes
        tenant_allocs[a.spec.tenant] += 1
        if t is not None and t.max_nodes is not None:
            assert tenant_nodes[a.spec.tenant] <= t.max_nodes
        if t is not None and t.max_concurrent_allocations is not None:
            assert tenant_allocs[a.spec.tenant] <= t.max_concurrent_allocations
    # every pending allocation is either proposed or has exactly one reason
    assert sorted([p.allocation_id for p in res.proposals] + list(res.reasons)) == sorted(allocs)
    for r in res.reservations:
        a = allocs[r.allocation_id]
        assert res.reasons[r.allocation_id] == REASON_OCCUPIED
        assert len(set(r.node_ids)) == a.spec.nodes
        assert r.start_time >= 0.0
        assert all(hard_ok(nodes[n], a) for n in r.node_ids)
    assert len(res.reservations) <= s["depth"]


@settings(max_examples=200, deadline=None)
@given(scenario())
def test_no_proposal_delays_a_reservation(s: dict[str, Any]) -> None:
    res = solve_scenario(s)
    order = list(res.scores)  # insertion order is not score order: rebuild it
    allocs = {a.id: a for a in s["pending"]}
    order = sorted(
        allocs,
        key=lambda i: (
            -res.scores[i],
            -allocs[i].spec.preemption_class,
            allocs[i].submitted_at,
            i,
        ),
    )
    rank = {aid: i for i, aid in enumerate(order)}
    for p in res.proposals:
        w = allocs[p.allocation_id].spec.walltime_seconds
        end = w if w > 0 else INF  # now = 0
        for r in res.reservations:
            if rank[r.allocation_id] < rank[p.allocation_id] and end > r.start_time:
                assert not set(p.node_ids) & set(r.node_ids)
                assert p.backfilled


@settings(max_examples=200, deadline=None)
@given(scenario())
def test_spans_are_minimal_and_greedy_is_complete(s: dict[str, Any]) -> None:
    """Without reservations: every placement spans the fewest groups the free matching
    nodes left at its turn allow, and a job packed normally waits only when fewer than
    its size are free."""
    res = solve_scenario(s, backfill_depth=0)
    nodes: dict[str, Node] = s["nodes"]
    proposals = placed(res)
    taken: set[str] = set()
    by_id = {a.id: a for a in s["pending"]}
    order = sorted(
        by_id,
        key=lambda i: (-res.scores[i], -by_id[i].spec.preemption_class, by_id[i].submitted_at, i),
    )
    for aid in order:
        a = by_id[aid]
        k = a.spec.nodes
        c = a.spec.constraints
        free = [n for n in nodes.values() if free_for(n) and n.id not in taken and hard_ok(n, a)]
        need_conf = "require_conformance" in c.features and k > 1
        usable = [
            n
            for n in nodes.values()
            if n.state not in (N.DOWN, N.FAILED)
            and not n.disabled
            and n.home_vcluster in ("", "v")
            and hard_ok(n, a)
        ]
        best = min_span(free, k, need_conf)
        ideal = min_span(usable, k, need_conf)  # every usable node free
        if aid in proposals:
            span = len({nodes[n].group for n in proposals[aid]})
            if c.topology != "any":
                assert best is not None
                assert span == best
            if c.topology == "tight":
                assert ideal is not None and span <= ideal
            taken |= set(proposals[aid])
        elif res.reasons[aid] == REASON_OCCUPIED:
            # it would have fitted (within its ideal span, when tight)
            assert best is None or (c.topology == "tight" and best > ideal)


@settings(max_examples=100, deadline=None)
@given(scenario())
def test_deterministic(s: dict[str, Any]) -> None:
    assert solve_scenario(s) == solve_scenario(s)
