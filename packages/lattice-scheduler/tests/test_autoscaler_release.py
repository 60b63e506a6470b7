"""Scale-down checkpoints the nodes being released first, and the oscillation alert:
the autoscaler's shell on the real quorum state machine (LocalQuorum), a stepped clock,
and the allocation's metric answered as the TSDB's ``avg by (node_id)`` vector would
(the test is the load generator; the TSDB itself is exercised by
``test_autoscaler_tsdb.py``). The head node's agent is played by the command its report
becomes, ``CompleteCheckpointHint``.

Shown: a checkpointable reactive allocation keeps its nodes while the checkpoint hint
is outstanding and releases the node once the checkpoint is recorded (the reason says
which); without an outcome by ``release_timeout`` the node goes anyway; a failed
checkpoint releases at once; a restarted autoscaler finishes a release it did not
start; an allocation without a checkpoint protocol is scaled down directly; up/down
flapping beyond 5 alternations sets the oscillation gauge."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_common import commands as c
from lattice_common.types import (
    AllocationSpec,
    CheckpointHint,
    CheckpointRecord,
    LifecycleType,
    NodeCapabilities,
    ScalingSpec,
    Tenant,
    VCluster,
)
from lattice_common.watch import StateMirror, decode_delta
from lattice_quorum.local import LocalQuorum
from lattice_scheduler import autoscale
from lattice_scheduler import autoscaler as shell
from lattice_scheduler.autoscaler import Autoscaler

SCALING = ScalingSpec(
    metric="cpu_utilization",
    target=0.8,
    evaluation_interval=10,
    scale_up_window=10,
    scale_down_window=10,
    scale_down_threshold=0.25,
    cooldown=20,
)
TIMEOUT = 60.0


class World:
    """5 two-core nodes, tenant physics, one reactive allocation (2..4 nodes) running on
    three of them, its processes at ``percent`` of one core per node."""

    def __init__(self, *, protocol: str = "signal", nodes: int = 3) -> None:
        self.lq = LocalQuorum()
        self.t = 1_000_000.0
        self.percent = 10.0  # idle: 0.05 of a node, below 0.8 * 0.25
        ok = self.lq.apply
        ok(c.CreateTenant(tenant=Tenant(name="physics")))
        ok(c.CreateVCluster(vcluster=VCluster(name="svc", tenant="physics")))
        for i in range(5):
            r = ok(c.RegisterNode(node_id=f"n{i}", capabilities=NodeCapabilities(cpu_cores=2)))
            assert r.error is None, r.error
        spec = AllocationSpec(
            entrypoint="serve",
            tenant="physics",
            vcluster="svc",
            nodes=4,
            min_nodes=2,
            lifecycle=LifecycleType.REACTIVE,
            scaling=SCALING,
            checkpoint="auto" if protocol else "none",
            checkpoint_protocol=protocol,
        )
        res = ok(c.SubmitAllocation(spec=spec, now=self.t))
        assert res.error is None, res.error
        self.alloc_id = res.allocation.id
        ids = [f"n{i}" for i in range(nodes)]
        res = ok(c.AssignNodes(allocation_id=self.alloc_id, node_ids=ids, now=self.t))
        assert res.error is None, res.error
        self.scaler = self.new_scaler()

    def new_scaler(self) -> Autoscaler:
        return Autoscaler(
            self.lq,  # type: ignore[arg-type]
            ["svc"],
            tsdb_url="http://tsdb",
            release_timeout=TIMEOUT,
            query=self.query,
            clock=lambda: self.t,
        )

    def query(self, _url: str, _expr: str, _scope: Mapping[str, str], _t: float) -> list[Any]:
        return [
            {"metric": {"node_id": n}, "value": [self.t, str(self.percent)]}
            for n in self.alloc.assigned_nodes
        ]

    def mirror(self) -> StateMirror:
        m = StateMirror()
        m.apply(decode_delta(self.lq.snapshot_delta()))
        return m

    @property
    def alloc(self):  # type: ignore[no-untyped-def]
        return self.lq.state.allocations[self.alloc_id]

    async def step(self, n: int = 1, seconds: float = SCALING.evaluation_interval) -> None:
        for _ in range(n):
            self.t += seconds
            await self.scaler.evaluate(self.mirror())

    async def until_releasing(self) -> None:
        for _ in range(10):
            await self.step()
            if self.alloc.scaling_status and self.alloc.scaling_status.releasing:
                return
        raise AssertionError(f"no scale-down started: {self.alloc.scaling_status}")

    def agent_reports(self, *, ok: bool = True) -> None:
        """The head node's agent: the hint's checkpoint written (or not)."""
        h = self.alloc.checkpoint_hint
        record = CheckpointRecord(
            id="ckpt-1",
            path="/ck/physics/default/a/checkpoints/ckpt-1/",
            size_bytes=4096,
            duration_seconds=2.0,
            at=self.t,
        )
        res = self.lq.apply(
            c.CompleteCheckpointHint(
                allocation_id=self.alloc_id,
                node_id=self.alloc.assigned_nodes[0],
                hint_id=h.id,
                checkpoint=record if ok else None,
                outcome="ok" if ok else "checkpoint_failed: disk full",
                now=self.t,
            )
        )
        assert res.error is None, res.error


def released(result: str) -> float:
    return shell.RELEASES.labels(result)._value.get()


async def test_the_node_goes_after_its_checkpoint() -> None:
    w = World()
    before = released("checkpointed")
    await w.until_releasing()
    st = w.alloc.scaling_status
    assert st.releasing == ["n2"] and st.target == 2 and st.last_decision == "down"
    assert st.release_by == st.release_at + TIMEOUT
    h = w.alloc.checkpoint_hint
    assert h is not None and h.done_at is None and h.reason == "scale_down: releasing n2"
    await w.step(3, seconds=5)  # no outcome yet: the node stays, no second hint
    assert w.alloc.assigned_nodes == ["n0", "n1", "n2"]
    assert w.alloc.checkpoint_hints == 1
    w.agent_reports()
    await w.step(1, seconds=1)
    assert w.alloc.assigned_nodes == ["n0", "n1"]
    assert w.lq.state.nodes["n2"].owner == ""
    st = w.alloc.scaling_status
    assert st.releasing == [] and st.target == 2
    assert st.reason.startswith("cpu_utilization 0.05 <= 0.20")
    assert st.reason.endswith("; checkpoint ckpt-1 written first")
    assert w.alloc.last_checkpoint is not None and w.alloc.last_checkpoint.id == "ckpt-1"
    assert released("checkpointed") - before == 1
    # at min_nodes now: no further scale-down, no further hint
    await w.step(6)
    assert w.alloc.assigned_nodes == ["n0", "n1"] and w.alloc.checkpoint_hints == 1


async def test_without_an_outcome_the_node_goes_at_the_deadline() -> None:
    w = World()
    before = released("timeout")
    await w.until_releasing()
    asked = w.alloc.scaling_status.release_at
    await w.step(int(TIMEOUT // 5) - 1, seconds=5)
    assert len(w.alloc.assigned_nodes) == 3  # still waiting, just before the deadline
    await w.step(1, seconds=5)
    assert w.alloc.assigned_nodes == ["n0", "n1"]
    assert w.t - asked == TIMEOUT
    assert "released without a checkpoint (none after 60 s)" in w.alloc.scaling_status.reason
    assert released("timeout") - before == 1


async def test_a_failed_checkpoint_releases_at_once() -> None:
    w = World()
    before = released("failed")
    await w.until_releasing()
    w.agent_reports(ok=False)
    await w.step(1, seconds=1)
    assert w.alloc.assigned_nodes == ["n0", "n1"]
    reason = w.alloc.scaling_status.reason
    assert reason.endswith("released without a checkpoint (checkpoint_failed: disk full)")
    assert w.alloc.last_checkpoint is None
    assert released("failed") - before == 1


async def test_a_restarted_scheduler_finishes_the_release() -> None:
    w = World()
    await w.until_releasing()
    w.scaler = w.new_scaler()  # nothing in memory: the release is in the quorum
    await w.step(2, seconds=1)
    assert len(w.alloc.assigned_nodes) == 3 and w.alloc.checkpoint_hints == 1
    w.agent_reports()
    await w.step(1, seconds=1)
    assert w.alloc.assigned_nodes == ["n0", "n1"]


async def test_an_outstanding_broker_hint_serves_and_a_lost_one_is_asked_again() -> None:
    w = World()
    # the broker hinted a moment before the scale-down: no second hint, its outcome serves
    w.lq.apply(c.IssueCheckpointHint(allocation_id=w.alloc_id, epoch=0, reason="x", now=w.t))
    await w.until_releasing()
    assert w.alloc.checkpoint_hints == 1 and w.alloc.checkpoint_hint.reason == "x"
    w.agent_reports()
    await w.step(1, seconds=1)
    assert len(w.alloc.assigned_nodes) == 2
    # a release whose hint is not there (a race with the broker): asked again
    w2 = World()
    await w2.until_releasing()
    w2.agent_reports()  # an outcome from before the release was asked does not count
    st = w2.alloc.scaling_status
    w2.lq.apply(
        c.SetScalingStatus(
            statuses={w2.alloc_id: autoscale_replace(st, release_at=w2.t + 1)}, now=w2.t
        )
    )
    await w2.step(1, seconds=2)
    assert len(w2.alloc.assigned_nodes) == 3
    assert w2.alloc.checkpoint_hints == 2 and w2.alloc.checkpoint_hint.done_at is None


def autoscale_replace(st: Any, **kw: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(st, **kw)


async def test_without_a_protocol_the_node_goes_directly() -> None:
    w = World(protocol="")
    for _ in range(10):
        await w.step()
        if len(w.alloc.assigned_nodes) == 2:
            break
    assert w.alloc.assigned_nodes == ["n0", "n1"]
    assert w.alloc.checkpoint_hints == 0 and w.alloc.checkpoint_hint is None


async def test_flapping_sets_the_oscillation_gauge() -> None:
    w = World(protocol="", nodes=2)
    events = 0
    last = len(w.alloc.assigned_nodes)
    for _ in range(80):
        w.percent = 180.0 if len(w.alloc.assigned_nodes) == 2 else 10.0  # metric follows size
        await w.step()
        if len(w.alloc.assigned_nodes) != last:
            events += 1
            last = len(w.alloc.assigned_nodes)
        if shell.OSCILLATING._value.get() >= 1:
            break
    assert shell.OSCILLATING._value.get() == 1
    assert events == autoscale.OSCILLATION_ALTERNATIONS + 2  # 6 alternations: 7 events
    w.scaler.tracks.clear()  # allocation gone from the autoscaler's view
    await w.scaler.evaluate(StateMirror())
    assert shell.OSCILLATING._value.get() == 0


# --- the pure parts -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "n", "alarm"),
    [
        ([], 0, False),
        (["up"], 0, False),
        (["up", "down", "up"], 2, False),
        (["up", "up", "down"], 1, False),
        (["up", "down"] * 3, 5, False),
        (["up", "down"] * 3 + ["up"], 6, True),
        (["down"] + ["up", "down"] * 3 + ["down"], 0, False),
    ],
)
def test_alternations(events: list[str], n: int, alarm: bool) -> None:
    assert autoscale.alternations(events) == n
    assert autoscale.oscillating(events) is alarm


times = st.floats(0.0, 1000.0)


@given(
    times,
    st.floats(0.0, 600.0),
    st.one_of(st.none(), times),
    st.sampled_from(["ok", "checkpoint_timeout", "checkpoint_failed: x"]),
    st.booleans(),
    times,
)
def test_release_step(
    asked: float,
    timeout: float,
    done_at: float | None,
    outcome: str,
    outstanding: bool,
    now: float,
) -> None:
    hint = CheckpointHint(id="hint-1", epoch=1, at=asked, done_at=done_at, outcome=outcome)
    step = autoscale.release_step(["n2"], asked, asked + timeout, hint, outstanding, "ckpt-3", now)
    assert step is not None
    counted = done_at is not None and done_at >= asked
    if now >= asked + timeout or counted:  # the deadline and an outcome always release
        assert step.action == autoscale.RELEASE_GO
        assert step.result in ("checkpointed", "failed", "timeout")
        if step.result == "checkpointed":
            assert counted and outcome == "ok" and "ckpt-3" in step.why
    else:
        assert step.action == (autoscale.RELEASE_WAIT if outstanding else autoscale.RELEASE_HINT)
    assert autoscale.release_step([], asked, None, hint, outstanding, "", now) is None


# --- borrowed nodes: scale-up may borrow; a reclaimed one goes back within the grace --


class Lending(World):
    """vCluster svc's pool n0..n2, vCluster batch's b0..b1 (lends its idle nodes); the
    reactive allocation of svc (2..4 nodes) on n0, n1, busy."""

    def __init__(self, *, protocol: str = "") -> None:
        self.lq = LocalQuorum()
        self.t = 1_000_000.0
        self.percent = 180.0
        ok = self.lq.apply
        ok(c.CreateTenant(tenant=Tenant(name="physics")))
        ok(c.CreateVCluster(vcluster=VCluster(name="svc", tenant="physics")))
        ok(c.CreateVCluster(vcluster=VCluster(name="batch", tenant="physics")))
        pools = {"n0": "svc", "n1": "svc", "n2": "svc", "b0": "batch", "b1": "batch"}
        for nid, home in pools.items():
            r = ok(
                c.RegisterNode(
                    node_id=nid, capabilities=NodeCapabilities(cpu_cores=2), home_vcluster=home
                )
            )
            assert r.error is None, r.error
        spec = AllocationSpec(
            entrypoint="serve",
            tenant="physics",
            vcluster="svc",
            nodes=4,
            min_nodes=2,
            lifecycle=LifecycleType.REACTIVE,
            scaling=SCALING,
            checkpoint="auto" if protocol else "none",
            checkpoint_protocol=protocol,
        )
        res = ok(c.SubmitAllocation(spec=spec, now=self.t))
        self.alloc_id = res.allocation.id
        ok(c.AssignNodes(allocation_id=self.alloc_id, node_ids=["n0", "n1"], now=self.t))
        self.scaler = self.new_scaler()

    def new_scaler(self) -> Autoscaler:
        s = super().new_scaler()
        s.borrowed_grace = 30.0
        return s

    def home_wants_its_node(self) -> None:
        spec = AllocationSpec(entrypoint="x", tenant="physics", vcluster="batch", nodes=2)
        assert self.lq.apply(c.SubmitAllocation(spec=spec, now=self.t)).error is None


async def test_scale_up_borrows_beyond_its_own_pool() -> None:
    w = Lending()
    for _ in range(12):
        await w.step()
    assert w.alloc.assigned_nodes[:3] == ["n0", "n1", "n2"]  # its own pool first
    assert len(w.alloc.assigned_nodes) == 4 and w.alloc.assigned_nodes[3].startswith("b")


async def test_a_reclaimed_borrowed_node_goes_back_within_the_grace() -> None:
    w = Lending()
    for _ in range(12):
        await w.step()
    borrowed = w.alloc.assigned_nodes[3]
    w.home_wants_its_node()
    await w.step(1, seconds=1)
    st = w.alloc.scaling_status
    assert st.releasing == [borrowed] and st.release_by == st.release_at + 30.0
    assert st.reason == f"vCluster batch reclaims borrowed node {borrowed}"
    assert w.alloc.checkpoint_hints == 0  # no protocol: its grace is to drain the node
    await w.step(29, seconds=1)
    assert borrowed in w.alloc.assigned_nodes  # within the grace
    await w.step(1, seconds=1)
    assert w.alloc.assigned_nodes == ["n0", "n1", "n2"]
    assert w.lq.state.nodes[borrowed].owner == ""
    assert w.alloc.scaling_status.reason.endswith("released without a checkpoint (none after 30 s)")


async def test_a_checkpointing_borrower_gives_the_node_back_after_its_checkpoint() -> None:
    w = Lending(protocol="grpc")
    for _ in range(12):
        await w.step()
    borrowed = w.alloc.assigned_nodes[3]
    w.home_wants_its_node()
    await w.step(1, seconds=1)
    assert w.alloc.checkpoint_hint.reason == f"scale_down: releasing {borrowed}"
    w.agent_reports()
    await w.step(1, seconds=1)
    assert borrowed not in w.alloc.assigned_nodes


def test_reclaimed_node_and_who_gives_back_by_scaling() -> None:
    homes = {"n0": "svc", "n1": "", "b0": "batch", "b1": "batch", "c0": "ml"}
    assert autoscale.reclaimed_node(["n0", "b0", "n1", "b1"], homes, "svc", {"batch"}) == "b1"
    assert autoscale.reclaimed_node(["n0", "b0", "c0"], homes, "svc", {"batch"}) == "b0"
    assert autoscale.reclaimed_node(["b0", "n0"], homes, "svc", {"batch"}) == ""  # head
    assert autoscale.reclaimed_node(["n0", "b0"], homes, "svc", set()) == ""  # not wanted
    give = autoscale.gives_back_by_scaling
    assert give(["n0", "n1", "b0"], homes, "svc", 2, "batch")
    assert not give(["n0", "b0"], homes, "svc", 2, "batch")  # would drop below min_nodes
    assert not give(["b0", "n0", "n1"], homes, "svc", 2, "batch")  # its head is borrowed
    assert not give(["n0", "n1"], homes, "svc", 2, "batch")  # borrows nothing from batch


def test_preemption_leaves_a_reactive_borrower_to_give_the_node_back() -> None:
    from lattice_common.types import AllocationState
    from lattice_scheduler.decide import decide_vcluster
    from lattice_test_harness import builders as b

    nodes = [
        b.node("n0", home_vcluster="svc", owner="r"),
        b.node("n1", home_vcluster="svc", owner="r"),
        b.node("b0", home_vcluster="batch", owner="r"),
    ]
    r = b.allocation(
        id="r",
        vcluster="svc",
        state=AllocationState.RUNNING,
        nodes=4,
        min_nodes=2,
        preemption_class=3,
    )
    r.spec.lifecycle = LifecycleType.REACTIVE
    r.assigned_nodes = ["n0", "n1", "b0"]
    r.spec.walltime_seconds = 0  # unbounded, like any reactive allocation
    r.started_at = 9_000.0
    home = b.allocation(id="h", vcluster="batch", submitted_at=100.0, preemption_class=5)
    m = StateMirror()
    m.nodes = {n.id: n for n in nodes}
    m.allocations = {"r": r, "h": home}
    m.pending, m.holding = {"h": None}, {"r": None}
    m.vclusters = {
        "svc": VCluster(name="svc", tenant="physics"),
        "batch": VCluster(name="batch", tenant="physics"),
    }
    assert decide_vcluster(m, "batch", 10_000.0).preemptions == []
    r.assigned_nodes = ["b0", "n0", "n1"]  # the borrowed node is its head: preempted
    assert [p.victim for p in decide_vcluster(m, "batch", 10_000.0).preemptions] == ["r"]
