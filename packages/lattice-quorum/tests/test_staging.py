"""Staging: an allocation with a uenv or image is assigned into Staging, Running only
once every node's prologue is done; a failed prologue excludes that node and retries
elsewhere, Failed after max_retries; stale reports change nothing."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from lattice_common import commands as c
from lattice_common.types import AllocationState
from test_state import assign, ok, rejected, run, submit, world

A = AllocationState


def prologue(s, aid: str, node: str, ok_: bool = True, reason: str = "", **kw):  # type: ignore[no-untyped-def]
    kw.setdefault("attempt", s.allocations[aid].prologue_failures)
    return run(
        s,
        c.ReportPrologue(allocation_id=aid, node_id=node, ok=ok_, reason=reason, now=50.0, **kw),
    )


def test_bare_allocation_runs_at_once() -> None:
    s = world()
    aid = submit(s)
    assign(s, aid, ["n0000"])
    assert s.allocations[aid].state == A.RUNNING


def test_running_only_when_every_node_is_staged() -> None:
    s = world()
    aid = submit(s, nodes=2, uenv="prgenv-gnu/24.11:v1")
    assign(s, aid, ["n0000", "n0001"])
    a = s.allocations[aid]
    assert a.state == A.STAGING
    assert s.nodes["n0000"].owner == aid  # the nodes are held while staging
    prologue(s, aid, "n0001", image_digest="sha256:" + "a" * 64)
    assert a.state == A.STAGING and a.staged_nodes == ["n0001"]
    prologue(s, aid, "n0001")  # a repeated heartbeat changes nothing
    assert a.staged_nodes == ["n0001"]
    prologue(s, aid, "n0000")
    assert a.state == A.RUNNING and a.started_at == 50.0
    assert a.image_digest == "sha256:" + "a" * 64


def test_failure_excludes_the_node_and_requeues_with_the_cause() -> None:
    s = world()
    aid = submit(s, nodes=2, image="127.0.0.1:5000/app:1")
    assign(s, aid, ["n0000", "n0001"])
    prologue(s, aid, "n0000")
    prologue(s, aid, "n0001", False, "uenv x: image hash mismatch")
    a = s.allocations[aid]
    assert a.state == A.PENDING and a.assigned_nodes == [] and a.staged_nodes == []
    assert a.excluded_nodes == ["n0001"] and a.prologue_failures == 1
    assert "prologue failed on n0001: uenv x: image hash mismatch" in a.pending_reason
    assert "try 2 of 3" in a.pending_reason
    assert s.nodes["n0000"].owner == "" and s.nodes["n0001"].owner == ""
    # the quorum never gives it the failed node again
    rejected(
        s,
        c.AssignNodes(allocation_id=aid, node_ids=["n0001", "n0002"], now=60.0),
        "ownership_conflict",
    )
    assign(s, aid, ["n0002", "n0003"])
    assert a.state == A.STAGING


def test_failed_after_max_retries() -> None:
    s = world(nodes=4)
    aid = submit(s, uenv="x/1")
    for i, node in enumerate(["n0000", "n0001", "n0002"]):
        assign(s, aid, [node])
        prologue(s, aid, node, False, f"cause {i}")
    a = s.allocations[aid]
    assert a.state == A.FAILED
    assert a.reason == "prologue_failed: cause 2 (on n0002; 3 tries)"
    assert a.excluded_nodes == ["n0000", "n0001", "n0002"]
    assert all(not n.owner for n in s.nodes.values())


def test_stale_reports_change_nothing() -> None:
    s = world()
    aid = submit(s, uenv="x/1")
    assign(s, aid, ["n0000"])
    prologue(s, aid, "n0000", False, "boom")
    assign(s, aid, ["n0001"])
    rev = s.revision
    prologue(s, aid, "n0000", False, "boom again", attempt=0)  # the earlier attempt's node
    prologue(s, aid, "n0001", True, attempt=0)  # a report about the earlier attempt
    prologue(s, aid, "n0002")  # not one of its nodes
    assert s.revision == rev and s.allocations[aid].state == A.STAGING
    ok(s, c.CancelAllocation(allocation_id=aid, now=70.0))
    prologue(s, aid, "n0001")
    assert s.allocations[aid].state == A.CANCELLED


@given(
    st.lists(
        st.tuples(st.sampled_from(["n0000", "n0001", "n0002", "n0003"]), st.booleans()), max_size=12
    )
)
def test_nodes_never_held_twice_and_failures_bounded(events: list[tuple[str, bool]]) -> None:
    """Whatever the reports, a node has at most one owner, the allocation holds nodes
    only while Staging/Running, and it fails at the third failure at the latest."""
    s = world(nodes=4)
    aid = submit(s, nodes=2, uenv="x/1")
    free = ["n0000", "n0001", "n0002", "n0003"]
    for node, good in events:
        a = s.allocations[aid]
        if a.state == A.PENDING:
            usable = [n for n in free if n not in a.excluded_nodes]
            if len(usable) < 2:
                break
            assign(s, aid, usable[:2])
        prologue(s, aid, node, good, "" if good else "bad")
        a = s.allocations[aid]
        owned = [n.id for n in s.nodes.values() if n.owner == aid]
        if a.state in (A.STAGING, A.RUNNING):
            assert sorted(owned) == sorted(a.assigned_nodes)
            assert not set(a.assigned_nodes) & set(a.excluded_nodes)
        else:
            assert owned == []
        assert a.prologue_failures <= 3
        assert (a.state == A.FAILED) == (a.prologue_failures == 3)
