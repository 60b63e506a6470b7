"""Busy nodes' next allocations come from the cycle's reservations: the top one-node
allocations follow on the busy nodes of the vCluster's own pool, and nothing a
hand-over must not do (multi-node, sensitive, concurrency-limited tasks, borrowed or
draining nodes) is queued."""

from __future__ import annotations

from lattice_common.types import AllocationState, NodeState, SchedulerType
from lattice_scheduler.decide import decide_vcluster
from lattice_scheduler.handoff import next_allocations
from lattice_test_harness import builders as b
from test_decide import NOW, mirror


def busy_cluster(n: int = 2, **node_kw):
    nodes, running = [], []
    for i in range(n):
        r = b.allocation(id=f"r{i}", vcluster="v", state=AllocationState.RUNNING)
        r.assigned_nodes = [f"n{i}"]
        r.started_at = NOW - 60 * (i + 1)
        running.append(r)
        nodes.append(b.node(f"n{i}", owner=r.id, owner_vcluster="v", **node_kw))
    return nodes, running


def queued(d, m):
    return next_allocations(m, "v", d.reservations, {p.allocation_id for p in d.proposals})


def test_with_no_free_node_the_top_jobs_follow_on_busy_nodes_when_asked() -> None:
    nodes, running = busy_cluster(2)
    waiting = [b.allocation(id=f"w{i}", vcluster="v", submitted_at=NOW - 50 + i) for i in range(3)]
    m = mirror(nodes, [*running, *waiting])
    cheap = decide_vcluster(m, "v", NOW)
    assert cheap.nothing_free and cheap.reservations == []
    d = decide_vcluster(m, "v", NOW, reserve_busy=True)
    nxt = queued(d, m)
    assert sorted(nxt) == ["n0", "n1"]
    assert sorted(nxt.values()) == ["w0", "w1"]  # the two longest waiting, one per node
    for nid, aid in nxt.items():  # once recorded, nothing more to propose
        m.nodes[nid].next_allocation = aid
    assert queued(d, m) == {}


def test_what_a_hand_over_must_not_do_is_never_queued() -> None:
    nodes, running = busy_cluster(2)
    wide = b.allocation(id="wide", vcluster="v", nodes=2, submitted_at=NOW - 90)
    task = b.allocation(id="task", vcluster="v", submitted_at=NOW - 80)
    task.task_group_id, task.task_group_concurrency = "g", 1
    m = mirror(nodes, [*running, wide, task])
    d = decide_vcluster(m, "v", NOW, reserve_busy=True)
    assert "wide" in {r.allocation_id for r in d.reservations}
    assert queued(d, m) == {}  # neither follows anywhere

    sens = b.vcluster("sens", scheduler_type=SchedulerType.SENSITIVE_RESERVATION)
    s = b.allocation(id="s", vcluster="sens", user="alice", submitted_at=NOW - 10)
    nodes, running = busy_cluster(1)
    m = mirror(nodes, [*running, s], [sens])
    d = decide_vcluster(m, "sens", NOW, reserve_busy=True)
    assert next_allocations(m, "sens", d.reservations, ()) == {}


def test_borrowed_and_draining_nodes_get_no_next_allocation() -> None:
    nodes, running = busy_cluster(1, home_vcluster="other")
    w = b.allocation(id="w", vcluster="v", submitted_at=NOW - 5)
    m = mirror(nodes, [*running, w])
    d = decide_vcluster(m, "v", NOW, reserve_busy=True)
    assert queued(d, m) == {}
    nodes, running = busy_cluster(1, state=NodeState.DRAINING)
    m = mirror(nodes, [*running, w])
    d = decide_vcluster(m, "v", NOW, reserve_busy=True)
    assert queued(d, m) == {}


def test_an_entry_the_cycle_no_longer_reserves_is_cleared() -> None:
    nodes, running = busy_cluster(1)
    nodes[0].next_allocation = "gone"
    m = mirror(nodes, running)
    assert next_allocations(m, "v", [], ()) == {"n0": ""}
