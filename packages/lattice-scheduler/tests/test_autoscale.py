"""The autoscaling decision (lattice_scheduler.autoscale): properties with hypothesis and
the cases a user of a reactive allocation would check."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_common.types import SCALE_DOWN, SCALE_HOLD, SCALE_UP, ScalingSpec
from lattice_scheduler import autoscale
from lattice_scheduler.autoscale import Sample, ScalingState, decide

NOW = 10_000.0

specs = st.builds(
    ScalingSpec,
    metric=st.sampled_from(["cpu_utilization", "gpu_utilization", 'q{job="x"}']),
    target=st.floats(0.1, 10.0),
    evaluation_interval=st.floats(1.0, 120.0),
    scale_up_window=st.floats(0.0, 600.0),
    scale_down_window=st.floats(0.0, 600.0),
    scale_down_threshold=st.floats(0.05, 0.95),
    cooldown=st.floats(0.0, 600.0),
)


@st.composite
def states(draw: st.DrawFn) -> ScalingState:
    n = draw(st.integers(0, 25))
    gaps = draw(st.lists(st.floats(0.5, 120.0), min_size=n, max_size=n))
    values = draw(st.lists(st.one_of(st.none(), st.floats(0.0, 20.0)), min_size=n, max_size=n))
    t = NOW - draw(st.floats(0.0, 300.0))
    samples = []
    for gap, v in zip(reversed(gaps), reversed(values), strict=True):
        samples.append(Sample(t, v))
        t -= gap
    samples.reverse()
    lo = draw(st.integers(1, 6))
    hi = draw(st.integers(lo + 1, 12))
    quota = draw(
        st.one_of(st.none(), st.tuples(st.just("physics"), st.integers(0, 20), st.integers(0, 20)))
    )
    return ScalingState(
        samples=tuple(samples),
        current=draw(st.integers(lo, hi)),
        min_nodes=lo,
        max_nodes=hi,
        last_event_at=draw(st.one_of(st.none(), st.floats(NOW - 2000, NOW))),
        rejections=draw(st.integers(0, 5)),
        last_rejection_at=draw(st.one_of(st.none(), st.floats(NOW - 3000, NOW))),
        quota=quota,
        free_nodes=draw(st.integers(0, 2)),
    )


def usable(state: ScalingState, spec: ScalingSpec) -> list[Sample]:
    since = state.last_event_at if state.last_event_at is not None else -math.inf
    return [s for s in state.samples if since < s.at <= NOW]


@settings(max_examples=400)
@given(states(), specs)
def test_never_beyond_bounds_or_quota(state: ScalingState, spec: ScalingSpec) -> None:
    d = decide(state, spec, NOW)
    if d.action == SCALE_UP:
        assert state.current < state.max_nodes
        assert state.quota is None or state.quota[1] < state.quota[2]
        assert state.free_nodes >= 1
    if d.action == SCALE_DOWN:
        assert state.current > state.min_nodes


@settings(max_examples=400)
@given(states(), specs)
def test_never_inside_cooldown_or_backoff(state: ScalingState, spec: ScalingSpec) -> None:
    d = decide(state, spec, NOW)
    if d.action != SCALE_HOLD:
        assert state.last_event_at is None or state.last_event_at + spec.cooldown <= NOW
        assert not (
            state.rejections >= autoscale.MAX_REJECTIONS
            and state.last_rejection_at is not None
            and state.last_rejection_at + autoscale.BACKOFF_COOLDOWNS * spec.cooldown > NOW
        )


@settings(max_examples=400)
@given(states(), specs)
def test_never_scales_without_a_metric(state: ScalingState, spec: ScalingSpec) -> None:
    d = decide(state, spec, NOW)
    samples = usable(state, spec)
    if d.action != SCALE_HOLD:
        newest = samples[-1]
        assert newest.value is not None
        assert NOW - newest.at <= autoscale.STALE_INTERVALS * spec.evaluation_interval
    if not samples or samples[-1].value is None:
        assert d.action == SCALE_HOLD and d.blocked


@settings(max_examples=400)
@given(states(), specs)
def test_scales_only_on_a_whole_window_of_evidence(state: ScalingState, spec: ScalingSpec) -> None:
    d = decide(state, spec, NOW)
    samples = usable(state, spec)
    if d.action in (SCALE_UP, SCALE_DOWN):
        low = spec.target * spec.scale_down_threshold
        up = d.action == SCALE_UP
        window = spec.scale_up_window if up else spec.scale_down_window
        newest = samples[-1].at
        # a sample at least a window old from which every sample meets the threshold
        start = max(s.at for s in samples if s.at <= newest - window)
        for s in samples:
            if s.at >= start:
                assert s.value is not None
                assert s.value >= spec.target if up else s.value <= low


@settings(max_examples=400)
@given(states(), specs, st.floats(0.0, 10.0))
def test_monotone_in_the_metric(state: ScalingState, spec: ScalingSpec, delta: float) -> None:
    """A higher metric never leads to a smaller decision (down < hold < up)."""
    higher = ScalingState(
        **{
            **state.__dict__,
            "samples": tuple(
                Sample(s.at, None if s.value is None else s.value + delta) for s in state.samples
            ),
        }
    )
    before, after = decide(state, spec, NOW), decide(higher, spec, NOW)
    assert autoscale.ORDER[after.action] >= autoscale.ORDER[before.action]


# --- cases ---------------------------------------------------------------------------

SPEC = ScalingSpec(
    metric="cpu_utilization",
    target=0.8,
    evaluation_interval=60,
    scale_up_window=120,
    scale_down_window=300,
    scale_down_threshold=0.25,
    cooldown=300,
)


def run(values: list[float | None], *, every: float = 60.0, **kw: object) -> autoscale.Decision:
    samples = tuple(Sample(NOW - every * (len(values) - 1 - i), v) for i, v in enumerate(values))
    base: dict[str, object] = {"current": 2, "min_nodes": 2, "max_nodes": 4}
    base.update(kw)
    return decide(ScalingState(samples=samples, **base), SPEC, NOW)  # type: ignore[arg-type]


def test_up_after_the_window_with_the_figures_in_the_reason() -> None:
    assert run([0.9, 0.95]).action == SCALE_HOLD  # 60 s of 120
    d = run([0.5, 0.9, 0.92, 0.91])
    assert d.action == SCALE_UP
    assert d.reason == "cpu_utilization 0.91 >= 0.80 for 120 s"


def test_a_dip_restarts_the_window() -> None:
    assert run([0.9, 0.9, 0.7, 0.9, 0.9]).action == SCALE_HOLD


def test_down_needs_the_longer_window_and_stops_at_min() -> None:
    assert run([0.1] * 5, current=3).action == SCALE_HOLD  # 240 s of 300
    d = run([0.1] * 6, current=3)
    assert d.action == SCALE_DOWN
    assert d.reason == "cpu_utilization 0.10 <= 0.20 (0.25 of target 0.8) for 300 s"
    assert run([0.1] * 6, current=2).action == SCALE_HOLD


def test_quota_blocks_without_error_and_says_why() -> None:
    d = run([0.9] * 3, current=3, quota=("physics", 3, 3))
    assert (d.action, d.blocked) == (SCALE_HOLD, "tenant physics holds 3 of max_nodes 3")
    assert run([0.9] * 3, current=3, quota=("physics", 3, 4)).action == SCALE_UP


def test_max_nodes_and_no_free_node() -> None:
    assert run([0.9] * 3, current=4).blocked == "at max_nodes 4"
    assert run([0.9] * 3, free_nodes=0).blocked == "no free node to add"


def test_cooldown_after_an_event() -> None:
    d = run([0.9] * 8, last_event_at=NOW - 200)
    assert d.action == SCALE_HOLD and d.reason.startswith("cooldown")
    # after the cooldown only samples since the event count: 240 s of evidence
    assert run([0.9] * 8, last_event_at=NOW - 301).action == SCALE_UP


def test_no_metric_is_no_action() -> None:
    d = run([0.9, 0.9, None])
    assert d.action == SCALE_HOLD
    assert d.blocked == "no value of cpu_utilization for this allocation"
    assert run([]).action == SCALE_HOLD
    # a metric that stopped arriving is stale
    stale = ScalingState(
        samples=(Sample(NOW - 400, 0.9), Sample(NOW - 300, 0.9)),
        current=2,
        min_nodes=2,
        max_nodes=4,
    )
    assert decide(stale, SPEC, NOW).action == SCALE_HOLD


def test_backoff_after_three_rejections() -> None:
    d = run([0.9] * 3, rejections=3, last_rejection_at=NOW - 100)
    assert d.action == SCALE_HOLD and "rejected" in d.blocked
    assert run([0.9] * 3, rejections=3, last_rejection_at=NOW - 601).action == SCALE_UP
    assert run([0.9] * 3, rejections=2, last_rejection_at=NOW - 1).action == SCALE_UP


def test_utilization_turns_the_agents_percent_into_fractions() -> None:
    # 2 busy cores of a 2-core node, an idle node: mean 0.5
    assert autoscale.utilization("cpu_utilization", {"a": 200.0, "b": 0.0}, {"a": 2, "b": 2}) == 0.5
    assert autoscale.utilization("gpu_utilization", {"a": 90.0, "b": 70.0}, {}) == 0.8
    assert autoscale.utilization('q{job="x"}', {"a": 100.0, "b": 50.0}, {}) == 75.0
    assert autoscale.utilization("cpu_utilization", {}, {}) is None


def test_queries_are_scoped_and_quoted() -> None:
    expr, scope = autoscale.metric_query("cpu_utilization", "a1", ["n1", "n2"], 10)
    assert scope == {"alloc_id": "a1"}
    assert expr == (
        'avg by (node_id) (last_over_time({__name__="cpu_utilization", agg="mean", '
        'node_id=~"n1|n2"}[60s]))'
    )
    expr, scope = autoscale.metric_query('q{job="x\\"} or vector(1)"}', "a1", ["n.1"], 120)
    assert scope == {}
    assert expr == (
        'avg by (node_id) (last_over_time({__name__="q", job="x\\"} or vector(1)", '
        'node_id=~"n\\\\.1"}[120s]))'
    )
    with pytest.raises(ValueError):
        autoscale.metric_query("rate(x[5m])", "a1", ["n1"], 60)
