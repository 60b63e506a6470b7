"""A busy node's queued next allocation takes it in the commit that ends its owner; an
entry that no longer passes an assignment's checks is dropped and changes nothing else;
cancellation and preemption never hand a node over."""

from __future__ import annotations

from lattice_common import commands as c
from lattice_common.types import AllocationState as S
from lattice_common.types import NodeState
from lattice_quorum.state import Changes, GlobalState, apply
from test_state import encode, ok, rejected, run, running, set_state, submit, world


def queue_next(s: GlobalState, node: str, aid: str) -> None:
    ok(s, c.SetNextAllocations(next={node: aid}, vcluster="v", now=25.0))


def test_the_next_allocation_takes_the_node_in_the_commit_that_ends_its_owner() -> None:
    s = world(nodes=1)
    first = running(s, ["n0000"])
    nxt = submit(s)
    queue_next(s, "n0000", nxt)
    assert s.nodes["n0000"].next_allocation == nxt
    ch = Changes()
    res = apply(
        s,
        c.decode_command(
            c.encode_command(
                c.UpdateAllocationState(allocation_id=first, state=S.COMPLETED, now=30.0)
            )
        ),
        ch,
    )
    assert res.error is None
    assert s.allocations[first].state == S.COMPLETED
    assert s.allocations[nxt].state == S.RUNNING
    assert s.allocations[nxt].assigned_nodes == ["n0000"]
    n = s.nodes["n0000"]
    assert (n.owner, n.owner_vcluster, n.next_allocation) == (nxt, "v", "")
    # one delta carries both: the watchers (agents, schedulers) see the hand-over at once
    assert {first, nxt} <= ch.allocations and "n0000" in ch.nodes


def test_a_failed_owner_hands_over_too_but_a_requeued_one_keeps_its_node_free() -> None:
    s = world(nodes=2)
    a = running(s, ["n0000"])
    b = running(s, ["n0001"], requeue_policy="always", max_requeue=1)
    na, nb = submit(s), submit(s)
    queue_next(s, "n0000", na)
    queue_next(s, "n0001", nb)
    set_state(s, a, S.FAILED, reason="exit 1", exit_code=1)
    assert s.allocations[na].state == S.RUNNING
    set_state(s, b, S.FAILED, reason="exit 1", exit_code=1)  # requeued, not ended
    assert s.allocations[b].state == S.PENDING
    assert s.allocations[nb].state == S.PENDING and s.nodes["n0001"].owner == ""


def test_a_stale_entry_is_dropped_and_the_node_is_left_free() -> None:
    s = world(nodes=1)
    first = running(s, ["n0000"])
    nxt = submit(s)
    queue_next(s, "n0000", nxt)
    ok(s, c.CancelAllocation(allocation_id=nxt, now=26.0))  # no longer Pending
    set_state(s, first, S.COMPLETED)
    n = s.nodes["n0000"]
    assert (n.owner, n.next_allocation) == ("", "")
    assert s.allocations[nxt].state == S.CANCELLED


def test_a_draining_node_is_not_handed_over() -> None:
    s = world(nodes=1)
    first = running(s, ["n0000"])
    nxt = submit(s)
    queue_next(s, "n0000", nxt)
    ok(s, c.DrainNode(node_id="n0000", reason="maintenance", now=27.0))
    set_state(s, first, S.COMPLETED)
    assert s.nodes["n0000"].state == NodeState.DRAINED and s.nodes["n0000"].owner == ""
    assert s.allocations[nxt].state == S.PENDING


def test_a_hard_quota_still_holds_at_the_hand_over() -> None:
    s = world(nodes=2, tenants={"t": {"max_nodes": 1}, "u": {}})
    first = running(s, ["n0000"], tenant="u")
    other = running(s, ["n0001"])  # tenant t holds its one node
    nxt = submit(s)  # tenant t
    queue_next(s, "n0000", nxt)
    set_state(s, first, S.COMPLETED)
    assert s.allocations[nxt].state == S.PENDING and s.nodes["n0000"].owner == ""
    assert s.allocations[other].state == S.RUNNING


def test_cancelling_the_owner_does_not_hand_over() -> None:
    s = world(nodes=1)
    first = running(s, ["n0000"])
    nxt = submit(s)
    queue_next(s, "n0000", nxt)
    ok(s, c.CancelAllocation(allocation_id=first, now=28.0))
    assert s.allocations[nxt].state == S.PENDING


def test_bad_entries_are_refused_whole() -> None:
    s = world(nodes=2)
    running(s, ["n0000"])
    two = submit(s, nodes=2)
    one = submit(s)
    rejected(s, c.SetNextAllocations(next={"n0000": two}, now=25.0), "invalid_argument")
    rejected(
        s, c.SetNextAllocations(next={"n0000": one, "n0001": one}, now=25.0), "invalid_argument"
    )
    rejected(s, c.SetNextAllocations(next={"n0000": one, "nope": ""}, now=25.0), "not_found")
    rejected(s, c.SetNextAllocations(next={"n0000": "missing"}, now=25.0), "invalid_argument")


def test_setting_the_same_entry_again_changes_nothing() -> None:
    s = world(nodes=1)
    running(s, ["n0000"])
    nxt = submit(s)
    queue_next(s, "n0000", nxt)
    before = encode(s)
    res = run(s, c.SetNextAllocations(next={"n0000": nxt}, now=29.0))
    assert res.error is None and encode(s) == before
