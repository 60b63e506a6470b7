"""The internal budget ledger: examples from the specification's formula, and properties."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common import ledger
from lattice_common.ledger import (
    DEFAULT_BUDGET_PERIOD_DAYS,
    Usage,
    allocation_hours,
    budget_fraction,
    budget_status,
    budget_utilization,
    node_gpu_counts,
    usage,
    usage_by,
)
from lattice_common.types import (
    Allocation,
    AllocationSpec,
    AllocationState,
    Constraints,
    Node,
    NodeCapabilities,
    Tenant,
)

H = 3600.0
DAY = 86400.0
NOW = 1_750_000_000.0


def alloc(
    id: str = "a",
    *,
    tenant: str = "physics",
    user: str = "alice",
    state: AllocationState = AllocationState.COMPLETED,
    started: float | None = NOW - 2 * H,
    finished: float | None = NOW - H,
    nodes: list[str] | None = None,
    spec_nodes: int = 1,
    gpu_count: int = 0,
) -> Allocation:
    if state in (AllocationState.RUNNING, AllocationState.PENDING):
        finished = None
    return Allocation(
        id=id,
        spec=AllocationSpec(
            entrypoint="true",
            tenant=tenant,
            vcluster="batch",
            user=user,
            nodes=spec_nodes,
            constraints=Constraints(gpu_count=gpu_count),
        ),
        state=state,
        assigned_nodes=list(nodes if nodes is not None else ["n1"]),
        started_at=started,
        finished_at=finished,
    )


# --------------------------------------------------------------------------- examples


def test_completed_allocation_node_and_gpu_hours():
    a = alloc(nodes=["n1", "n2"], started=NOW - 3 * H, finished=NOW - H)
    u = usage([a], now=NOW, window_days=90, node_gpus={"n1": 4, "n2": 4})
    assert u.node_hours == pytest.approx(4.0)  # 2 h x 2 nodes
    assert u.gpu_hours == pytest.approx(16.0)  # 2 h x (4 + 4) GPUs
    assert u.allocations == 1 and u.running_allocations == 0 and u.nodes_in_use == 0
    assert u.until == NOW and u.since == NOW - 90 * DAY and u.window_days == 90


def test_running_allocation_counts_to_now():
    a = alloc(state=AllocationState.RUNNING, started=NOW - 30 * 60, nodes=["n1", "n2", "n3"])
    u = usage([a], now=NOW, window_days=1, node_gpus={"n1": 0, "n2": 0, "n3": 0})
    assert u.node_hours == pytest.approx(1.5)
    assert u.gpu_hours == 0.0  # CPU-only nodes: node-hours is the universal metric
    assert u.running_allocations == 1 and u.nodes_in_use == 3
    later = usage([a], now=NOW + H, window_days=1, node_gpus={"n1": 0, "n2": 0, "n3": 0})
    assert later.node_hours == pytest.approx(4.5)


def test_gpu_count_lookup_order():
    # known node -> inventory; unknown node -> the request's gpu_count; else 1
    a = alloc(nodes=["known", "unknown"], gpu_count=2, started=NOW - H, finished=NOW)
    assert usage([a], now=NOW, node_gpus={"known": 8}).gpu_hours == pytest.approx(10.0)
    assert usage([a], now=NOW, node_gpus=None).gpu_hours == pytest.approx(4.0)
    b = alloc(nodes=["x", "y"], gpu_count=0, started=NOW - H, finished=NOW)
    assert usage([b], now=NOW).gpu_hours == pytest.approx(2.0)  # unknown nodes = 1 GPU
    assert usage([b], now=NOW, node_gpus={"x": 0}).gpu_hours == pytest.approx(1.0)


def test_no_assigned_nodes_falls_back_to_spec_nodes():
    a = alloc(nodes=[], spec_nodes=4, gpu_count=2, started=NOW - H, finished=NOW)
    u = usage([a], now=NOW)
    assert u.node_hours == pytest.approx(4.0) and u.gpu_hours == pytest.approx(8.0)


def test_duplicate_assigned_node_counts_once():
    a = alloc(nodes=["n1", "n1"], started=NOW - H, finished=NOW)
    assert usage([a], now=NOW).node_hours == pytest.approx(1.0)


def test_rolling_window_clips_and_excludes():
    inside = alloc("in", started=NOW - 10 * DAY, finished=NOW - 9 * DAY)
    straddling = alloc("cut", started=NOW - 91 * DAY, finished=NOW - 89 * DAY)
    outside = alloc("out", started=NOW - 200 * DAY, finished=NOW - 100 * DAY)
    u = usage([inside, straddling, outside], now=NOW, window_days=90)
    assert u.node_hours == pytest.approx(24.0 + 24.0)  # one day + the day inside the window
    assert u.allocations == 2
    assert usage([inside], now=NOW, window_days=5).node_hours == 0.0
    assert usage([inside], now=NOW, window_days=5).allocations == 0


def test_states_that_do_not_count():
    pending = alloc("p", state=AllocationState.PENDING, started=None)
    suspended = alloc("s", state=AllocationState.SUSPENDED, nodes=[], finished=None)
    cancelled_before_start = alloc("c", state=AllocationState.CANCELLED, started=None)
    future = alloc("f", state=AllocationState.RUNNING, started=NOW + 10)
    terminal_without_end = alloc("t", state=AllocationState.FAILED, finished=None)
    u = usage([pending, suspended, cancelled_before_start, future, terminal_without_end], now=NOW)
    assert (u.node_hours, u.gpu_hours, u.allocations) == (0.0, 0.0, 0)
    assert u.running_allocations == 1  # `future` holds its node now


def test_cancelled_and_failed_running_time_counts():
    c = alloc("c", state=AllocationState.CANCELLED, started=NOW - 2 * H, finished=NOW - H)
    f = alloc("f", state=AllocationState.FAILED, started=NOW - 2 * H, finished=NOW - H)
    assert usage([c, f], now=NOW).node_hours == pytest.approx(2.0)


def test_finished_after_now_is_clipped_to_now():
    a = alloc(started=NOW - H, finished=NOW + H)
    assert usage([a], now=NOW).node_hours == pytest.approx(1.0)


def test_filters_and_grouping():
    recs = [
        alloc("1", tenant="physics", user="alice"),
        alloc("2", tenant="physics", user="bob"),
        alloc("3", tenant="bio", user="alice"),
        alloc("4", tenant="bio", user="carol", started=None),
    ]
    assert usage(recs, now=NOW, tenant="physics").node_hours == pytest.approx(2.0)
    assert usage(recs, now=NOW, user="alice").node_hours == pytest.approx(2.0)
    assert usage(recs, now=NOW, tenant="bio", user="alice").allocations == 1
    by_t = usage_by(recs, "tenant", now=NOW)
    assert list(by_t) == ["bio", "physics"]
    assert by_t["physics"].allocations == 2
    by_u = usage_by(recs, "user", now=NOW, tenant="physics")
    assert list(by_u) == ["alice", "bob"]  # carol never ran: not listed
    with pytest.raises(ValueError):
        usage_by(recs, "project", now=NOW)  # type: ignore[arg-type]


def test_bad_windows():
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError):
            usage([], now=NOW, window_days=bad)


def test_budget_fraction_takes_the_worse():
    u = Usage(since=0, until=1, window_days=90, node_hours=50.0, gpu_hours=400.0)
    assert budget_fraction(u, Tenant(name="t")) is None
    assert budget_fraction(u, Tenant(name="t", gpu_hours_budget=1000)) == pytest.approx(0.4)
    assert budget_fraction(u, Tenant(name="t", node_hours_budget=100)) == pytest.approx(0.5)
    both = Tenant(name="t", gpu_hours_budget=1000, node_hours_budget=100)
    assert budget_fraction(u, both) == pytest.approx(0.5)
    st_ = budget_status(u, both)
    assert st_.gpu_fraction == pytest.approx(0.4) and st_.node_fraction == pytest.approx(0.5)
    assert st_.gpu_hours_remaining == pytest.approx(600.0)
    assert st_.node_hours_remaining == pytest.approx(50.0)
    over = budget_status(u, Tenant(name="t", node_hours_budget=25))
    assert over.fraction == pytest.approx(2.0) and over.node_hours_remaining == 0.0
    assert over.gpu_fraction is None and over.gpu_hours_remaining is None
    assert budget_fraction(u, Tenant(name="t", gpu_hours_budget=0)) == 1.0


def test_budget_utilization_map_for_the_cost_function():
    recs = [
        alloc("1", tenant="physics", nodes=["g1"], started=NOW - 10 * H, finished=NOW),
        alloc("2", tenant="bio", started=NOW - 100 * DAY, finished=NOW - 95 * DAY),
    ]
    tenants = [
        Tenant(name="physics", gpu_hours_budget=100, node_hours_budget=1000),
        Tenant(name="bio", node_hours_budget=10),
        Tenant(name="nobudget"),
        Tenant(name="idle", gpu_hours_budget=5),
    ]
    m = budget_utilization(recs, tenants, now=NOW, node_gpus={"g1": 4})
    assert m == {"physics": pytest.approx(0.4), "bio": 0.0, "idle": 0.0}
    assert DEFAULT_BUDGET_PERIOD_DAYS == 90


def test_node_gpu_counts():
    nodes = [
        Node(id="a", capabilities=NodeCapabilities(gpu_count=4)),
        Node(id="b"),
    ]
    assert node_gpu_counts(nodes) == {"a": 4, "b": 0}


def test_allocation_hours_none_when_outside():
    a = alloc(started=NOW - 10 * DAY, finished=NOW - 9 * DAY)
    assert allocation_hours(a, now=NOW, window_days=1) is None
    assert allocation_hours(a, now=NOW, window_days=10) == (pytest.approx(24.0),) * 2


def test_all_exported():
    for name in ledger.__all__:
        assert hasattr(ledger, name)


# --------------------------------------------------------------------------- properties

NODE_IDS = [f"n{i}" for i in range(6)]
STATES = list(AllocationState)


@st.composite
def records(draw: st.DrawFn, max_size: int = 25) -> list[Allocation]:
    n = draw(st.integers(0, max_size))
    out = []
    for i in range(n):
        state = draw(st.sampled_from(STATES))
        started = draw(st.none() | st.floats(NOW - 200 * DAY, NOW + DAY))
        length = draw(st.floats(0, 30 * DAY))
        finished = None if started is None or not draw(st.booleans()) else started + length
        out.append(
            Allocation(
                id=f"a{i}",
                spec=AllocationSpec(
                    entrypoint="x",
                    tenant=draw(st.sampled_from(["physics", "bio"])),
                    vcluster="v",
                    user=draw(st.sampled_from(["alice", "bob", "carol"])),
                    nodes=draw(st.integers(1, 8)),
                    constraints=Constraints(gpu_count=draw(st.integers(0, 8))),
                ),
                state=state,
                assigned_nodes=draw(st.lists(st.sampled_from(NODE_IDS), max_size=4)),
                started_at=started,
                finished_at=finished,
            )
        )
    return out


node_inventories = st.none() | st.dictionaries(
    st.sampled_from(NODE_IDS), st.integers(0, 8), max_size=len(NODE_IDS)
)
windows = st.sampled_from([1, 7, 30, 90, 365]) | st.floats(0.01, 3650)


@settings(max_examples=200, deadline=None)
@given(records(), st.randoms(use_true_random=False), windows, node_inventories)
def test_permutation_gives_identical_results(recs, rnd: random.Random, window, inv):
    shuffled = list(recs)
    rnd.shuffle(shuffled)
    for kw in ({}, {"tenant": "physics"}, {"user": "bob"}):
        assert usage(recs, now=NOW, window_days=window, node_gpus=inv, **kw) == usage(
            shuffled, now=NOW, window_days=window, node_gpus=inv, **kw
        )
    assert usage_by(recs, "tenant", now=NOW, window_days=window, node_gpus=inv) == usage_by(
        shuffled, "tenant", now=NOW, window_days=window, node_gpus=inv
    )
    # and the same set computed twice is the same (no hidden state)
    assert usage(recs, now=NOW, window_days=window) == usage(recs, now=NOW, window_days=window)


@settings(max_examples=200, deadline=None)
@given(records(), windows, node_inventories, st.lists(st.floats(0, 400 * DAY), max_size=6))
def test_running_usage_is_monotone_in_now(recs, window, inv, steps):
    running = [a for a in recs if a.state == AllocationState.RUNNING]
    times = sorted(NOW + s for s in steps)
    prev: Usage | None = None
    for t in [NOW, *times]:
        u = usage(running, now=t, window_days=window, node_gpus=inv)
        if prev is not None:
            assert u.node_hours >= prev.node_hours
            assert u.gpu_hours >= prev.gpu_hours
            assert u.allocations >= prev.allocations
        prev = u


@settings(max_examples=200, deadline=None)
@given(records(), windows, node_inventories)
def test_usage_never_exceeds_window_times_nodes_times_gpus(recs, window, inv):
    hours = window * 24.0
    node_cap = gpu_cap = 0.0
    for a in recs:
        nodes, gpus = ledger.node_and_gpu_count(a, inv)
        h = allocation_hours(a, now=NOW, window_days=window, node_gpus=inv)
        if h is not None:
            assert 0.0 <= h[0] <= hours * nodes * (1 + 1e-12)
            assert 0.0 <= h[1] <= hours * gpus * (1 + 1e-12)
        node_cap += hours * nodes
        gpu_cap += hours * gpus
    u = usage(recs, now=NOW, window_days=window, node_gpus=inv)
    assert 0.0 <= u.node_hours <= node_cap * (1 + 1e-9)
    assert 0.0 <= u.gpu_hours <= gpu_cap * (1 + 1e-9)
    # and the parts add up to the whole
    by_t = usage_by(recs, "tenant", now=NOW, window_days=window, node_gpus=inv)
    assert math.fsum(x.node_hours for x in by_t.values()) == pytest.approx(u.node_hours)
    assert sum(x.allocations for x in by_t.values()) == u.allocations


@settings(max_examples=100, deadline=None)
@given(records(), node_inventories)
def test_wider_window_never_counts_less(recs, inv):
    narrow = usage(recs, now=NOW, window_days=30, node_gpus=inv)
    wide = usage(recs, now=NOW, window_days=90, node_gpus=inv)
    assert wide.node_hours >= narrow.node_hours - 1e-9
    assert wide.gpu_hours >= narrow.gpu_hours - 1e-9
    assert wide.allocations >= narrow.allocations
