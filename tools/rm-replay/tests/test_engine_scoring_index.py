"""The engine's scoring index (``cost.ScoringIndex``) must give ``cost.build_context``
exactly the context a scan of the mirror gives, at every decision of a replay:
queued and running GPU-hours float for float, nodes held per tenant, free groups."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from lattice_scheduler import cost
from rm_replay.engine import simulate
from rm_replay.generate import SCENARIOS, synthetic


def _replay_checking_contexts(scenario: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    real = cost.build_context
    checked = 0

    def build_context(state: Any, now: float, **kw: Any) -> cost.ScoringContext:
        nonlocal checked
        got = real(state, now, **kw)
        assert getattr(state, "scoring_index", None) is not None
        plain = SimpleNamespace(
            allocations=state.allocations,
            nodes=state.nodes,
            tenants=state.tenants,
            pending=state.pending,
            holding=state.holding,
        )
        want = real(plain, now, **kw)
        assert got == want
        # == on floats: also bit for bit (no NaN here); the sums are order-sensitive
        assert got.queued_gpu_hours.hex() == want.queued_gpu_hours.hex()
        assert got.running_gpu_hours.hex() == want.running_gpu_hours.hex()
        checked += 1
        return got

    monkeypatch.setattr(cost, "build_context", build_context)
    simulate(
        scenario.events,
        scenario.inventory_obj(),
        weights_by_vcluster=scenario.weights_obj(),
        seed=scenario.seed,
        max_time=min(e.t for e in scenario.events) + 2 * 86400,
    )
    return checked


@pytest.mark.parametrize("name", ["preemption-heavy", "sensitive-claim"])
def test_index_matches_a_scan_in_every_decision(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _replay_checking_contexts(SCENARIOS[name](0), monkeypatch) > 100


def test_index_matches_a_scan_on_a_multi_group_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _replay_checking_contexts(synthetic(400, 300, 1), monkeypatch) > 100
