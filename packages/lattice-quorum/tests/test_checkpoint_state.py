"""Checkpoint, suspend and resume in the quorum's apply: the transitions, and a
property test over random command sequences — an allocation is never Suspended without
a checkpoint record, and never holds a node while Suspended."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lattice_common import commands as c
from lattice_common.types import AllocationState as A
from lattice_common.types import CheckpointRecord, NodeCapabilities, RequeuePolicy
from lattice_quorum.state import GlobalState, apply
from lattice_test_harness import builders as b


def world(nodes: int = 2, **vc: object) -> GlobalState:
    s = GlobalState()
    ok(s, c.CreateTenant(tenant=b.tenant("t"), now=1.0))
    ok(s, c.CreateVCluster(vcluster=b.vcluster("v", **vc), now=1.0))
    for i in range(nodes):
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


def running(s: GlobalState, node: str, *, cls: int = 3, protocol: str = "signal", **kw) -> str:
    spec = b.spec(
        tenant="t",
        vcluster="v",
        preemption_class=cls,
        checkpoint="auto" if protocol else "none",
        checkpoint_protocol=protocol,
        **kw,
    )
    aid = ok(s, c.SubmitAllocation(spec=spec, now=10.0)).allocation.id  # type: ignore[union-attr]
    ok(s, c.AssignNodes(allocation_id=aid, node_ids=[node], now=20.0))
    return aid


def record(aid: str, n: int = 1) -> CheckpointRecord:
    return CheckpointRecord(
        id=f"ckpt-{n}", path=f"/ck/t/p/{aid}/checkpoints/ckpt-{n}", size_bytes=10, at=40.0
    )


def test_preempted_victim_is_suspended_with_its_checkpoint_then_requeued_to_resume() -> None:
    s = world()
    victim = running(s, "n0")
    boss = ok(
        s, c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="v", preemption_class=8), now=11.0)
    ).allocation.id  # type: ignore[union-attr]
    ok(s, c.PreemptAllocation(allocation_id=victim, preemptor_id=boss, now=30.0))
    # only the head node's report counts
    res = apply(
        s, c.RecordCheckpoint(allocation_id=victim, node_id="n1", checkpoint=record(victim))
    )
    assert res.error is not None and s.allocations[victim].state == A.CHECKPOINTING
    ok(s, c.RecordCheckpoint(allocation_id=victim, node_id="n0", checkpoint=record(victim)))
    v = s.allocations[victim]
    assert v.state == A.SUSPENDED and v.last_checkpoint == record(victim)
    assert v.assigned_nodes == [] and s.nodes["n0"].owner == ""
    ok(s, c.RequeueAllocation(allocation_id=victim, reason="preempted", preempted=True, now=41.0))
    v = s.allocations[victim]
    assert (v.state, v.submitted_at, v.preempted_count, v.resume_from_checkpoint) == (
        A.PENDING,
        10.0,
        1,
        True,
    )
    assert v.last_checkpoint is not None  # its next run resumes from it


def test_suspended_is_reached_only_with_a_checkpoint_record() -> None:
    s = world()
    aid = running(s, "n0")
    ok(s, c.SuspendAllocation(allocation_id=aid, requested_by="u", now=30.0))
    res = apply(s, c.UpdateAllocationState(allocation_id=aid, state=A.SUSPENDED, now=31.0))
    assert res.error is not None and res.error["code"] == "invalid_transition"
    bad = CheckpointRecord(id="", path="")
    assert apply(s, c.RecordCheckpoint(allocation_id=aid, node_id="n0", checkpoint=bad)).error
    assert s.allocations[aid].state == A.CHECKPOINTING


def test_owner_suspend_waits_for_resume_and_resume_requeues_at_once() -> None:
    s = world()
    aid = running(s, "n0")
    a = ok(s, c.SuspendAllocation(allocation_id=aid, requested_by="u", now=30.0)).allocation
    assert a is not None and a.state == A.CHECKPOINTING and a.preempted_by == ""
    ok(s, c.RecordCheckpoint(allocation_id=aid, node_id="n0", checkpoint=record(aid)))
    assert s.allocations[aid].state == A.SUSPENDED and s.allocations[aid].reason == "suspended"
    ok(s, c.ResumeAllocation(allocation_id=aid, requested_by="u", now=50.0))
    a = s.allocations[aid]
    assert (a.state, a.resume_from_checkpoint, a.submitted_at) == (A.PENDING, True, 10.0)
    # resuming what is not Suspended is refused
    assert apply(s, c.ResumeAllocation(allocation_id=aid, now=51.0)).error is not None


def test_suspend_needs_a_protocol_a_running_allocation_and_a_willing_vcluster() -> None:
    s = world()
    none = running(s, "n0", protocol="")
    err = apply(s, c.SuspendAllocation(allocation_id=none, now=30.0)).error
    assert err is not None and "--checkpoint" in err["hint"]
    s2 = world(allow_user_suspend=False)
    aid = running(s2, "n0")
    err = apply(s2, c.SuspendAllocation(allocation_id=aid, now=30.0)).error
    assert err is not None and err["code"] == "permission_denied"
    assert s2.allocations[aid].state == A.RUNNING


def test_failed_checkpoint_ends_failed_and_is_requeued_only_per_policy() -> None:
    s = world()
    keep = running(s, "n0", requeue_policy=RequeuePolicy.ALWAYS)
    drop = running(s, "n1")
    for aid in (keep, drop):
        ok(s, c.SuspendAllocation(allocation_id=aid, now=30.0))
        ok(
            s,
            c.UpdateAllocationState(
                allocation_id=aid, state=A.FAILED, reason="checkpoint_timeout", now=40.0
            ),
        )
    assert s.allocations[drop].state == A.FAILED
    assert s.allocations[drop].reason == "checkpoint_timeout"
    assert s.allocations[keep].state == A.PENDING and s.allocations[keep].requeue_count == 1
    assert s.nodes["n0"].owner == "" and s.nodes["n1"].owner == ""


# --- the property ------------------------------------------------------------------------

_STEPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "assign",
                "preempt",
                "suspend",
                "record",
                "record_other_node",
                "record_empty",
                "set_suspended",
                "set_failed",
                "set_completed",
                "requeue_preempted",
                "resume",
                "cancel",
            ]
        ),
        st.integers(0, 2),  # which allocation
        st.integers(0, 1),  # which node
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_STEPS)
def test_never_suspended_without_a_checkpoint_nor_holding_nodes(steps) -> None:
    s = world(nodes=2)
    boss = ok(
        s, c.SubmitAllocation(spec=b.spec(tenant="t", vcluster="v", preemption_class=9), now=5.0)
    ).allocation.id  # type: ignore[union-attr]
    ids = [
        ok(
            s,
            c.SubmitAllocation(
                spec=b.spec(
                    tenant="t",
                    vcluster="v",
                    preemption_class=2,
                    checkpoint_protocol=p,
                    checkpoint="auto" if p else "none",
                ),
                now=10.0,
            ),
        ).allocation.id  # type: ignore[union-attr]
        for p in ("signal", "grpc", "")
    ]
    now = 20.0
    for op, i, n in steps:
        now += 1.0
        aid, node = ids[i], f"n{n}"
        head = (s.allocations[aid].assigned_nodes or [node])[0]
        cmd: c.Command = {
            "assign": c.AssignNodes(allocation_id=aid, node_ids=[node], now=now),
            "preempt": c.PreemptAllocation(allocation_id=aid, preemptor_id=boss, now=now),
            "suspend": c.SuspendAllocation(allocation_id=aid, now=now),
            "record": c.RecordCheckpoint(
                allocation_id=aid, node_id=head, checkpoint=record(aid), now=now
            ),
            "record_other_node": c.RecordCheckpoint(
                allocation_id=aid, node_id="n9", checkpoint=record(aid), now=now
            ),
            "record_empty": c.RecordCheckpoint(
                allocation_id=aid,
                node_id=head,
                checkpoint=CheckpointRecord(id="", path=""),
                now=now,
            ),
            "set_suspended": c.UpdateAllocationState(allocation_id=aid, state=A.SUSPENDED, now=now),
            "set_failed": c.UpdateAllocationState(allocation_id=aid, state=A.FAILED, now=now),
            "set_completed": c.UpdateAllocationState(allocation_id=aid, state=A.COMPLETED, now=now),
            "requeue_preempted": c.RequeueAllocation(
                allocation_id=aid, reason="preempted", preempted=True, now=now
            ),
            "resume": c.ResumeAllocation(allocation_id=aid, now=now),
            "cancel": c.CancelAllocation(allocation_id=aid, now=now),
        }[op]
        before = msgspec.msgpack.encode(s.allocations[aid])
        res = apply(s, cmd)
        if res.error is not None:  # a refused command changes nothing
            assert msgspec.msgpack.encode(s.allocations[aid]) == before
        for a in s.allocations.values():
            if a.state == A.SUSPENDED:
                assert a.last_checkpoint is not None and a.last_checkpoint.id, a
                assert a.assigned_nodes == [], a
                assert all(node.owner != a.id for node in s.nodes.values()), a
