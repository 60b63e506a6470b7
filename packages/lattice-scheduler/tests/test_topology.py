"""Topology model: groups, adjacency, conformance, free nodes, signatures, group choice.

Examples first, then Hypothesis properties: ``fewest_groups`` always uses the minimum
number of groups (computed here independently, largest groups first), holds ``k``
nodes, and prefers a run of adjacent groups whenever one of that size holds the job.
"""

from __future__ import annotations

import random
from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import NodeState
from lattice_scheduler.topology import (
    Signature,
    TopologyModel,
    fewest_groups,
    is_free,
    min_groups,
)
from lattice_test_harness import builders as b

N = NodeState


def test_from_nodes_groups_sizes_and_free_nodes() -> None:
    nodes = [
        b.node("n3", group=1, conformance_group="c1"),
        b.node("n1", group=0, conformance_group="c1"),
        b.node("n2", group=0, conformance_group="c2", owner="a1"),
        b.node("n4", group=1, conformance_group="c1", state=N.DOWN),
        b.node("n5", group=3, conformance_group="", disabled=True),
        b.node("n0", group=0, conformance_group="c1"),
    ]
    topo = TopologyModel.from_nodes(nodes)
    assert topo.groups == (0, 1, 3)
    assert topo.group_size == {0: 3, 1: 2, 3: 1}
    assert topo.nodes_by_group[0] == ("n0", "n1", "n2")
    assert topo.free_by_group == {0: ("n0", "n1"), 1: ("n3",), 3: ()}
    assert topo.conformance_by_group[0] == {"c1": 2, "c2": 1}
    assert topo.conformance_by_group[3] == {"": 1}
    assert topo.largest_conformance_group(0) == ("c1", 2)
    assert topo.largest_conformance_group(3) == ("", 0)
    assert topo.free_count(0) == 2 and topo.free_count(7) == 0
    assert list(topo.nodes) == sorted(topo.nodes)


def test_from_nodes_accepts_a_mapping_and_ignores_input_order() -> None:
    inv = b.inventory(40, groups=4)
    items = list(inv.values())
    random.Random(7).shuffle(items)
    a = TopologyModel.from_nodes(inv)
    c = TopologyModel.from_nodes(items)
    assert a.free_by_group == c.free_by_group
    assert a.node_signature == c.node_signature


def test_adjacency_is_g_plus_minus_one_without_wraparound() -> None:
    topo = TopologyModel.from_nodes([b.node(f"n{g}", group=g) for g in (0, 1, 2, 4)])
    assert topo.adjacent(0, 1) and topo.adjacent(1, 0) and topo.adjacent(1, 2)
    assert not topo.adjacent(0, 2)
    assert not topo.adjacent(2, 3)  # group 3 does not exist
    assert not topo.adjacent(4, 0)  # no wrap-around
    assert topo.neighbours(1) == (0, 2)
    assert topo.neighbours(4) == ()


def test_signatures_are_shared_and_decode_memory_flags() -> None:
    nodes = [
        b.node("a", gpu_type="GH200", gpu_count=4, features=["x", "y"]),
        b.node("b", gpu_type="gh200", gpu_count=4, features=["y", "x"]),
        b.node("c", features=["unified_memory"]),
        b.node("d", features=["cxl_memory_gb=2048"]),
        b.node("e", features=["cxl_memory"]),
        b.node("f", features=["single_numa", "cxl_memory_gb:512"]),
    ]
    topo = TopologyModel.from_nodes(nodes)
    assert topo.node_signature["a"] == topo.node_signature["b"]  # case and order
    gh = topo.signature("a")
    assert gh.unified_memory and gh.numa_local and gh.gpu_type == "gh200"
    assert topo.signature("c").unified_memory
    assert topo.signature("d").cxl_memory_gb == 2048 and topo.signature("d").has_cxl
    assert topo.signature("e").cxl_memory_gb == 0 and topo.signature("e").has_cxl
    f = topo.signature("f")
    assert f.cxl_memory_gb == 512 and f.numa_local and not f.unified_memory
    assert not topo.signature("d").numa_local


