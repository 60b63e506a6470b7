"""Metrics on hand-built results with known values, and Jain's index properties."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rm_replay import metrics as M
from rm_replay.model import CycleStat, JobRecord, SimulationResult, UtilizationSample


def job(jid: str, *, submit: float, start: float | None, end: float | None, nodes: int = 1, **kw):
    fields = {
        "id": jid,
        "tenant": "a",
        "user": "u",
        "vcluster": "hpc-batch",
        "preemption_class": 5,
        "nodes": nodes,
        "gpus_per_node": 4,
        "submit": submit,
        "start": start,
        "end": end,
        "walltime": 86400.0,
        "runtime": (end - start) if start is not None and end is not None else 100.0,
        "state": "completed" if end is not None else "unfinished",
    }
    if start is not None and end is not None and "node_seconds" not in kw:
        kw["node_seconds"] = (end - start) * nodes
        kw["gpu_seconds"] = (end - start) * nodes * fields["gpus_per_node"]
    fields.update(kw)
    return JobRecord(**fields)


def result(jobs, *, nodes: int, gpus_per_node: int = 4, targets=None, cycles=(), samples=None):
    ends = [j.end for j in jobs if j.end is not None]
    t0 = min(j.submit for j in jobs)
    return SimulationResult(
        policy="lattice",
        seed=0,
        trace_name="hand",
        inventory_summary={"nodes": nodes, "gpus": nodes * gpus_per_node},
        jobs=list(jobs),
        samples=list(samples or []),
        cycles=list(cycles),
        makespan=(max(ends) - t0) if ends else 0.0,
        fair_share_targets=dict(targets or {}),
        sim_config={},
        start_time=t0,
        end_time=max(ends) if ends else t0,
    )


def test_utilization_waits_slowdown_known_values():
    # 2 nodes: A (1 node) runs 0-100; B (2 nodes) waits 100 s, runs 100-200
    r = result(
        [
            job("A", submit=0, start=0, end=100),
            job("B", submit=0, start=100, end=200, nodes=2),
        ],
        nodes=2,
    )
    m = M.metrics_dict(r)
    u = m["utilization"]
    assert m["run"]["makespan_s"] == 200.0
    assert u["node_hours_used"] == pytest.approx(300 / 3600, abs=1e-6)
    assert u["node_hours_available"] == pytest.approx(400 / 3600, abs=1e-6)
    assert u["node_utilization"] == 0.75
    assert u["gpu_utilization"] == 0.75
    w = m["wait"]["overall"]
    assert (w["count"], w["p50_s"], w["p95_s"], w["p99_s"], w["max_s"]) == (
        2,
        50.0,
        95.0,
        99.0,
        100.0,
    )
    assert list(m["wait"]["by_class"]) == ["5"]
    # bounded slowdown: A = 1, B = (100 + 100) / 100 = 2
    assert m["slowdown"]["mean"] == 1.5
    assert m["slowdown"]["max"] == 2.0
    assert m["jobs"] == {
        "total": 2,
        "started": 2,
        "never_started": 0,
        "cancelled_before_start": 0,
        "states": {"completed": 2},
    }


def test_slowdown_is_bounded_for_short_jobs():
    # a 1 s job that waited 9 s: (9 + 1) / max(1, 10) = 1.0, not 10
    r = result([job("A", submit=0, start=9, end=10)], nodes=1)
    assert M.metrics_dict(r)["slowdown"]["mean"] == 1.0


def test_wait_per_preemption_class_and_slo():
    jobs = [
        job("lo1", submit=0, start=0, end=10, preemption_class=2),
        job("lo2", submit=0, start=7200, end=7210, preemption_class=2),
        job("hi", submit=0, start=30, end=40, preemption_class=9),
        job("sens", submit=0, start=0, end=10, preemption_class=10, sensitive=True),
    ]
    m = M.metrics_dict(result(jobs, nodes=4), slo_wait_s=60.0)
    assert list(m["wait"]["by_class"]) == ["2", "9", "10"]  # numeric order
    assert m["wait"]["by_class"]["2"]["max_s"] == 7200.0
    assert m["wait"]["by_class"]["9"]["p50_s"] == 30.0
    assert m["slo"] == {"target_wait_s": 60.0, "compliant_jobs": 3, "compliance": 0.75}
    assert m["sensitive"]["jobs"] == 1 and m["sensitive"]["max_s"] == 0.0


def test_never_started_job_is_censored_at_window_end():
    jobs = [
        job("ran", submit=0, start=0, end=1000),
        job("starved", submit=100, start=None, end=None),
    ]
    m = M.metrics_dict(result(jobs, nodes=1))
    assert m["jobs"]["never_started"] == 1
    assert m["wait"]["overall"]["max_s"] == 900.0  # 1000 - 100
    assert m["slo"]["compliant_jobs"] == 1


def test_jobs_cancelled_before_start_are_left_out_of_waits_slo_and_slowdown():
    jobs = [
        job("ran", submit=0, start=0, end=1000),
        job("late", submit=0, start=7200, end=7300, preemption_class=2),
        # withdrawn by the user after a day in the queue: not starvation
        job("gone", submit=0, start=None, end=86400, state="cancelled", sensitive=True),
        job("gone2", submit=50, start=None, end=60, state="cancelled", preemption_class=2),
        job("starved", submit=100, start=None, end=None),
        # cancelled after it started: an ordinary started job, its wait counts
        job("stopped", submit=0, start=30, end=90, state="cancelled"),
    ]
    r = result(jobs, nodes=2)
    r.makespan, r.end_time = 7300.0, 86400.0
    m = M.metrics_dict(r, slo_wait_s=3600.0)
    assert m["jobs"] == {
        "total": 6,
        "started": 3,
        "never_started": 1,
        "cancelled_before_start": 2,
        "states": {"cancelled": 3, "completed": 2, "unfinished": 1},
    }
    w = m["wait"]["overall"]
    # ran 0, stopped 30, late 7200, starved censored at the replay's end (86400 - 100)
    assert (w["count"], w["p50_s"], w["max_s"]) == (4, 3615.0, 86300.0)
    assert m["wait"]["by_class"]["2"]["count"] == 1
    assert m["sensitive"]["jobs"] == 0
    assert m["slo"] == {"target_wait_s": 3600.0, "compliant_jobs": 2, "compliance": 0.5}
    assert m["slowdown"]["count"] == 3  # ran, late, stopped: the finished ones that started
    # every job cancelled before it started: nothing to miss
    only = result([job("g", submit=0, start=None, end=10, state="cancelled")], nodes=1)
    m = M.metrics_dict(only)
    assert m["slo"]["compliance"] == 1.0 and m["wait"]["overall"]["count"] == 0
    assert (m["jobs"]["never_started"], m["jobs"]["cancelled_before_start"]) == (0, 1)


def test_a_job_cancelled_before_start_waited_only_until_its_cancel():
    # 2 nodes: A (1 node) runs 0-1000; W (2 nodes) queued at 0, cancelled at 200. The
    # free node idled while W waited for 200 s, not until the end of the run.
    jobs = [
        job("A", submit=0, start=0, end=1000),
        job("W", submit=0, start=None, end=200, nodes=2, state="cancelled"),
    ]
    m = M.metrics_dict(result(jobs, nodes=2))
    assert m["backfill"]["idle_node_hours_while_pending"] == pytest.approx(200 / 3600, abs=1e-6)
    assert M.job_wait(jobs[1], 1000.0) == (200.0, True)  # its time in the queue (plots)
    assert m["run"]["makespan_s"] == 1000.0


def test_a_cancelled_jobs_fairness_demand_ends_at_its_cancel():
    jobs = [
        job("a1", submit=0, start=0, end=4 * 3600, tenant="a", runtime=4 * 3600.0),
        job("a2", submit=4 * 3600, start=4 * 3600, end=5 * 3600, tenant="a"),
        # b asked for 3 hours but withdrew the job after half an hour in the queue
        job("b1", submit=0, start=None, end=1800, tenant="b", state="cancelled"),
    ]
    jobs[2] = msgspec.structs.replace(jobs[2], runtime=3 * 3600.0)
    f = M.fairness(result(jobs, nodes=1, targets={"a": 0.5, "b": 0.5}))
    assert f["tenants"]["b"]["demand_node_hours"] == 0.5
    assert f["tenants"]["b"]["fair_share"] == pytest.approx(0.5 / 4)


def test_backfill_effectiveness_known_value():
    # 2 nodes. A (1 node) 0-200; C (2 nodes) waits for A, runs 200-300;
    # B (1 node, backfilled) fills the other node 0-100, then it idles 100-200 while C waits.
    jobs = [
        job("A", submit=0, start=0, end=200),
        job("B", submit=0, start=0, end=100, backfilled=True),
        job("C", submit=0, start=200, end=300, nodes=2),
    ]
    m = M.metrics_dict(result(jobs, nodes=2))
    bf = m["backfill"]
    assert bf["jobs"] == 1
    assert bf["node_hours"] == pytest.approx(100 / 3600, abs=1e-6)
    assert bf["idle_node_hours_while_pending"] == pytest.approx(100 / 3600, abs=1e-6)
    assert bf["effectiveness"] == 0.5


def test_preemption_checkpoint_and_intervals_of_a_requeued_job():
    # preempted at 100 (60 s checkpoint, 160 node-s held), requeued, ran again 300-500
    j = job(
        "V",
        submit=0,
        start=0,
        end=500,
        nodes=1,
        last_start=300.0,
        node_seconds=160.0 + 200.0,
        gpu_seconds=4 * 360.0,
        preempted_count=1,
        checkpoints_attempted=1,
        checkpoints_succeeded=1,
    )
    k = job("K", submit=0, start=0, end=3600, checkpoints_attempted=3, checkpoints_succeeded=2)
    assert M.job_intervals(j, 3600) == [(0.0, 160.0), (300.0, 500.0)]
    m = M.metrics_dict(result([j, k], nodes=2))
    assert m["preemption"] == {"total": 1, "jobs_preempted": 1, "per_hour": 1.0}
    assert m["checkpoint"] == {
        "attempted": 4,
        "succeeded": 3,
        "success_rate": 0.75,
        "lost_node_hours": 0.0,
    }
    assert m["utilization"]["node_hours_used"] == pytest.approx((360 + 3600) / 3600, abs=1e-6)


def test_no_checkpoints_gives_no_rate():
    m = M.metrics_dict(result([job("A", submit=0, start=0, end=10)], nodes=1))
    assert m["checkpoint"]["success_rate"] is None


def test_ramp_up_time_to_80_percent():
    jobs = [
        job("a", submit=0, start=0, end=1000, nodes=4),
        job("b", submit=0, start=50, end=1000, nodes=3),
        job("c", submit=0, start=120, end=1000, nodes=1),  # 8 of 10 busy at t=120
    ]
    m = M.metrics_dict(result(jobs, nodes=10))
    assert m["ramp_up"] == {"target_utilization": 0.8, "ramp_up_s": 120.0}
    never = M.metrics_dict(result(jobs[:1], nodes=10))
    assert never["ramp_up"]["ramp_up_s"] is None


def test_fairness_against_targets_when_every_tenant_is_backlogged():
    # equal targets; tenant a used 3 node-hours, b 1, inside the submission window
    jobs = [
        job("a1", submit=0, start=0, end=3 * 3600, tenant="a", runtime=3 * 3600.0),
        job("b1", submit=0, start=0, end=3600, tenant="b", runtime=3 * 3600.0, state="failed"),
        job("b2", submit=3 * 3600, start=3 * 3600, end=4 * 3600, tenant="b"),
    ]
    r = result(jobs, nodes=2, targets={"a": 0.5, "b": 0.5})
    f = M.metrics_dict(r)["fairness"]
    assert f["window_start_s"] == 0.0 and f["window_end_s"] == 3 * 3600
    assert f["tenants"]["a"]["share"] == 0.75
    assert f["tenants"]["b"]["share"] == 0.25
    assert f["tenants"]["a"]["fair_share"] == 0.5  # b asked for more than half
    assert f["max_share_deviation"] == 0.25
    assert f["max_target_deviation"] == 0.25
    assert f["jain_index"] == 0.8  # x = (1.5, 0.5): 4 / (2 * 2.5)


def test_fairness_does_not_blame_capacity_a_tenant_did_not_ask_for():
    # b only asks for 1 node-hour of the 4 used; a may take the rest
    jobs = [
        job("a1", submit=0, start=0, end=3 * 3600, tenant="a", runtime=3 * 3600.0),
        job("b1", submit=0, start=0, end=3600, tenant="b", runtime=3600.0),
        job("a2", submit=3 * 3600, start=3 * 3600, end=4 * 3600, tenant="a"),
    ]
    f = M.fairness(result(jobs, nodes=2, targets={"a": 0.5, "b": 0.5}))
    assert f["tenants"]["b"]["fair_share"] == 0.25
    assert f["max_share_deviation"] == 0.0
    assert f["jain_index"] == 1.0
    assert f["max_target_deviation"] == 0.25


def test_fairness_counts_only_the_demand_that_fits_in_the_window():
    # b submits a 6-hour job one hour before the window closes: only that hour could have
    # been owed to it, so a (which kept both nodes busy until then) is not over its share
    jobs = [
        job("a1", submit=0, start=0, end=4 * 3600, nodes=2, tenant="a", runtime=4 * 3600.0),
        job("a2", submit=4 * 3600, start=4 * 3600, end=5 * 3600, tenant="a"),
        job("b1", submit=4 * 3600, start=4 * 3600, end=10 * 3600, tenant="b", runtime=6 * 3600.0),
    ]
    f = M.fairness(result(jobs, nodes=2, targets={"a": 0.5, "b": 0.5}))
    assert f["window_end_s"] == 4 * 3600  # the last submission
    assert f["tenants"]["b"]["demand_node_hours"] == 0.0  # submitted at the window's end
    assert f["tenants"]["a"]["share"] == 1.0 and f["max_share_deviation"] == 0.0
    jobs[2] = job("b1", submit=3 * 3600, start=4 * 3600, end=10 * 3600, tenant="b")
    jobs[2] = msgspec.structs.replace(jobs[2], runtime=6 * 3600.0)
    f = M.fairness(result(jobs, nodes=2, targets={"a": 0.5, "b": 0.5}))
    assert f["tenants"]["b"]["demand_node_hours"] == 1.0  # 3 h -> 4 h, not 6 hours
    assert f["tenants"]["b"]["fair_share"] == pytest.approx(1 / 8)  # of 8 node-hours used


def test_entitlements_water_filling():
    assert M.entitlements({"a": 1, "b": 1}, {"a": 10, "b": 10}, 10) == {"a": 5, "b": 5}
    got = M.entitlements({"a": 1, "b": 1, "c": 2}, {"a": 1, "b": 10, "c": 10}, 10)
    assert got["a"] == 1
    assert got["b"] == pytest.approx(3)
    assert got["c"] == pytest.approx(6)
    # total demand below capacity: everyone gets its demand
    assert M.entitlements({"a": 1, "b": 3}, {"a": 2, "b": 1}, 10) == {"a": 2, "b": 1}


def test_metrics_dict_is_deterministic_and_json_ready():
    jobs = [
        job(f"j{i}", submit=i * 7.0, start=i * 9.0, end=i * 9.0 + 50, nodes=1 + i % 3)
        for i in range(20)
    ]
    r = result(
        jobs,
        nodes=8,
        targets={"a": 1.0},
        cycles=[CycleStat(t=float(i), pending=3, placed=1, duration_s=0.001 * i) for i in range(5)],
        samples=[
            UtilizationSample(
                t=0.0,
                busy_nodes=0,
                busy_gpus=0,
                total_nodes=8,
                total_gpus=32,
                per_tenant_busy_nodes={},
            )
        ],
    )
    a = msgspec.json.encode(M.metrics_dict(r))
    b = msgspec.json.encode(
        M.metrics_dict(msgspec.json.decode(msgspec.json.encode(r), type=SimulationResult))
    )
    assert a == b
    assert b"duration" not in a  # wall clock stays out
    assert M.wall_metrics(r)["cycle_latency_p50_s"] == 0.002


# -- Jain's index and percentiles ------------------------------------------------------

shares = st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(shares)
def test_jain_index_in_unit_interval(xs):
    j = M.jain_index(xs)
    assert 0.0 < j <= 1.0
    if any(x > 0 for x in xs):
        assert j >= 1.0 / len(xs) - 1e-9


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=1e-6, max_value=1e6), st.integers(min_value=1, max_value=50))
def test_jain_index_is_one_for_equal_shares(x, n):
    assert M.jain_index([x] * n) == pytest.approx(1.0)


@settings(max_examples=100, deadline=None)
@given(shares, st.floats(min_value=1e-3, max_value=1e3))
def test_jain_index_is_scale_invariant(xs, k):
    assert M.jain_index([k * x for x in xs]) == pytest.approx(M.jain_index(xs), rel=1e-9, abs=1e-12)


def test_jain_index_extremes():
    assert M.jain_index([1, 0, 0, 0]) == 0.25
    assert M.jain_index([]) == 1.0
    with pytest.raises(ValueError):
        M.jain_index([1, -1])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(min_value=0, max_value=1e7, allow_nan=False), min_size=1, max_size=60),
    st.sampled_from([0, 1, 50, 95, 99, 100]),
)
def test_percentile_matches_numpy_linear(xs, q):
    assert M.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)


def test_rnd():
    assert M.rnd(None) is None
    assert M.rnd(math.nan) is None
    assert M.rnd(-0.0000001) == 0.0
    assert math.copysign(1.0, M.rnd(-0.0000001)) == 1.0
