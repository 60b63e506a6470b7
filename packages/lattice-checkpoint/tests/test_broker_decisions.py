"""The broker's evaluation pass (pure, over a state snapshot): who gets a hint, who is
skipped and why, the order on storage recovery, and the f8 estimates it publishes.
Also the default storage probe against a real directory."""

from __future__ import annotations

import pytest
from lattice_checkpoint import cost
from lattice_checkpoint.broker import evaluate
from lattice_common.types import (
    Allocation,
    AllocationState,
    CheckpointHint,
    CheckpointRecord,
    GpuDevice,
    Node,
    NodeCapabilities,
    NodeState,
)
from lattice_test_harness import builders as b

NOW = 1_000_000.0
STORAGE = cost.StorageView(write_bandwidth_bytes_per_s=1e9)
EAGER = cost.ModelParams(node_mtbf_hours=0.001)  # every run is at risk: value = work done
INTERVAL = 30.0


def node(i: int, *, gpus: int = 0, state: NodeState = NodeState.READY) -> Node:
    devs = [GpuDevice(index=k, memory_bytes=80 << 30) for k in range(gpus)]
    return Node(id=f"n{i}", state=state, capabilities=NodeCapabilities(gpus=devs, gpu_count=gpus))


def alloc(
    aid: str,
    *,
    state: AllocationState = AllocationState.RUNNING,
    nodes: tuple[str, ...] = ("n0",),
    protocol: str = "signal",
    started: float = NOW - 3600.0,
    cls: int = 3,
    **kw: object,
) -> Allocation:
    spec = b.spec(
        tenant="t",
        vcluster="v",
        preemption_class=cls,
        checkpoint="auto" if protocol else "none",
        checkpoint_protocol=protocol,
        walltime_seconds=86_400,
    )
    return Allocation(
        id=aid,
        spec=spec,
        state=state,
        assigned_nodes=list(nodes) if state == AllocationState.RUNNING else [],
        started_at=started if state == AllocationState.RUNNING else None,
        **kw,  # type: ignore[arg-type]
    )


def run(allocs: list[Allocation], nodes: list[Node] | None = None, **kw: object):
    return evaluate(
        {a.id: a for a in allocs},
        {n.id: n for n in nodes or [node(0), node(1), node(2)]},
        NOW,
        kw.pop("storage", STORAGE),  # type: ignore[arg-type]
        interval=INTERVAL,
        params=kw.pop("params", EAGER),  # type: ignore[arg-type]
    )


def test_running_checkpointable_allocation_gets_a_hint_with_its_epoch() -> None:
    ev = run([alloc("a", checkpoint_hints=2)])
    assert [(h.allocation_id, h.epoch) for h in ev.hints] == [("a", 2)]
    assert ev.hints[0].decision.checkpoint


def test_checkpoint_none_or_manual_and_not_running_are_never_hinted() -> None:
    manual = alloc("manual", nodes=("n1",))
    manual.spec.checkpoint = "manual"  # the application decides when
    ev = run(
        [
            manual,
            alloc("none", protocol=""),
            alloc("pending", state=AllocationState.PENDING),
            alloc("suspended", state=AllocationState.SUSPENDED),
        ]
    )
    assert ev.hints == [] and ev.decisions == []


def test_an_outstanding_hint_is_not_repeated_but_one_of_an_earlier_run_is_moot() -> None:
    outstanding = CheckpointHint(id="hint-1", epoch=1, at=NOW - 3000, run=0)
    earlier_run = CheckpointHint(id="hint-1", epoch=1, at=NOW - 3000, run=0)
    ev = run(
        [
            alloc("a", checkpoint_hint=outstanding, checkpoint_hints=1),
            alloc("b", checkpoint_hint=earlier_run, checkpoint_hints=1, requeue_count=1),
        ]
    )
    assert ev.skipped == {"a": "hint_outstanding"}
    assert [h.allocation_id for h in ev.hints] == ["b"]


