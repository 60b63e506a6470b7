"""The A/B comparison: arrows, percentage changes, which direction is better."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rm_replay import compare, generate
from rm_replay.compare import HIGHER, LOWER, change, compare_dirs
from rm_replay.engine import simulate
from rm_replay.report import write_outputs


@pytest.fixture(scope="module")
def ab_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ab")
    s = generate.steady_state(seed=1, n_jobs=120)
    inv, w = s.inventory_obj(), s.weights_obj()
    for policy, name in (("easy", "baseline"), ("lattice", "candidate")):
        r = simulate(s.events, inv, policy=policy, weights_by_vcluster=w, trace_name=s.name)
        write_outputs(r, root / name, plots=False)
    return root / "baseline", root / "candidate"


def test_compare_output_has_arrows_percentages_and_verdicts(ab_dirs):
    base, cand = ab_dirs
    out = compare_dirs(base, cand)
    lines = out.splitlines()
    assert lines[0] == "=== RM-Replay Results: candidate ==="
    assert "(baseline: baseline)" in lines[1]
    assert "Policy: lattice (baseline: easy)" in out
    assert re.search(r"  p50: .+ \(baseline: .+\) (↑|↓|=) ", out)
    assert re.search(r"[↑↓] \d+(\.\d)?%", out), out
    assert re.search(r"^  [↑↓=] .* vs baseline \(\d+\.\d%\)", out, re.M), out  # utilization line
    assert "(lower is better)" in out or "(higher is better)" in out
    for heading in (
        "Utilization:",
        "Wait Time:",
        "Fairness (Jain's Index):",
        "Tenant Share Deviation:",
        "Backfill:",
        "Preemptions:",
    ):
        assert heading in lines
    assert "Summary:" in lines
    assert re.search(r"^\d+ metrics better, \d+ worse", lines[-1])


def test_main_prints_and_checks_dirs(ab_dirs, capsys, tmp_path):
    base, cand = ab_dirs
    assert compare.main([str(base), str(cand)]) == 0
    assert "=== RM-Replay Results: candidate ===" in capsys.readouterr().out
    assert compare.main([str(base), str(tmp_path)]) == 2
    assert "no metrics.json" in capsys.readouterr().err


def test_change_direction_and_verdict():
    c = change(600.0, 720.0, LOWER, "duration")  # wait 10 -> 12 min
    assert (c.arrow, round(c.pct), c.verdict) == ("↑", 20, "worse")
    c = change(0.87, 0.94, HIGHER, "index")
    assert (c.arrow, round(c.pct), c.verdict) == ("↑", 8, "better")
    c = change(0.087, 0.032, LOWER, "ratio")  # max deviation 8.7% -> 3.2%
    assert (c.arrow, round(c.pct), c.verdict) == ("↓", -63, "better")
    assert c.pp == pytest.approx(-5.5)
    c = change(367, 342, None, "count")  # backfill jobs: no better direction
    assert (c.arrow, c.verdict) == ("↓", "")
    assert change(5, 5, LOWER, "count").arrow == "="
    assert change(None, 5, LOWER, "count").verdict == "n/a"
    c = change(0.0, 30.0, LOWER, "duration")
    assert c.arrow == "↑" and c.pct is None and c.verdict == "worse"


def test_guide_example_numbers_render_like_the_guide():
    def metrics(util, p50, p95, p99, jain, dev, bf, pre):
        return {
            "run": {"trace": "week", "policy": "lattice", "seed": 0, "gpus": 1, "makespan_s": 1.0},
            "utilization": {
                "gpu_utilization": util,
                "gpu_hours_used": util * 1_500_000,
                "gpu_hours_available": 1_500_000,
                "node_utilization": util,
            },
            "wait": {"overall": {"p50_s": p50, "p95_s": p95, "p99_s": p99}, "by_class": {}},
            "fairness": {"jain_index": jain, "max_share_deviation": dev},
            "backfill": {"jobs": bf},
            "preemption": {"total": pre},
        }

    base = metrics(0.844, 600, 2.5 * 3600, 12.1 * 3600, 0.87, 0.087, 367, 12)
    cand = metrics(0.823, 720, 2.1 * 3600, 8.3 * 3600, 0.94, 0.032, 342, 15)
    out = compare.render_comparison(
        (base, None), (cand, None), base_name="baseline", cand_name="fairness-boost"
    )
    assert "↓ 2.1 pp (2.5%) vs baseline (84.4%)  worse (higher is better)" in out
    assert "p50: 12 min (baseline: 10 min) ↑ 20%  worse (lower is better)" in out
    assert "p95: 2.1 hr (baseline: 2.5 hr) ↓ 16%  better" in out
    assert "p99: 8.3 hr (baseline: 12.1 hr) ↓ 31%  better" in out
    assert "0.94 (baseline: 0.87) ↑ 8.0%  better (higher is better)" in out
    assert "Max deviation: 3.2% (baseline: 8.7%) ↓ 5.5 pp (63%)  better" in out
    assert "Backfill jobs: 342 (baseline: 367) ↓ 6.8%" in out
    assert "Total: 15 (baseline: 12) ↑ 25%  worse" in out
