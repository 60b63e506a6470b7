"""The regression suite as CI runs it: generate, replay with the real scheduler, check."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from rm_replay import generate, regress


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("regress")
    t0 = time.perf_counter()
    rc = regress.main(["--out", str(out)])
    return rc, out, time.perf_counter() - t0


def _table(capsys_text: str) -> list[list[str]]:
    rows = []
    for line in capsys_text.splitlines():
        parts = re.split(r"\s{2,}", line.strip())
        if parts and parts[0] in generate.REGRESSION_TRACES and len(parts) == 5:
            rows.append(parts)
    return rows


def test_regression_suite_passes(suite):
    rc, out, seconds = suite
    assert rc == 0, "a regression threshold was missed: run `rm-replay regress` to see the table"
    assert seconds < 120
    for name in generate.REGRESSION_TRACES:
        d = out / "results" / name
        assert (d / "metrics.json").is_file() and (d / "report.txt").is_file()
        assert (out / "traces" / f"{name}.trace").is_file()


def test_table_rows_and_thresholds(tmp_path: Path):
    rows = regress.run_suite(tmp_path, traces=("sensitive-claim", "burst"))
    text = regress.render_table(rows)
    table = _table(text)
    assert [r[0] for r in table] == ["sensitive-claim", "burst"]
    assert table[0][1] == "sensitive wait" and table[0][3] == "= 0 (immediate)"
    assert table[1][3] == "< 4 h"
    assert all(r[4] == "PASS" for r in table), text
    assert text.splitlines()[0].split() == ["trace", "metric", "value", "threshold", "result"]
    m = json.loads((tmp_path / "results" / "sensitive-claim" / "metrics.json").read_text())
    assert m["sensitive"]["jobs"] == 40 and m["sensitive"]["max_s"] == 0.0


def test_every_spec_threshold_is_checked(suite):
    _, out, _ = suite
    checked = {(c.trace, c.threshold) for c in regress.CHECKS}
    assert ("steady-state", "> 85%") in checked
    assert ("burst", "< 4 h") in checked
    assert ("unfair", "< 10%") in checked
    assert ("sensitive-claim", "= 0 (immediate)") in checked
    assert ("preemption-heavy", "> 95%") in checked
    assert {c.trace for c in regress.CHECKS} == set(generate.REGRESSION_TRACES)
    m = json.loads((out / "results" / "preemption-heavy" / "metrics.json").read_text())
    assert m["checkpoint"]["attempted"] > 50


def test_known_failures_are_reported_not_hidden(tmp_path: Path, monkeypatch, capsys):
    """A known failure does not fail a lenient run but is listed as KNOWN-FAIL; --strict
    (the default) fails on it; and a known failure that passes fails the run as XPASS
    until its entry is removed."""
    key = ("burst", "p99 wait")
    monkeypatch.setitem(regress.KNOWN_FAILURES, key, "a deliberate entry for this test")
    rows = regress.run_suite(tmp_path / "xpass", traces=("burst",))
    assert [r.status for r in rows] == ["XPASS"] and rows[0].failed, regress.render_table(rows)

    never = [
        regress.Check(c.trace, c.metric, c.threshold, c.value, lambda _v: False, c.fmt)
        if (c.trace, c.metric) == key
        else c
        for c in regress.CHECKS
    ]
    monkeypatch.setattr(regress, "CHECKS", tuple(never))
    rc = regress.main(
        ["--out", str(tmp_path / "lenient"), "--trace", "burst", "--allow-known-failures"]
    )
    text = capsys.readouterr().out
    row = next(r for r in _table(text) if r[0] == "burst")
    assert (rc, row[4]) == (0, "KNOWN-FAIL"), text
    assert "a deliberate entry for this test" in text and "1 known failure" in text
    rc = regress.main(["--out", str(tmp_path / "strict"), "--trace", "burst"])
    text = capsys.readouterr().out
    assert (rc, next(r for r in _table(text) if r[0] == "burst")[4]) == (1, "FAIL"), text


def test_unfair_trace_share_deviation_is_within_threshold(suite):
    """The heavy tenant is held near its fair share (the spec's < 10%), not at its share
    of the demand, and the light tenants get about what they asked for."""
    _, out, _ = suite
    f = json.loads((out / "results" / "unfair" / "metrics.json").read_text())["fairness"]
    assert f["max_share_deviation"] < 0.10
    rows = f["tenants"]
    assert rows["physics"]["demand_node_hours"] > 2.5 * rows["biology"]["demand_node_hours"]
    assert rows["physics"]["share"] < 0.40
    for t in ("biology", "chemistry", "climate"):
        assert rows[t]["share"] > 0.18
