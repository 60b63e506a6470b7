"""Checkpoint hints in the quorum's apply: one outstanding hint per allocation and run,
a hint from a stale view refused (the broker's restart safety), the agent's outcome
recorded with the allocation still Running, and the f8 estimates. Also: the broker's
commands are ones an internal service may propose."""

from __future__ import annotations

from pathlib import Path

import pytest
from lattice_agent.checkpoint.paths import environment
from lattice_api.auth import Identity, Role
from lattice_api.ops.quorum import check_proposer
from lattice_common import commands as c
from lattice_common.errors import PermissionDenied
from lattice_common.types import AllocationState as A
from lattice_common.types import CheckpointRecord, NodeCapabilities, NodeState
from lattice_quorum.state import GlobalState, apply
from lattice_test_harness import builders as b


def world() -> GlobalState:
    s = GlobalState()
    ok(s, c.CreateTenant(tenant=b.tenant("t"), now=1.0))
    ok(s, c.CreateVCluster(vcluster=b.vcluster("v"), now=1.0))
    for i in range(2):
        ok(
            s,
            c.RegisterNode(
                node_id=f"n{i}", capabilities=NodeCapabilities(cpu_cores=8, memory_gb=32), now=2.0
            ),
        )
    return s


def ok(s: GlobalState, cmd: c.Command) -> c.CommandResult:
    res = apply(s, cmd)
    assert res.error is None, res.error
    return res


def refused(s: GlobalState, cmd: c.Command, code: str) -> None:
    before = s.revision
    res = apply(s, cmd)
    assert res.error is not None and res.error["code"] == code, res.error
    assert s.revision == before  # nothing changed


def running(s: GlobalState, node: str = "n0", protocol: str = "signal") -> str:
    spec = b.spec(
        tenant="t",
        vcluster="v",
        checkpoint="auto" if protocol else "none",
        checkpoint_protocol=protocol,
    )
    aid = ok(s, c.SubmitAllocation(spec=spec, now=10.0)).allocation.id  # type: ignore[union-attr]
    ok(s, c.AssignNodes(allocation_id=aid, node_ids=[node], now=20.0))
    assert s.allocations[aid].state == A.RUNNING
    return aid


def record(aid: str, hint: str = "hint-1") -> CheckpointRecord:
    return CheckpointRecord(
        id=f"ckpt-1-{hint}", path=f"/ck/t/p/{aid}/checkpoints/ckpt-1-{hint}", size_bytes=10, at=40
    )


def test_a_hint_is_recorded_once_until_its_outcome_comes_back() -> None:
    s = world()
    aid = running(s)
    a = ok(s, c.IssueCheckpointHint(allocation_id=aid, epoch=0, reason="recompute_saved", now=30))
    h = a.allocation.checkpoint_hint  # type: ignore[union-attr]
    assert h is not None and (h.id, h.epoch, h.run, h.done_at) == ("hint-1", 1, 0, None)
    # a second broker (or the same one restarted) with the same or a newer view
    refused(s, c.IssueCheckpointHint(allocation_id=aid, epoch=0, now=31), "failed_precondition")
    refused(s, c.IssueCheckpointHint(allocation_id=aid, epoch=1, now=31), "failed_precondition")
    ok(
        s,
        c.CompleteCheckpointHint(
            allocation_id=aid, node_id="n0", hint_id="hint-1", checkpoint=record(aid), now=40
        ),
    )
    a2 = s.allocations[aid]
    assert a2.state == A.RUNNING and a2.assigned_nodes == ["n0"]  # it keeps running
    assert a2.last_checkpoint == record(aid)
    assert a2.checkpoint_hint.done_at == 40 and a2.checkpoint_hint.outcome == "ok"  # type: ignore[union-attr]
    # its outcome is recorded once
    refused(
        s,
        c.CompleteCheckpointHint(
            allocation_id=aid, node_id="n0", hint_id="hint-1", checkpoint=record(aid), now=41
        ),
        "failed_precondition",
    )
    # a stale view (epoch 0) is refused; the current one gets hint-2
    refused(s, c.IssueCheckpointHint(allocation_id=aid, epoch=0, now=50), "stale_revision")
    h2 = ok(s, c.IssueCheckpointHint(allocation_id=aid, epoch=1, now=50)).allocation.checkpoint_hint  # type: ignore[union-attr]
    assert h2.id == "hint-2" and s.allocations[aid].checkpoint_hints == 2  # type: ignore[union-attr]


def test_a_failed_hint_keeps_the_last_checkpoint_and_says_why() -> None:
    s = world()
    aid = running(s)
    ok(s, c.IssueCheckpointHint(allocation_id=aid, epoch=0, now=30))
    ok(
        s,
        c.CompleteCheckpointHint(
            allocation_id=aid, node_id="n0", hint_id="hint-1", outcome="checkpoint_timeout", now=40
        ),
    )
    a = s.allocations[aid]
    assert a.last_checkpoint is None and a.checkpoint_hint.outcome == "checkpoint_timeout"  # type: ignore[union-attr]


