"""The chaos history checker on synthetic histories: a consistent history passes, and
each kind of defect planted in one is caught (property-tested with hypothesis)."""

from __future__ import annotations

import dataclasses
import random

from checker import (
    Ack,
    CancelAck,
    FinalAlloc,
    History,
    NodeObservation,
    Observation,
    Run,
    check,
    reachable,
)
from hypothesis import given, settings
from hypothesis import strategies as st

NODES = ("node-001", "node-002", "node-003")
MEMBERS = (1, 2, 3)
PATHS = (
    ("Pending", "Running", "Completed"),
    ("Pending", "Running", "Failed"),
    ("Pending", "Cancelled"),
    ("Pending", "Running", "Cancelled"),
    ("Pending", "Running", "Pending", "Running", "Completed"),  # a requeue
    ("Pending", "Staging", "Running", "Completed"),
)


def consistent_history(seed: int, n: int) -> History:
    """n allocations run one after another on their nodes, every one acked, observed at
    random points of its life by random members, and held alike by every member."""
    rng = random.Random(seed)
    h = History(leader=rng.choice(MEMBERS), overlap_tolerance=1.0)
    free_at = dict.fromkeys(NODES, 1000.0)
    rev = 0
    finals = []
    for i in range(n):
        aid, rid = f"a{i:04d}", f"r-{i}"
        path = rng.choice(PATHS)
        node = rng.choice(NODES)
        t = free_at[node] + rng.uniform(0.1, 2)
        h.acks.append(Ack(rid, aid, t - 0.05))
        started = None
        for state in path:
            rev += 1
            nodes = (node,) if state != "Pending" else ()
            if state == "Running":
                started = t
                dur = rng.uniform(2.5, 5)
                h.runs.append(Run(aid, node, 100 + i, t, t + dur, ended=True))
                t += dur
            if rng.random() < 0.7:  # polling misses some states
                h.observations.append(
                    Observation(t, rng.choice(MEMBERS), aid, rev, state, nodes, rid)
                )
            t += 0.01
        free_at[node] = t + 0.1
        final_state = path[-1]
        if final_state == "Cancelled":
            h.cancels.append(CancelAck(aid, t - 0.02))
        finals.append(FinalAlloc(aid, rid, final_state, (node,), rev, started, 60.0))
    h.final = {m: list(finals) for m in MEMBERS}
    h.ended_at = max(free_at.values()) + 5
    h.idle_nodes_at_end = len(NODES)
    return h


def single_runs(h: History) -> list[Run]:
    """The runs of allocations that ran once (a requeued one has two runs already)."""
    ids = [r.alloc_id for r in h.runs]
    return [r for r in h.runs if ids.count(r.alloc_id) == 1]


histories = st.builds(consistent_history, st.integers(0, 2**32), st.integers(2, 30)).filter(
    lambda h: single_runs(h)
)


@settings(max_examples=60, deadline=None)
@given(histories)
def test_a_consistent_history_passes(h):
    report = check(h)
    assert report.ok, report.text()
    assert report.counts["acknowledged_submissions"] == len(h.acks)


@settings(max_examples=40, deadline=None)
@given(histories, st.data())
def test_a_lost_acknowledged_submission_is_caught(h, data):
    victim = data.draw(st.sampled_from(h.acks))
    h.final = {m: [a for a in fs if a.alloc_id != victim.alloc_id] for m, fs in h.final.items()}
    report = check(h)
    assert [v.alloc_id for v in report.by_kind("lost_ack")] == [victim.alloc_id]


@settings(max_examples=40, deadline=None)
@given(histories, st.data())
def test_a_duplicated_submission_is_caught(h, data):
    orig = data.draw(st.sampled_from(h.final[h.leader]))
    twin = dataclasses.replace(orig, alloc_id="zz-twin", state="Completed")
    h.final = {m: [*fs, twin] for m, fs in h.final.items()}
    report = check(h)
    assert report.by_kind("duplicate"), report.text()
    assert any(orig.request_id in v.detail for v in report.by_kind("duplicate"))


@settings(max_examples=40, deadline=None)
@given(histories, st.data())
def test_double_ownership_in_the_api_is_caught(h, data):
    a, b = data.draw(st.lists(st.sampled_from(h.acks), min_size=2, max_size=2, unique=True))
    node = data.draw(st.sampled_from(NODES))
    at = 5000.0
    h.observations += [
        Observation(at, 1, a.alloc_id, 10_000, "Running", (node,), a.request_id),
        Observation(at, 1, b.alloc_id, 10_001, "Running", (node,), b.request_id),
    ]
    report = check(h)
    assert any(node in v.detail for v in report.by_kind("double_ownership")), report.text()


@settings(max_examples=40, deadline=None)
@given(histories, st.data())
def test_two_allocations_running_on_one_node_at_once_is_caught(h, data):
    r = data.draw(st.sampled_from(h.runs))
    other = data.draw(st.sampled_from([a for a in h.acks if a.alloc_id != r.alloc_id]))
    h.runs.append(Run(other.alloc_id, r.node_id, 99_999, r.start, r.start + 10))
    report = check(h)
    assert any(r.node_id in v.detail for v in report.by_kind("double_ownership")), report.text()


