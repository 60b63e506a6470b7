"""Hand-over cycles: when a busy node is handed to its next allocation, the scheduler
solves only the head of the last full cycle's order and what became Pending since, and
gives each busy node the same next allocation a full cycle would."""

from __future__ import annotations

import asyncio
import time

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common import commands as c
from lattice_common.types import AllocationState
from lattice_scheduler import decide
from lattice_scheduler.handoff import next_allocations
from lattice_scheduler.loop import Scheduler
from lattice_test_harness import builders as b
from test_decide import NOW, mirror
from test_loop_metrics import _RecordingQuorum
from test_next_allocations import busy_cluster


def _queued(m, d) -> dict[str, str]:
    return next_allocations(m, "v", d.reservations, {p.allocation_id for p in d.proposals})


job = st.tuples(
    st.sampled_from([1, 1, 1, 2, 3]),  # nodes
    st.integers(0, 3),  # preemption class
    st.integers(0, 500),  # seconds waited
    st.sampled_from([60, 600, 3600]),  # walltime
)


@settings(max_examples=60, deadline=None)
@given(jobs=st.lists(job, min_size=1, max_size=40), busy=st.integers(1, 6))
def test_the_shortlist_gives_busy_nodes_what_the_full_cycle_gives_them(jobs, busy) -> None:
    nodes, running = busy_cluster(busy)
    waiting = [
        b.allocation(
            id=f"w{i:02d}",
            vcluster="v",
            nodes=k,
            preemption_class=cls,
            submitted_at=NOW - waited,
            walltime_seconds=wall,
        )
        for i, (k, cls, waited, wall) in enumerate(jobs)
    ]
    m = mirror(nodes, [*running, *waiting])
    full = decide.decide_vcluster(m, "v", NOW, reserve_busy=True)
    ranked = decide.solver_order([a for a in full.queue if a.id in full.scores], full.scores)
    assert list(ranked) == full.order  # what the loop keeps between full cycles
    reserved = {r.allocation_id for r in full.reservations}
    reach = max((i + 1 for i, a in enumerate(ranked) if a in reserved), default=0)
    head = set(ranked[: reach + decide.backfill_depth(m, "v")])
    short = decide.decide_vcluster(m, "v", NOW, reserve_busy=True, shortlist=head)
    assert short.shortlisted and not short.waiting and not short.preemptions
    assert _queued(m, short) == _queued(m, full)
    assert short.reservations == full.reservations
    assert len(short.queue) <= len(full.queue)


def _cluster(q: _RecordingQuorum) -> Scheduler:
    """Two busy nodes of ``v``, 30 one-node jobs waiting, the oldest first."""
    s = Scheduler(quorum=q, vclusters=["v"], cycle_interval=5.0)  # type: ignore[arg-type]
    m = s.mirror
    now = time.time()
    for i in (1, 2):
        run = b.allocation(id=f"r{i}", state=AllocationState.RUNNING, walltime_seconds=600)
        run = msgspec.structs.replace(run, assigned_nodes=[f"n{i}"], started_at=now - 10)
        m.allocations[run.id] = run
        m.holding[run.id] = None
        m.nodes[f"n{i}"] = b.node(f"n{i}", owner=run.id, owner_vcluster="v")
    for i in range(30):
        a = b.allocation(id=f"j{i:02d}", submitted_at=now - 100 + i)
        m.allocations[a.id] = a
        m.pending[a.id] = None
    return s


def _next_sent(q: _RecordingQuorum) -> dict[str, str]:
    out: dict[str, str] = {}
    for x in q.sent:
        if isinstance(x, c.SetNextAllocations):
            out.update(x.next)
    return out


