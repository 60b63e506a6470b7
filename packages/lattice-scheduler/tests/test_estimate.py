"""Estimated start times: what the cycle starts is "now", the top of the queue is its
reservation, the rest comes from simulating the queue with the decision function."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import (
    ESTIMATE_NOW,
    ESTIMATE_RESERVATION,
    ESTIMATE_SIMULATION,
    Allocation,
    AllocationState,
)
from lattice_common.watch import StateDelta, StateMirror
from lattice_scheduler.decide import decide_vcluster
from lattice_scheduler.estimate import Simulation, changed, estimate_starts
from lattice_test_harness import builders as b

NOW = 1_000_000.0


def mirror(nodes, allocs) -> StateMirror:
    m = StateMirror()
    m.nodes = {n.id: n for n in nodes}
    m.allocations = {a.id: a for a in allocs}
    m.pending = {a.id: None for a in allocs if a.state == AllocationState.PENDING}
    m.holding = {a.id: None for a in allocs if a.state == AllocationState.RUNNING}
    return m


def running(aid: str, node: str, ends_in: float, walltime: int = 3600) -> Allocation:
    a = b.allocation(id=aid, state=AllocationState.RUNNING, walltime_seconds=walltime)
    return msgspec.structs.replace(
        a, assigned_nodes=[node], started_at=NOW + ends_in - walltime, submitted_at=NOW - 7200
    )


def full_cluster(*pending: Allocation) -> StateMirror:
    """Four nodes, each held by a job that ends 100, 200, 300 and 400 s from now."""
    nodes = [b.node(f"n{i}", owner=f"r{i}") for i in range(1, 5)]
    runs = [running(f"r{i}", f"n{i}", 100.0 * i) for i in range(1, 5)]
    return mirror(nodes, [*runs, *pending])


def test_the_top_of_the_queue_gets_its_reservation_the_rest_a_simulated_start() -> None:
    big = b.allocation(
        id="big", nodes=5, preemption_class=9, walltime_seconds=600, submitted_at=NOW - 60
    )
    short = b.allocation(id="short", walltime_seconds=50, submitted_at=NOW - 30)
    long = b.allocation(id="long", walltime_seconds=1000, submitted_at=NOW - 20)
    m = full_cluster(big, short, long)
    m.nodes["n5"] = b.node("n5")  # one idle node: the solver runs and reserves
    d = decide_vcluster(m, "v", NOW)
    est = estimate_starts(m, "v", NOW, d)
    assert (est["big"].estimated_start, est["big"].estimate_basis) == (
        NOW + 400,
        ESTIMATE_RESERVATION,
    )
    assert est["big"].nodes == 5
    # the short job fits in the gap before the reservation, on the idle node
    assert (est["short"].estimated_start, est["short"].estimate_basis) == (NOW, ESTIMATE_NOW)
    # the long one would delay the big job, so it is reserved for after it
    assert (est["long"].estimated_start, est["long"].estimate_basis) == (
        NOW + 400 + 600,
        ESTIMATE_RESERVATION,
    )


def test_on_a_full_cluster_the_simulation_finds_the_first_time_enough_nodes_free() -> None:
    big = b.allocation(
        id="big", nodes=4, preemption_class=9, walltime_seconds=600, submitted_at=NOW - 60
    )
    short = b.allocation(id="short", walltime_seconds=50, submitted_at=NOW - 30)
    m = full_cluster(big, short)
    est = estimate_starts(m, "v", NOW, decide_vcluster(m, "v", NOW))
    assert est["big"].estimated_start == NOW + 400
    # backfilled into the first node to free up: it ends before the big job can start
    assert (est["short"].estimated_start, est["short"].estimate_basis) == (
        NOW + 100,
        ESTIMATE_SIMULATION,
    )


def test_what_the_cycle_starts_is_estimated_now() -> None:
    free = b.node("n9")
    a = b.allocation(id="a", walltime_seconds=60)
    m = mirror([free], [a])
    est = estimate_starts(m, "v", NOW, decide_vcluster(m, "v", NOW))
    assert (est["a"].estimated_start, est["a"].estimate_basis, est["a"].node_ids) == (
        NOW,
        ESTIMATE_NOW,
        ["n9"],
    )


def test_nothing_is_estimated_behind_a_job_without_walltime() -> None:
    forever = running("svc", "n1", 0.0, walltime=0)
    forever = msgspec.structs.replace(forever, started_at=NOW - 10)
    a = b.allocation(id="a", walltime_seconds=60)
    m = mirror([b.node("n1", owner="svc")], [forever, a])
    sim = Simulation(m, "v", NOW, decide_vcluster(m, "v", NOW))
    est = sim.run()
    assert "a" not in est and sim.done and sim.unreachable() == ["a"]


def test_the_simulation_leaves_the_callers_state_alone() -> None:
    big = b.allocation(id="big", nodes=4, walltime_seconds=600)
    m = full_cluster(big, b.allocation(id="x", walltime_seconds=50))
    before = msgspec.json.encode([m.nodes, m.allocations, list(m.pending), list(m.holding)])
    estimate_starts(m, "v", NOW, decide_vcluster(m, "v", NOW))
    assert msgspec.json.encode([m.nodes, m.allocations, list(m.pending), list(m.holding)]) == before


def test_a_budget_that_runs_out_leaves_the_rest_without_estimates() -> None:
    jobs = [b.allocation(id=f"j{i}", walltime_seconds=100, submitted_at=NOW - i) for i in range(14)]
    m = full_cluster(*jobs)
    d = decide_vcluster(m, "v", NOW)
    sim = Simulation(m, "v", NOW, d)
    steps = iter([True])  # one step only
    est = sim.run(lambda: next(steps, False))
    assert not sim.done and sim.unreachable() == []
    assert len(est) < len(jobs)


def test_only_estimates_that_changed_are_published() -> None:
    a = b.allocation(id="a", walltime_seconds=60)
    m = mirror([b.node("n1")], [a])
    est = estimate_starts(m, "v", NOW, decide_vcluster(m, "v", NOW))
    assert set(changed(est, m.allocations)) == {"a"}
    published = msgspec.structs.replace(a, estimated_start=NOW, estimate_basis=ESTIMATE_NOW)
    assert changed(est, {"a": published}) == {}


@settings(max_examples=60, deadline=None)
@given(
    ends=st.lists(st.integers(1, 20), min_size=1, max_size=5),
    jobs=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 12), st.integers(0, 10)), min_size=1, max_size=6
    ),
)
def test_estimates_are_never_before_now_and_cover_a_finite_queue(ends, jobs) -> None:
    """With every job bounded and the nodes all usable, every pending job gets an
    estimate, none before now, and the reserved ones keep their reservation."""
    nodes = [b.node(f"n{i}", owner=f"r{i}") for i in range(len(ends))]
    runs = [running(f"r{i}", f"n{i}", 60.0 * e) for i, e in enumerate(ends)]
    pend = [
        b.allocation(
            id=f"p{i}",
            nodes=min(k, len(nodes)),
            walltime_seconds=60 * w,
            preemption_class=c,
            submitted_at=NOW - i,
        )
        for i, (k, w, c) in enumerate(jobs)
    ]
    m = mirror(nodes, [*runs, *pend])
    d = decide_vcluster(m, "v", NOW)
    est = estimate_starts(m, "v", NOW, d)
    assert set(est) == {a.id for a in pend}
    assert all(e.estimated_start is not None and e.estimated_start >= NOW for e in est.values())
    for r in d.reservations:
        assert est[r.allocation_id].estimated_start == round(r.start_time)


def test_deltas_applied_between_steps_do_not_change_what_the_simulation_sees() -> None:
    """The live loop steps the simulation between event-loop turns while the watch
    applies deltas to the same mirror: the estimates are those of the state the
    simulation started from (it reads the allocations through a snapshot, not a copy)."""
    jobs = [b.allocation(id=f"j{i}", walltime_seconds=100, submitted_at=NOW - i) for i in range(6)]
    m = full_cluster(*jobs)
    d = decide_vcluster(m, "v", NOW)
    alone = Simulation(m, "v", NOW, d).run()
    sim = Simulation(m, "v", NOW, d)
    sim.step()
    gone = msgspec.structs.replace(m.allocations["r1"], state=AllocationState.COMPLETED)
    started = msgspec.structs.replace(
        m.allocations["j0"], state=AllocationState.RUNNING, assigned_nodes=["n1"]
    )
    m.apply(StateDelta(revision=9, allocations=[gone, started, b.allocation(id="late")]))
    m.apply(StateDelta(revision=10, removed_allocations=["r2", "j1"]))
    assert sim.run() == alone
    assert m.allocations["j0"].state == AllocationState.RUNNING and "j1" not in m.allocations
