"""Telemetry aggregation, pure: percentiles and summaries (hypothesis), aligned windows,
raw samples, and per-allocation modes with auto-revert."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lattice_agent.telemetry.aggregate import (
    Windows,
    percentile,
    raw_samples,
    summarize,
    window_start,
)
from lattice_agent.telemetry.loop import ModeTable
from lattice_agent.telemetry.samples import AGGS, AllocLabels, Reading

values = st.lists(
    st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=300,
)

L = AllocLabels("a1", "node-001", "physics", "alice", "hpc")


@given(values)
def test_summary_is_ordered_and_bounded(vs: list[float]) -> None:
    s = summarize(vs)
    assert set(s) == set(AGGS)
    assert min(vs) <= s["p50"] <= s["p95"] <= s["p99"] <= s["max"] == max(vs)
    assert min(vs) <= s["mean"] <= max(vs)
    assert s["count"] == len(vs)
    assert math.isclose(s["mean"], math.fsum(vs) / len(vs), rel_tol=1e-9, abs_tol=1e-3)


@given(values, st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_monotone(vs: list[float], q1: float, q2: float) -> None:
    ordered = sorted(vs)
    lo, hi = sorted((q1, q2))
    assert percentile(ordered, lo) <= percentile(ordered, hi)
    assert percentile(ordered, 0) == ordered[0]
    assert percentile(ordered, 100) == ordered[-1]


def test_percentile_examples() -> None:
    vs = [float(v) for v in range(1, 101)]  # 1..100
    s = summarize(vs)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p95"] == pytest.approx(95.05)
    assert s["p99"] == pytest.approx(99.01)
    assert (s["max"], s["count"], s["mean"]) == (100.0, 100.0, 50.5)
    assert summarize([7.0]) == {
        "mean": 7.0,
        "p50": 7.0,
        "p95": 7.0,
        "p99": 7.0,
        "max": 7.0,
        "count": 1.0,
    }
    with pytest.raises(ValueError):
        summarize([])


def test_windows_are_aligned_and_close_after_their_end() -> None:
    w = Windows(30)
    assert window_start(1000.0, 30) == 990.0
    for i in range(10):  # 995..1004: two windows, [990, 1020) only
        w.add(Reading(L, 995.0 + i, {"cpu_utilization": 100.0 + i, "memory_used": 5.0}))
    w.add(Reading(L, 1021.0, {"cpu_utilization": 1.0}))  # the next window [1020, 1050)
    assert w.pending() == 2
    assert w.close(1020.5, lag=1.0) == []  # not a second past its end yet
    out = w.close(1021.0, lag=1.0)
    assert w.pending() == 1
    assert {s.timestamp_ms for s in out} == {1_020_000}
    by = {(s.name, dict(s.labels)["agg"]): s.value for s in out}
    assert by[("cpu_utilization", "mean")] == pytest.approx(104.5)
    assert by[("cpu_utilization", "max")] == 109.0
    assert by[("cpu_utilization", "count")] == 10
    assert by[("memory_used", "p99")] == 5.0
    assert len(out) == 2 * len(AGGS)
    labels = dict(out[0].labels)
    assert labels == {
        "agg": labels["agg"],
        "alloc_id": "a1",
        "node_id": "node-001",
        "tenant": "physics",
        "user": "alice",
        "vcluster": "hpc",
    }
    rest = w.close(2000.0)
    assert {s.timestamp_ms for s in rest} == {1_050_000}
    assert w.pending() == 0


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(0, 600), st.floats(0, 1000)),
        max_size=200,
    ),
    st.sampled_from([1.0, 2.0, 30.0]),
)
def test_windows_count_every_reading_once(
    readings: list[tuple[str, float, float]], window: float
) -> None:
    w = Windows(window)
    for aid, at, v in readings:
        w.add(Reading(AllocLabels(aid, "n"), at, {"cpu_utilization": v}))
    out = w.close(10_000.0)
    counts = [s.value for s in out if dict(s.labels)["agg"] == "count"]
    assert sum(counts) == len(readings)
    for s in out:  # stamped with the end of an aligned window
        assert (s.timestamp_ms / 1000.0 / window) == pytest.approx(
            round(s.timestamp_ms / 1000.0 / window)
        )


def test_raw_samples_one_per_value_at_collection_time() -> None:
    out = raw_samples(
        Reading(L, 1234.5678, {"memory_used": 1e9, "cpu_utilization": 42.0, "x": math.nan})
    )
    assert [(s.name, s.value, s.timestamp_ms) for s in out] == [
        ("cpu_utilization", 42.0, 1_234_568),
        ("memory_used", 1e9, 1_234_568),
    ]
    assert dict(out[0].labels)["agg"] == "raw"


def test_modes_switch_and_revert() -> None:
    m = ModeTable("prod", debug_seconds=1800)
    assert m.get("a", 0) == "prod"
    assert m.set("a", "debug", 60, now=100) == 160
    assert m.get("a", 159.9) == "debug"
    assert m.get("a", 160) == "prod"  # auto-revert
    assert m.until("a") is None
    assert m.set("b", "debug", None, now=0) == 1800  # the default duration
    assert m.set("b", "prod", None, now=10) is None
    assert m.get("b", 11) == "prod"
    assert m.set("c", "audit", None, now=0) is None  # until changed
    assert m.get("c", 1e9) == "audit"
    with pytest.raises(ValueError):
        m.set("a", "verbose", 10, now=0)
    with pytest.raises(ValueError):
        m.set("a", "debug", 0, now=0)
    m.set("d", "debug", 5, now=0)
    m.expire(5)
    assert m.until("d") is None
    node_debug = ModeTable("debug")
    assert node_debug.get("any", 0) == "debug"
    with pytest.raises(ValueError):
        ModeTable("loud")