def test_a_hand_over_cycle_queues_the_next_job_without_touching_the_rest() -> None:
    q = _RecordingQuorum()
    s = _cluster(q)
    s._reserve_busy = True
    asyncio.run(s.cycle())  # full: reasons for the whole queue, next allocations
    first = _next_sent(q)
    assert sorted(first.values()) == ["j00", "j01"]  # the two longest waiting
    assert any(isinstance(x, c.SetPendingReasons) for x in q.sent)
    m = s.mirror
    for nid, aid in first.items():
        m.nodes[nid] = msgspec.structs.replace(m.nodes[nid], next_allocation=aid)
    # one node is handed to j00 (it now runs there); that node's next slot is free again
    (handed,) = [nid for nid, aid in first.items() if aid == "j00"]
    j00 = msgspec.structs.replace(
        m.allocations["j00"], state=AllocationState.RUNNING, assigned_nodes=[handed]
    )
    m.allocations["j00"] = j00
    del m.pending["j00"]
    m.holding["j00"] = None
    m.nodes[handed] = msgspec.structs.replace(m.nodes[handed], owner="j00", next_allocation="")
    shortlist = s._shortlist("v")
    assert shortlist is not None and "j01" in shortlist and len(shortlist) < 29
    q.sent.clear()
    s._reserve_busy = True
    asyncio.run(s.cycle(full=False))
    assert _next_sent(q) == {handed: "j02"}  # the next in line, as a full cycle would
    # no reasons, preemptions or estimates from a hand-over cycle
    assert all(isinstance(x, c.SetNextAllocations) for x in q.sent)


def test_a_job_requeued_after_the_full_cycle_is_considered_by_hand_overs() -> None:
    q = _RecordingQuorum()
    s = _cluster(q)
    s._reserve_busy = True
    asyncio.run(s.cycle())
    m = s.mirror
    for nid, aid in _next_sent(q).items():
        m.nodes[nid] = msgspec.structs.replace(m.nodes[nid], next_allocation=aid)
    # back in the queue (its node failed), having waited longer than any other
    back = b.allocation(id="back", submitted_at=time.time() - 1000)
    s._note_arrivals([back])  # (from the watch stream, before the mirror applies it)
    m.allocations[back.id] = back
    m.pending[back.id] = None
    assert "back" in (s._shortlist("v") or set())
    q.sent.clear()
    s._reserve_busy = True
    asyncio.run(s.cycle(full=False))
    assert "back" in _next_sent(q).values()


def test_reasons_republished_for_every_pending_job_are_not_arrivals() -> None:
    s = _cluster(_RecordingQuorum())
    m = s.mirror
    same = [msgspec.structs.replace(m.allocations[i], pending_reason="x") for i in list(m.pending)]
    s._note_arrivals(same)
    assert s._arrived == set()
    held = msgspec.structs.replace(m.allocations["j05"], held=True)
    m.allocations["j05"] = held
    s._note_arrivals([msgspec.structs.replace(held, held=False)])  # released: eligible now
    assert s._arrived == {"j05"}


def test_a_free_node_or_no_full_cycle_yet_means_a_full_cycle() -> None:
    q = _RecordingQuorum()
    s = _cluster(q)
    assert s._shortlist("v") is None  # no order known yet
    s._reserve_busy = True
    asyncio.run(s.cycle())
    assert s._shortlist("v") is not None
    s.mirror.nodes["n3"] = b.node("n3")  # a free node: borrowing, reasons, backfill
    assert s._shortlist("v") is None


def test_a_limit_that_needs_the_whole_queue_makes_it_a_full_cycle() -> None:
    from lattice_common.types import Dependency

    nodes, running = busy_cluster(2)
    first = b.allocation(id="first", vcluster="v", submitted_at=NOW - 90)
    first.spec.depends_on = [Dependency(ref="solo", condition="singleton")]
    second = b.allocation(id="second", vcluster="v", submitted_at=NOW - 80)
    second.spec.depends_on = [Dependency(ref="solo", condition="singleton")]
    m = mirror(nodes, [*running, first, second])
    # only the later one shortlisted: alone it would follow, ahead of its mutex twin
    d = decide.decide_vcluster(m, "v", NOW, reserve_busy=True, shortlist={"second"})
    assert not d.shortlisted
    assert "first" in _queued(m, d).values() and "second" not in _queued(m, d).values()


def test_a_preempted_job_held_back_for_its_preemptor_is_not_shortlisted() -> None:
    nodes, running = busy_cluster(1)
    preemptor = b.allocation(id="p", vcluster="v", submitted_at=NOW - 10)
    victim = b.allocation(id="victim", vcluster="v", submitted_at=NOW - 500)
    victim.preempted_by = "p"
    m = mirror(nodes, [*running, preemptor, victim])
    d = decide.decide_vcluster(
        m, "v", NOW, reserve_busy=True, shortlist={"p", "victim"}, exclude=()
    )
    assert d.shortlisted and [a.id for a in d.queue] == ["p"]
    assert _queued(m, d) == {"n0": "p"}
