"""write_outputs: deterministic files, the Tuning Guide's report layout, the plots."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from rm_replay import generate
from rm_replay.engine import simulate
from rm_replay.metrics import metrics_dict
from rm_replay.model import SimulationResult, load_result
from rm_replay.plots import PLOT_FILES
from rm_replay.report import fmt_duration, load_metrics, render_report, write_outputs

DETERMINISTIC = ("result.json", "metrics.json", "report.txt", *PLOT_FILES)


def _replay(policy: str = "lattice"):
    s = generate.preemption_heavy(seed=3, n_low=30, n_high=40)
    return simulate(
        s.events,
        s.inventory_obj(),
        policy=policy,
        weights_by_vcluster=s.weights_obj(),
        seed=3,
        trace_name=s.name,
    )


@pytest.fixture(scope="module")
def small_result():
    return _replay()


def test_two_writes_are_byte_identical(small_result, tmp_path: Path):
    a = write_outputs(small_result, tmp_path / "a", name="run")
    b = write_outputs(small_result, tmp_path / "b", name="run")
    for f in DETERMINISTIC:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert set(a) == set(b)
    assert {p.name for p in a.values()} == {*DETERMINISTIC, "timing.json"}


def test_two_replays_give_identical_json(small_result, tmp_path: Path):
    """Same inputs and seed, a separate replay: result.json and metrics.json match byte
    for byte (wall-clock figures are only in timing.json and the report's cycle line)."""
    write_outputs(small_result, tmp_path / "a", name="run", plots=False)
    write_outputs(_replay(), tmp_path / "b", name="run", plots=False)
    for f in ("result.json", "metrics.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    ra = (tmp_path / "a" / "report.txt").read_text().splitlines()
    rb = (tmp_path / "b" / "report.txt").read_text().splitlines()
    differ = [x for x, y in zip(ra, rb, strict=True) if x != y]
    assert all("wall clock" in line for line in differ)
    assert b"duration_s" not in (tmp_path / "a" / "result.json").read_bytes()


def test_report_layout(small_result, tmp_path: Path):
    write_outputs(small_result, tmp_path / "fairness-boost")
    text = (tmp_path / "fairness-boost" / "report.txt").read_text()
    lines = text.splitlines()
    assert lines[0] == "=== RM-Replay Results: fairness-boost ==="
    for heading in (
        "Utilization:",
        "Wait Time:",
        "Fairness (Jain's Index):",
        "Tenant Share Deviation:",
        "Backfill:",
        "Preemptions:",
        "Checkpoints:",
        "SLO Compliance (wait <= 1.0 hr):",
        "Ramp-up:",
        "Scheduling Cycles:",
    ):
        assert heading in lines, heading
    assert any(
        line.startswith("  GPU-hours consumed: ") and "available (" in line for line in lines
    )
    for p in (
        "  p50: ",
        "  p95: ",
        "  p99: ",
        "  Max deviation: ",
        "  Backfill jobs: ",
        "  Total: ",
    ):
        assert any(line.startswith(p) for line in lines), p
    assert "latency (wall clock)" in text


def test_outputs_round_trip(small_result, tmp_path: Path):
    write_outputs(small_result, tmp_path / "r")
    again = load_result(tmp_path / "r")
    assert metrics_dict(again) == msgspec.json.decode(
        (tmp_path / "r" / "metrics.json").read_bytes()
    )
    metrics, wall = load_metrics(tmp_path / "r")
    assert metrics["run"]["trace"] == "preemption-heavy"
    assert wall is not None and wall["cycles"] == len(small_result.cycles)
    assert wall["cycle_latency_p99_s"] is not None


def test_pngs_are_valid_and_carry_no_timestamp(small_result, tmp_path: Path):
    paths = write_outputs(small_result, tmp_path / "p")
    for name in PLOT_FILES:
        data = (tmp_path / "p" / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        assert len(data) > 5_000
        assert b"Software" not in data and b"Creation Time" not in data
    assert paths["wait_cdf"].name == "wait_cdf.png"


def test_report_renders_empty_sections():
    m = metrics_dict(_EMPTY)
    text = render_report(m, None, "empty")
    assert "=== RM-Replay Results: empty ===" in text
    assert "never reached" in text


def test_report_of_a_replay_with_a_cancel(tmp_path: Path):
    """A job cancelled in the queue is counted under Wait Time and left out of the SLO;
    result.json, metrics.json and the plots still write and read back."""
    from rm_replay.model import CancelEvent
    from rmr_helpers import T0, inventory, submit

    trace = [
        submit("a", 0, runtime=100),
        submit("b", 1, runtime=100),
        submit("c", 2, runtime=100),
        CancelEvent(t=T0 + 50, id="b"),
    ]
    r = simulate(trace, inventory(1), trace_name="cancels")
    write_outputs(r, tmp_path / "r", name="cancels")
    lines = (tmp_path / "r" / "report.txt").read_text().splitlines()
    assert "Jobs: 3 (cancelled 1, completed 2)" in lines[2]
    assert "  cancelled before start: 1 (left out: withdrawn by the user)" in lines
    assert not any("never started" in line for line in lines)
    slo = lines[lines.index("SLO Compliance (wait <= 1.0 hr):") + 1]
    assert slo == "  100.0% (2 / 2 jobs)"
    again = load_result(tmp_path / "r")
    assert {j.id: j.state for j in again.jobs} == {
        "a": "completed",
        "b": "cancelled",
        "c": "completed",
    }
    assert metrics_dict(again)["jobs"]["cancelled_before_start"] == 1
    # a metrics.json written before the count existed still renders
    old = metrics_dict(again)
    del old["jobs"]["cancelled_before_start"]
    assert "cancelled before start" not in render_report(old, None, "old")


def test_fmt_duration_like_the_guide():
    assert fmt_duration(12 * 60) == "12 min"
    assert fmt_duration(2.1 * 3600) == "2.1 hr"
    assert fmt_duration(0) == "0 s"
    assert fmt_duration(None) == "n/a"
    assert fmt_duration(5 * 86400) == "5.0 days"


_EMPTY = SimulationResult(
    policy="lattice",
    seed=0,
    trace_name="empty",
    inventory_summary={"nodes": 4, "gpus": 0},
    jobs=[],
    samples=[],
    cycles=[],
    makespan=0.0,
    fair_share_targets={},
    sim_config={},
)
