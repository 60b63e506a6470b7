"""The scheduler's preemption metrics, counted from the watch-state stream."""

from __future__ import annotations

import msgspec
from lattice_common.types import AllocationState
from lattice_scheduler.loop import Scheduler
from lattice_test_harness import builders as b
from prometheus_client import REGISTRY


def _value(name: str, vc: str) -> float:
    return REGISTRY.get_sample_value(name, {"vcluster": vc}) or 0.0


def test_a_victim_coming_back_counts_a_requeue_and_its_checkpoint_time() -> None:
    s = Scheduler(quorum=None, vclusters=["metrics-vc"])  # type: ignore[arg-type]
    victim = b.allocation(id="v1", vcluster="metrics-vc", state=AllocationState.CHECKPOINTING)
    victim.checkpoint_hint_at = 100.0
    s.mirror.allocations["v1"] = victim
    requeues = _value("lattice_preemption_victim_requeue_total", "metrics-vc")
    count = _value("lattice_preemption_checkpoint_duration_seconds_count", "metrics-vc")
    back = msgspec.structs.replace(victim, state=AllocationState.PENDING, finished_at=112.0)
    s._observe_preemptions([back])
    assert _value("lattice_preemption_victim_requeue_total", "metrics-vc") == requeues + 1
    assert _value("lattice_preemption_checkpoint_duration_seconds_count", "metrics-vc") == count + 1
    total = _value("lattice_preemption_checkpoint_duration_seconds_sum", "metrics-vc")
    assert total >= 12.0
    # an allocation of another vCluster, or one that was not being preempted: nothing
    other = b.allocation(id="o1", vcluster="elsewhere", state=AllocationState.RUNNING)
    s.mirror.allocations["o1"] = other
    s._observe_preemptions([msgspec.structs.replace(other, state=AllocationState.COMPLETED)])
    assert _value("lattice_preemption_victim_requeue_total", "elsewhere") == 0.0


def test_the_configured_budget_window_reaches_every_decision(tmp_path, monkeypatch) -> None:
    """``scheduling.budget_period_days`` from the scheduler's config file is the window
    of the cost function's budget penalty (the API reports usage over the same one)."""
    import asyncio

    from lattice_scheduler import decide, main

    cfg = tmp_path / "lattice.yaml"
    cfg.write_text("scheduling:\n  budget_period_days: 7\n")
    s = main.build_scheduler(
        main.parse_args(["--vcluster", "v", "--config", str(cfg), "--metrics-listen", ""])
    )
    assert s.budget_period_days == 7
    seen: list[float] = []

    def fake_decide(m, vc, now, **kw):  # type: ignore[no-untyped-def]
        seen.append(kw["budget_period_days"])
        return decide.CycleDecision()

    monkeypatch.setattr(decide, "decide_vcluster", fake_decide)
    asyncio.run(s.cycle())
    assert seen == [7]
    s.quorum.endpoints.close()


class _RecordingQuorum:
    """Takes proposals and answers each with success; keeps what it was sent."""

    def __init__(self) -> None:
        from lattice_common import commands as c

        self.c = c
        self.sent: list[object] = []

    async def propose(self, cmd):  # type: ignore[no-untyped-def]
        self.sent.append(cmd)
        if isinstance(cmd, self.c.Batch):
            return self.c.CommandResult(
                revision=1, results=[self.c.CommandResult(revision=1) for _ in cmd.commands]
            )
        return self.c.CommandResult(revision=1)


def test_a_cycle_publishes_reasons_and_reservations_and_the_simulation_the_rest() -> None:
    """In the cycle: pending reasons (no times in them, so they do not change as jobs
    end early); between cycles: the reservations' and the simulated starts (nothing for
    what the cycle itself starts)."""
    import asyncio
    import time

    from lattice_common import commands as c
    from lattice_common.types import ESTIMATE_RESERVATION, ESTIMATE_SIMULATION

    now = time.time()
    q = _RecordingQuorum()
    s = Scheduler(quorum=q, vclusters=["v"], cycle_interval=5.0)  # type: ignore[arg-type]
    m = s.mirror
    for i in (1, 2):
        run = b.allocation(id=f"r{i}", state=AllocationState.RUNNING, walltime_seconds=600)
        run = msgspec.structs.replace(run, assigned_nodes=[f"n{i}"], started_at=now - 600 + 100 * i)
        m.allocations[run.id] = run
        m.holding[run.id] = None
        m.nodes[f"n{i}"] = b.node(f"n{i}", owner=run.id)
    m.nodes["n3"] = b.node("n3")
    jobs = [
        b.allocation(id="big", nodes=3, preemption_class=9, walltime_seconds=300, submitted_at=1),
        b.allocation(id="small", walltime_seconds=60, submitted_at=2),
        b.allocation(id="late", nodes=2, walltime_seconds=600, submitted_at=3),
    ]
    for a in jobs:
        m.allocations[a.id] = a
        m.pending[a.id] = None
    asyncio.run(s.cycle())
    reasons = [x for x in q.sent if isinstance(x, c.SetPendingReasons)]
    assert len(reasons) == 1
    # no reservation in the text: it would change whenever a job ends early
    assert reasons[0].reasons["big"] == "all suitable nodes occupied"
    assert reasons[0].estimates == {}
    q.sent.clear()
    asyncio.run(s._simulate())
    (published,) = [x for x in q.sent if isinstance(x, c.SetPendingReasons)]
    assert published.estimates["big"].estimate_basis == ESTIMATE_RESERVATION
    assert "small" not in published.estimates  # the cycle starts it (backfill): no news
    late = published.estimates["late"]
    assert late.estimate_basis in (ESTIMATE_RESERVATION, ESTIMATE_SIMULATION)
    # after the big job, which starts when the second running job ends
    assert late.estimated_start == round(now + 200 + 300)