def test_checkpointed_or_hinted_within_the_interval_is_skipped() -> None:
    ck = CheckpointRecord(id="ckpt-1-hint-1", path="/ck", size_bytes=10, at=NOW - 5)
    failed = CheckpointHint(
        id="hint-1", epoch=1, at=NOW - 5, run=0, done_at=NOW - 1, outcome="checkpoint_timeout"
    )
    old = CheckpointRecord(id="ckpt-1-hint-1", path="/ck", size_bytes=10, at=NOW - 600)
    ev = run(
        [
            alloc("a", last_checkpoint=ck, checkpoint_hints=1),
            alloc("b", checkpoint_hint=failed, checkpoint_hints=1),
            alloc("c", last_checkpoint=old, checkpoint_hints=1),
        ]
    )
    assert ev.skipped == {"a": "checkpointed_recently", "b": "checkpointed_recently"}
    assert [h.allocation_id for h in ev.hints] == ["c"]


def test_no_bandwidth_pauses_every_hint_and_keeps_the_estimates() -> None:
    ev = run([alloc("a"), alloc("b", nodes=("n1",))], storage=cost.StorageView(0.0))
    assert ev.hints == [] and ev.estimates == {}
    assert {d.reason for d in ev.decisions} == {"storage_unavailable"}


def test_hints_go_most_recompute_to_save_first() -> None:
    ev = run(
        [
            alloc("young", started=NOW - 600),
            alloc("old", nodes=("n1",), started=NOW - 7200),
            alloc("wide", nodes=("n2", "n3", "n4", "n5"), started=NOW - 3600),
        ],
        nodes=[node(i) for i in range(6)],
    )
    assert [h.allocation_id for h in ev.hints] == ["wide", "old", "young"]


def test_waiting_higher_class_work_tips_a_quiet_allocation_over() -> None:
    quiet = cost.ModelParams()  # the default MTBF: an hour of work is not at risk yet
    gpus = [node(0, gpus=4)]
    victim = alloc("v", nodes=("n0",), cls=2)
    assert run([victim], nodes=gpus, params=quiet).hints == []
    urgent = [alloc(f"p{i}", state=AllocationState.PENDING, cls=9) for i in range(3)]
    ev = run([victim, *urgent], nodes=gpus, params=quiet)
    assert [h.allocation_id for h in ev.hints] == ["v"]
    assert ev.hints[0].decision.reason == "preemptability"


def test_degraded_node_raises_the_value() -> None:
    quiet = cost.ModelParams()
    healthy = run([alloc("a")], params=quiet).decisions[0].value.total
    sick = run([alloc("a")], nodes=[node(0, state=NodeState.DEGRADED)], params=quiet).decisions[0]
    assert sick.value.total > healthy


def test_estimates_come_from_measured_checkpoints_or_bandwidth_and_only_when_changed() -> None:
    measured = CheckpointRecord(
        id="c", path="/ck", size_bytes=10, duration_seconds=30, at=NOW - 900
    )
    ev = run(
        [
            alloc("gpu", nodes=("n0",)),
            alloc("measured", nodes=("n1",), last_checkpoint=measured),
            alloc("same", nodes=("n2",), last_checkpoint=measured, checkpoint_minutes=0.5),
            alloc("queued", state=AllocationState.PENDING),
        ],
        nodes=[node(0, gpus=4), node(1), node(2)],
    )
    assert ev.estimates["measured"] == 0.5
    assert "same" not in ev.estimates  # unchanged: nothing to publish
    # 4 GPUs x 80 GiB at 1 GB/s
    assert ev.estimates["gpu"] == pytest.approx(4 * (80 << 30) / 1e9 / 60, rel=1e-3)
    assert ev.estimates["queued"] == pytest.approx((1 << 30) / 1e9 / 60, rel=1e-3)


def test_ten_thousand_allocations_are_evaluated_within_a_second() -> None:

    allocs = [alloc(f"a{i}", nodes=(f"n{i % 500}",)) for i in range(10_000)]
    nodes = [node(i) for i in range(500)]
    ev = run(allocs, nodes=nodes)  # its time: scripts/bench/checkpoint.py
    assert len(ev.decisions) == 10_000
