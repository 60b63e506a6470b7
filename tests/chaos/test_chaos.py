"""The bounded chaos run of the default suite: a 3-member quorum, a scheduler and three
agents under a steady submission load while every fault of the failure-mode table is
injected at least once (tests/chaos/README.md), then the history checker.

Environment: ``LATTICE_CHAOS_SEED`` (default: random, printed), ``LATTICE_CHAOS_DURATION``
(seconds of faults, default 150; every fault still runs once), ``LATTICE_CHAOS_FAULTS``
(a comma-separated subset; default every fault but those in ``faults.KNOWN_DEFECTS``:
the leader partition, whose lost acknowledgements are an open defect). The long version is ``scripts/chaos --seed 42 --duration 1800``.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from chaosrun import run_chaos
from faults import ALL_FAULTS, KNOWN_DEFECTS, parse_faults

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_bounded_chaos_run_loses_no_acknowledged_submission(tmp_path):
    seed = int(os.environ.get("LATTICE_CHAOS_SEED") or random.SystemRandom().randrange(1 << 31))
    duration = float(os.environ.get("LATTICE_CHAOS_DURATION") or 150)
    # every fault but those with an open defect behind them (faults.KNOWN_DEFECTS)
    bounded = tuple(f for f in ALL_FAULTS if f not in KNOWN_DEFECTS)
    faults = parse_faults(os.environ.get("LATTICE_CHAOS_FAULTS"), default=bounded)
    result = run_chaos(
        tmp_path / "chaos",
        seed=seed,
        duration=duration,
        faults=faults,
        log=lambda s: print(s, flush=True),
    )
    summary = result.summary()
    print(result.report.text())
    print(json.dumps(summary, sort_keys=True, default=str))
    report = result.report
    assert report.counts["acknowledged_submissions"] >= 20, "the load did not get going"
    # every fault that can run here ran (those that cannot say why in faults_skipped)
    assert set(summary["faults_injected"]) | set(result.skipped) == set(faults)
    assert report.by_kind("lost_ack") == [], f"seed {seed}\n{report.text()}"
    assert report.by_kind("double_ownership") == [], f"seed {seed}\n{report.text()}"
    assert report.ok, f"seed {seed}\n{report.text()}"
    assert result.problems == [], f"seed {seed}: faults that did not heal: {result.problems}"
