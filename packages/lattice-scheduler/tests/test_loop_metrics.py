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
