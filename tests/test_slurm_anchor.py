"""The Slurm anchor the throughput benchmarks compare against: Debian's slurm-wlm,
started privately on loopback, measured, and stopped again.

Skips (saying why) where slurm-wlm and munge cannot be installed or run (not root, no
apt). Figures are not asserted: only that both measurements happen and every daemon the
anchor started is gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import _slurm  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm_ready() -> None:
    why = _slurm.ensure_installed()
    if why is not None:
        pytest.skip(f"Slurm anchor unavailable: {why}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes (its parent has not reaped it yet)
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return stat[0] != "Z"


def test_anchor_script_prints_both_rates(slurm_ready: None) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "slurm_anchor.py"), "--quick", "--nodes", "2", "--jobs", "20"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["available"] is True, res
    assert res["submit"]["submitted"] > 0 and res["par_submits_per_s"] > 0, res["submit"]
    assert res["e2e"]["2"]["jobs"] == 20 and res["jobs_per_s"]["2"] > 0, res["e2e"]
    assert "SchedulerType=sched/builtin" in res["config"]


def test_jobs_run_and_every_daemon_is_stopped(slurm_ready: None) -> None:
    with _slurm.slurm_cluster(2) as c:
        pids = c.pids()
        base = c.base
        assert set(pids) == {"munged", "slurmctld", "slurmd-n1", "slurmd-n2"}
        out = _slurm.end_to_end(c, jobs=6, clients=3)
        assert out["jobs"] == 6 and not out["errors"]
        assert c.active_jobs() == 0
    assert not [n for n, p in pids.items() if _alive(p)]
    # its files go when the benchmark ends (_common.remove_at_exit), not before the
    # Lattice side's runs: a mass removal slows the creates that follow on some file systems
    assert base.exists() and base in _common._TO_REMOVE
    _common.remove_registered()
    assert not base.exists()
