"""The threshold alert engine (lattice_agent.telemetry.alerts) as pure functions: the
specification's four default rules on examples, and hypothesis properties of ``step``
over arbitrary reading sequences against an independent model (fires exactly once per
run of violating readings that lasts ``for_seconds``, resolves at the first reading that
does not violate, never on missing or NaN values, inputs never mutated)."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lattice_agent.telemetry.alerts import (
    DEFAULT_RULES,
    FIRING,
    RESOLVED,
    AlertRule,
    RuleState,
    active,
    derived,
    rules_from_config,
    step,
)
from lattice_common.config import TelemetryConfig, load_config


def run(rules, readings):
    """Feed ``[(at, values)]`` through ``step``; (final state, [(index, event)])."""
    state: dict[str, RuleState] = {}
    events = []
    for i, (at, values) in enumerate(readings):
        state, evs = step(rules, state, values, at)
        events += [(i, e) for e in evs]
    return state, events


def rule(name: str) -> AlertRule:
    return next(r for r in DEFAULT_RULES if r.name == name)


# --- the specification's rules --------------------------------------------------------


def test_defaults_are_the_specifications_four_rules() -> None:
    got = {(r.name, r.metric, r.comparison, r.threshold, r.for_seconds) for r in DEFAULT_RULES}
    assert got == {
        ("gpu_idle", "gpu_utilization", "<", 10, 60),  # < 10 % for > 60 s: potential hang
        ("gpu_memory_high", "gpu_memory_utilization", ">", 95, 0),  # > 95 %: OOM risk
        ("network_errors", "network_error_rate", ">", 0.1, 0),  # > 0.1 % of packets
        ("io_latency", "io_latency_p99", ">", 10_000, 0),  # > 10 ms, in microseconds
    }
    assert rules_from_config(TelemetryConfig().alert_rules) == list(DEFAULT_RULES)


def test_gpu_idle_fires_after_60_seconds_and_resolves_when_busy() -> None:
    readings = [(1000.0 + t, {"gpu_utilization": 3.0}) for t in range(62)]
    readings.append((1062.0, {"gpu_utilization": 80.0}))
    state, events = run([rule("gpu_idle")], readings)
    assert [(i, e.state) for i, e in events] == [(60, FIRING), (62, RESOLVED)]
    fired = events[0][1]
    assert (fired.since, fired.at, fired.value, fired.threshold) == (1000.0, 1060.0, 3.0, 10)
    assert "potential hang" in fired.message and fired.severity == "warning"
    assert events[1][1].value == 80.0 and state == {}


def test_gpu_idle_restarts_its_clock_after_a_busy_second() -> None:
    busy_at = {30}
    readings = [
        (float(t), {"gpu_utilization": 50.0 if t in busy_at else 1.0}) for t in range(0, 95)
    ]
    _, events = run([rule("gpu_idle")], readings)
    assert [(i, e.state, e.since) for i, e in events] == [(91, FIRING, 31.0)]


def test_instant_rules_fire_at_the_first_reading_over_their_threshold() -> None:
    values = {
        "gpu_memory_used": 97e9,
        "gpu_memory_total": 100e9,  # derived: 97 %
        "network_error_rate": 0.2,
        "io_latency_p99": 10_001.0,
    }
    _, events = run(DEFAULT_RULES, [(5.0, values)])
    assert sorted(e.rule for _, e in events) == ["gpu_memory_high", "io_latency", "network_errors"]
    assert all(e.at == e.since == 5.0 and e.state == FIRING for _, e in events)
    mem = next(e for _, e in events if e.rule == "gpu_memory_high")
    assert mem.value == pytest.approx(97.0) and mem.severity == "critical"
    # at the threshold is not over it
    calm = {"gpu_memory_utilization": 95.0, "network_error_rate": 0.1, "io_latency_p99": 10_000}
    assert run(DEFAULT_RULES, [(5.0, calm)])[1] == []


def test_no_gpu_never_raises_a_gpu_alert() -> None:
    readings = [(float(t), {"cpu_utilization": 0.0, "memory_used": 1e6}) for t in range(200)]
    assert run(DEFAULT_RULES, readings)[1] == []


def test_derived_ratios() -> None:
    assert derived({"gpu_memory_used": 50.0, "gpu_memory_total": 200.0})[
        "gpu_memory_utilization"
    ] == pytest.approx(25.0)
    assert derived({"network_errors": 2.0, "network_packets": 1000.0})[
        "network_error_rate"
    ] == pytest.approx(0.2)
    # a reported ratio wins; a zero total derives nothing
    assert (
        derived({"gpu_memory_utilization": 3.0, "gpu_memory_used": 9.0, "gpu_memory_total": 10.0})[
            "gpu_memory_utilization"
        ]
        == 3.0
    )
    assert "gpu_memory_utilization" not in derived({"gpu_memory_used": 1.0, "gpu_memory_total": 0})


def test_rules_are_configurable_through_the_environment() -> None:
    env = {
        "LATTICE_TELEMETRY__ALERT_RULES": '[{"name": "cpu_idle", "metric": "cpu_utilization",'
        ' "comparison": "<", "threshold": 10, "for_seconds": 3}]'
    }
    rules = rules_from_config(load_config(None, env=env).telemetry.alert_rules)
    assert rules == [AlertRule("cpu_idle", "cpu_utilization", "<", 10.0, 3.0)]
    assert rules[0].text == "cpu_utilization below 10 for 3 s"
    _, events = run(rules, [(float(t), {"cpu_utilization": 0.5}) for t in range(5)])
    assert [(i, e.state) for i, e in events] == [(3, FIRING)]


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError):
        AlertRule("x", "m", ">=", 1.0)
    with pytest.raises(ValueError):
        AlertRule("x", "m", ">", math.nan)
    with pytest.raises(ValueError):
        AlertRule("x", "m", ">", 1.0, -1.0)
    from lattice_common.errors import ValidationError

    twice = '[{"name": "a", "metric": "m", "comparison": ">", "threshold": 1}]'
    with pytest.raises(ValidationError, match="named 'a'"):
        load_config(None, env={"LATTICE_TELEMETRY__ALERT_RULES": twice[:-1] + ", " + twice[1:]})
    with pytest.raises(ValidationError, match="comparison"):
        load_config(
            None,
            env={
                "LATTICE_TELEMETRY__ALERT_RULES": '[{"name": "a", "metric": "m",'
                ' "comparison": "=", "threshold": 1}]'
            },
        )


# --- properties -----------------------------------------------------------------------

values = st.one_of(
    st.none(),  # the metric is absent from this collection
    st.just(math.nan),
    st.floats(min_value=-10, max_value=30, allow_nan=False),
    st.sampled_from([9.999, 10.0, 10.001]),
)
gaps = st.floats(min_value=0.05, max_value=3.0, allow_nan=False)
rules_st = st.builds(
    AlertRule,
    name=st.just("r"),
    metric=st.just("m"),
    comparison=st.sampled_from(["<", ">"]),
    threshold=st.just(10.0),
    for_seconds=st.sampled_from([0.0, 0.5, 1.0, 2.5, 6.0]),
)


def model(r: AlertRule, readings):
    """An independent statement of the rule: [(index, state)] of the events."""
    out = []
    run_start = None
    fired = False
    for i, (at, vals) in enumerate(readings):
        v = vals.get("m")
        ok = v is not None and not math.isnan(v) and (v < 10 if r.comparison == "<" else v > 10)
        if ok:
            if run_start is None:
                run_start = at
            if not fired and at - run_start >= r.for_seconds:
                fired = True
                out.append((i, FIRING))
        else:
            if fired:
                out.append((i, RESOLVED))
            run_start, fired = None, False
    return out


@st.composite
def sequences(draw):
    n = draw(st.integers(min_value=0, max_value=60))
    at, out = 1000.0, []
    for _ in range(n):
        at += draw(gaps)
        v = draw(values)
        out.append((at, {} if v is None else {"m": v}))
    return out


@settings(max_examples=300, deadline=None)
@given(rules_st, sequences())
def test_step_matches_the_model(r: AlertRule, readings) -> None:
    state, events = run([r], readings)
    assert [(i, e.state) for i, e in events] == model(r, readings)
    # firing and resolved alternate, starting with firing
    states = [e.state for _, e in events]
    assert states[::2] == [FIRING] * len(states[::2])
    assert states[1::2] == [RESOLVED] * len(states[1::2])
    for i, e in events:
        assert e.at == readings[i][0]
        if e.state == FIRING:
            # it held on every reading from `since` to now, for long enough
            assert e.at - e.since >= r.for_seconds
            held = [j for j, (at, _) in enumerate(readings) if e.since <= at <= e.at]
            assert all(r.holds(readings[j][1].get("m")) for j in held)
    # what is firing at the end is what active() says
    firing_now = bool(states) and states[-1] == FIRING
    assert [a.rule for a in active([r], state)] == (["r"] if firing_now else [])


@settings(max_examples=200, deadline=None)
@given(st.lists(rules_st, min_size=1, max_size=3), sequences())
def test_step_is_pure(rs, readings) -> None:
    rs = [
        AlertRule(
            f"r{i}",
            **{k: getattr(r, k) for k in ("metric", "comparison", "threshold", "for_seconds")},
        )
        for i, r in enumerate(rs)
    ]
    state: dict[str, RuleState] = {}
    for at, vals in readings:
        before_state, before_vals = copy.deepcopy(state), copy.deepcopy(vals)
        new, events = step(rs, state, vals, at)
        assert state == before_state and vals == before_vals  # inputs untouched
        assert step(rs, state, vals, at) == (new, events)  # deterministic
        # rules are independent: each alone gives its own events
        for r in rs:
            alone = step([r], {r.name: state[r.name]} if r.name in state else {}, vals, at)[1]
            assert alone == [e for e in events if e.rule == r.name]
        state = new


@settings(max_examples=100, deadline=None)
@given(sequences())
def test_missing_or_nan_values_never_fire(readings) -> None:
    r = AlertRule("r", "other", "<", 10.0)  # a metric no reading has
    assert run([r], readings)[1] == []