def test_signature_sort_key_puts_least_capable_first() -> None:
    plain = Signature.of("", 0, 256, [])
    gpu = Signature.of("H100", 4, 256, [])
    big = Signature.of("", 0, 1024, ["nvme"])
    assert sorted([gpu, big, plain], key=Signature.sort_key) == [plain, big, gpu]


def test_is_free() -> None:
    assert is_free(b.node("n"))
    assert not is_free(b.node("n", owner="a"))
    assert not is_free(b.node("n", state=N.DRAINING))
    assert not is_free(b.node("n", disabled=True))


def test_builds_ten_thousand_nodes() -> None:
    inv = b.inventory(10_000, groups=128)
    topo = TopologyModel.from_nodes(inv)
    assert len(topo.groups) == 128
    assert sum(topo.group_size.values()) == 10_000
    assert len(topo.signatures) == 1


# --- group choice -----------------------------------------------------------------------


def test_min_groups() -> None:
    assert min_groups({0: 3, 1: 5, 2: 2}, 5) == 1
    assert min_groups({0: 3, 1: 5, 2: 2}, 6) == 2
    assert min_groups({0: 3, 1: 5, 2: 2}, 10) == 3
    assert min_groups({0: 3, 1: 5, 2: 2}, 11) is None
    assert min_groups({}, 0) == 0


def test_fewest_groups_picks_the_tightest_single_group() -> None:
    assert fewest_groups({0: 10, 1: 4, 2: 6}, 4) == [1]
    assert fewest_groups({0: 4, 1: 4}, 4) == [0]  # tie: lower id


def test_fewest_groups_prefers_adjacent_groups_of_the_same_span() -> None:
    # largest-first would take groups 0 and 5 (6 + 5); 2 and 3 are adjacent and hold 8
    counts = {0: 6, 2: 4, 3: 4, 5: 5}
    assert sorted(fewest_groups(counts, 8) or []) == [2, 3]
    # of two adjacent runs the tightest one wins
    counts = {0: 5, 1: 5, 3: 4, 4: 4}
    assert sorted(fewest_groups(counts, 8) or []) == [3, 4]


def test_fewest_groups_falls_back_to_largest_groups() -> None:
    counts = {0: 6, 2: 1, 4: 5, 6: 1}
    assert fewest_groups(counts, 10) == [0, 4]


def test_fewest_groups_orders_groups_by_size_and_respects_max_span() -> None:
    assert fewest_groups({3: 2, 4: 5}, 6) == [4, 3]
    assert fewest_groups({3: 2, 4: 5}, 6, max_span=1) is None
    assert fewest_groups({3: 2, 4: 5}, 8) is None
    assert fewest_groups({3: 0}, 1) is None
    assert fewest_groups({3: 2}, 0) == []


def brute_min_span(counts: dict[int, int], k: int) -> int | None:
    gs = [g for g, c in counts.items() if c > 0]
    for m in range(1, len(gs) + 1):
        if any(sum(counts[g] for g in combo) >= k for combo in combinations(gs, m)):
            return m
    return None


@settings(max_examples=300, deadline=None)
@given(
    counts=st.dictionaries(st.integers(0, 12), st.integers(0, 9), max_size=9),
    k=st.integers(1, 40),
)
def test_fewest_groups_uses_the_minimum_number_of_groups(counts: dict[int, int], k: int) -> None:
    m = brute_min_span(counts, k)
    got = fewest_groups(counts, k)
    if m is None:
        assert got is None
        return
    assert got is not None
    assert len(got) == m == min_groups(counts, k)
    assert len(set(got)) == len(got)
    assert sum(counts[g] for g in got) >= k
    # filled in order, every group contributes (none is dead weight)
    assert sum(counts[g] for g in got[:-1]) < k
    # an adjacent run of m groups holding k is preferred when one exists
    if m > 1:
        runs = [
            s
            for s in counts
            if all(counts.get(s + i, 0) > 0 for i in range(m))
            and sum(counts[s + i] for i in range(m)) >= k
        ]
        if runs:
            assert sorted(got) == list(range(min(got), min(got) + m))