@settings(max_examples=40, deadline=None)
@given(histories, st.data())
def test_an_allocation_running_on_two_nodes_at_once_is_caught(h, data):
    r = data.draw(st.sampled_from(single_runs(h)))
    elsewhere = next(n for n in NODES if n != r.node_id)
    h.runs.append(Run(r.alloc_id, elsewhere, 99_999, r.start + 0.1, r.start + 10))
    report = check(h)
    assert [v.alloc_id for v in report.by_kind("overlapping_runs")] == [r.alloc_id]


@settings(max_examples=40, deadline=None)
@given(histories, st.data())
def test_an_overlap_after_the_first_node_went_down_is_excused_not_hidden(h, data):
    r = data.draw(st.sampled_from(single_runs(h)))
    elsewhere = next(n for n in NODES if n != r.node_id)
    h.node_observations.append(NodeObservation(r.start + 0.5, r.node_id, "Down", ""))
    h.runs.append(Run(r.alloc_id, elsewhere, 99_999, r.start + 1.0, r.start + 10))
    report = check(h)
    assert report.by_kind("overlapping_runs") == []
    assert [v.alloc_id for v in report.excused] == [r.alloc_id]


@settings(max_examples=40, deadline=None)
@given(histories, st.data())
def test_an_illegal_transition_is_caught(h, data):
    done = [f for f in h.final[h.leader] if f.state in ("Completed", "Failed", "Cancelled")]
    f = data.draw(st.sampled_from(done))
    h.observations.append(Observation(9000, 2, f.alloc_id, f.revision + 5, "Running", f.nodes))
    report = check(h)
    assert [v.alloc_id for v in report.by_kind("illegal_transition")] == [f.alloc_id]


@settings(max_examples=40, deadline=None)
@given(histories, st.data())
def test_a_stale_read_is_not_a_step_back(h, data):
    o = data.draw(st.sampled_from(h.observations))
    # a lagging follower answers later with what the allocation was at an older revision
    h.observations.append(dataclasses.replace(o, at=o.at + 100, member=3))
    assert check(h).ok


@settings(max_examples=40, deadline=None)
@given(histories, st.data())
def test_members_disagreeing_on_one_revision_are_caught(h, data):
    f = data.draw(st.sampled_from(h.final[h.leader]))
    other = "Failed" if f.state != "Failed" else "Completed"
    m = next(m for m in MEMBERS if m != h.leader)
    h.final[m] = [dataclasses.replace(x, state=other) if x is f else x for x in h.final[m]]
    report = check(h)
    assert [v.alloc_id for v in report.by_kind("divergent_state")] == [f.alloc_id]
    assert report.by_kind("divergent_member")


@settings(max_examples=40, deadline=None)
@given(histories, st.data(), st.sampled_from(["Running", "Pending"]))
def test_a_stuck_allocation_is_caught(h, data, state):
    f = data.draw(st.sampled_from(h.final[h.leader]))
    stuck = dataclasses.replace(
        f, state=state, revision=f.revision + 1, started_at=h.ended_at - 500
    )
    h.final = {
        m: [stuck if x.alloc_id == f.alloc_id else x for x in fs] for m, fs in h.final.items()
    }
    h.cancels = [c for c in h.cancels if c.alloc_id != f.alloc_id]
    report = check(h)
    assert [v.alloc_id for v in report.by_kind("stuck")] == [f.alloc_id]


def test_pending_with_every_node_busy_is_legitimate():
    h = consistent_history(7, 5)
    f = h.final[h.leader][0]
    waiting = dataclasses.replace(f, state="Pending", revision=f.revision + 1)
    h.final = {m: [waiting, *fs[1:]] for m, fs in h.final.items()}
    h.cancels = [c for c in h.cancels if c.alloc_id != f.alloc_id]
    h.idle_nodes_at_end = 0
    assert check(h).by_kind("stuck") == []


def test_an_acknowledged_cancel_that_did_not_hold_is_caught():
    h = consistent_history(3, 10)
    f = next(x for x in h.final[h.leader] if x.state == "Completed")
    h.cancels.append(CancelAck(f.alloc_id, 1.0))
    assert [v.alloc_id for v in check(h).by_kind("cancel_lost")] == [f.alloc_id]


def test_reachability_follows_the_quorums_table():
    assert reachable("Pending", "Completed")  # through Running, missed by a poll
    assert reachable("Running", "Running")
    assert not reachable("Completed", "Running")
    assert not reachable("Cancelled", "Pending")
    assert not reachable("Failed", "Completed")


def test_the_report_names_each_defect():
    h = consistent_history(11, 8)
    h.final = {m: fs[1:] for m, fs in h.final.items()}
    report = check(h)
    text = report.text()
    assert "FAIL" in text and "lost_ack" in text
    assert report.summary()["violations"] == {"lost_ack": 1}