def test_only_the_head_node_reports_and_only_running_checkpointable_allocations_are_hinted() -> (
    None
):
    s = world()
    aid = running(s)
    none = running(s, "n1", protocol="")
    refused(s, c.IssueCheckpointHint(allocation_id=none, epoch=0, now=30), "failed_precondition")
    ok(s, c.IssueCheckpointHint(allocation_id=aid, epoch=0, now=30))
    refused(
        s,
        c.CompleteCheckpointHint(
            allocation_id=aid, node_id="n1", hint_id="hint-1", checkpoint=record(aid), now=40
        ),
        "invalid_argument",
    )
    ok(s, c.CancelAllocation(allocation_id=aid, now=50))
    refused(s, c.IssueCheckpointHint(allocation_id=aid, epoch=1, now=60), "invalid_transition")


def test_a_hint_outstanding_in_an_earlier_run_does_not_block_the_next() -> None:
    s = world()
    aid = running(s)
    ok(s, c.IssueCheckpointHint(allocation_id=aid, epoch=0, now=30))
    ok(s, c.RequeueAllocation(allocation_id=aid, reason="node_failure", now=40))
    ok(s, c.AssignNodes(allocation_id=aid, node_ids=["n1"], now=50))
    h = ok(s, c.IssueCheckpointHint(allocation_id=aid, epoch=1, now=60)).allocation.checkpoint_hint  # type: ignore[union-attr]
    assert (h.id, h.run) == ("hint-2", 1)


def test_estimates_change_only_what_differs_and_refuse_nonsense() -> None:
    s = world()
    aid = running(s)
    ok(s, c.SetCheckpointEstimates(minutes={aid: 1.5, "gone": 2.0}, now=30))
    assert s.allocations[aid].checkpoint_minutes == 1.5
    rev = s.revision
    ok(s, c.SetCheckpointEstimates(minutes={aid: 1.5}, now=31))
    assert s.revision == rev  # unchanged: no new revision
    refused(s, c.SetCheckpointEstimates(minutes={aid: float("nan")}, now=32), "invalid_argument")
    refused(s, c.SetCheckpointEstimates(minutes={aid: -1.0}, now=32), "invalid_argument")
    ok(s, c.SetCheckpointEstimates(minutes={aid: None}, now=33))
    assert s.allocations[aid].checkpoint_minutes is None


def test_the_broker_may_propose_its_commands_and_nothing_more() -> None:
    who = Identity(user="checkpoint", role=Role.SERVICE)
    hint = c.IssueCheckpointHint(allocation_id="a", epoch=0)
    check_proposer(who, c.Batch(commands=[hint]))
    check_proposer(who, c.SetCheckpointEstimates(minutes={"a": 1.0}))
    with pytest.raises(PermissionDenied):  # outcomes come from the agents' heartbeats
        check_proposer(who, c.CompleteCheckpointHint(allocation_id="a", node_id="n", hint_id="h"))


def _node_dies(s: GlobalState, node: str, now: float) -> None:
    ok(s, c.SetNodeHealth(node_id=node, state=NodeState.DOWN, reason="no heartbeat", now=now))


def test_a_run_lost_with_its_node_resumes_from_the_hint_checkpoint() -> None:
    s = world()
    aid = running(s)
    ok(s, c.IssueCheckpointHint(allocation_id=aid, epoch=0, now=30))
    ok(
        s,
        c.CompleteCheckpointHint(
            allocation_id=aid, node_id="n0", hint_id="hint-1", checkpoint=record(aid), now=40
        ),
    )
    _node_dies(s, "n0", 50)
    a = s.allocations[aid]
    assert a.state == A.PENDING and a.reason == "node_failure" and a.requeue_count == 1
    assert a.resume_from_checkpoint and a.last_checkpoint == record(aid)
    # the next run, on the other node, is started from that checkpoint
    ok(s, c.AssignNodes(allocation_id=aid, node_ids=["n1"], now=60))
    env = environment(None, s.allocations[aid], Path("/tmp"))
    assert env == {"LATTICE_RESUME": "1", "LATTICE_CHECKPOINT_PATH": record(aid).path}


def test_a_run_lost_with_its_node_without_a_hint_checkpoint_starts_over() -> None:
    s = world()
    plain = running(s, "n0")
    failed = running(s, "n1")
    ok(s, c.IssueCheckpointHint(allocation_id=failed, epoch=0, now=30))
    ok(
        s,
        c.CompleteCheckpointHint(
            allocation_id=failed,
            node_id="n1",
            hint_id="hint-1",
            outcome="checkpoint_timeout",
            now=40,
        ),
    )
    _node_dies(s, "n0", 50)
    _node_dies(s, "n1", 50)
    for aid in (plain, failed):
        a = s.allocations[aid]
        assert a.state == A.PENDING and a.reason == "node_failure"
        assert not a.resume_from_checkpoint and a.last_checkpoint is None
        assert environment(None, a, Path("/tmp")) == {}
